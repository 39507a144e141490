"""One strict build of the book, shared by tests/test_book.py (which makes it) and
tests/test_browser.py (which reads it).

The strict build executes every page afresh (``execute_notebooks: force``) and turns Sphinx
warnings into errors. It goes to ``_build/strict``; beside it, ``stamp.json`` records the digest of
the sources it was built from and whether it passed. The browser test reuses that build while the
sources are unchanged, and builds afresh otherwise. ``BP_MECH_BOOK_HTML=<dir>`` points it at an
existing ``_build/html`` instead (e.g. ``make book``'s, to iterate on the browser test quickly).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from bp_mech import ROOT
JB = Path(sys.executable).with_name("jupyter-book")
STRICT = ROOT / "_build" / "strict"  # --path-output of the strict build (under the git-ignored _build/)
HTML = STRICT / "_build" / "html"
STAMP = STRICT / "stamp.json"
SOURCES = ("_config.yml", "_toc.yml", "book", "src/bp_mech", "exercises", "answers")  # what the pages are built from
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", "_build"}


def source_files() -> list[Path]:
    """The files the book is built from: under SOURCES, those git tracks or would track (ignored
    ones, such as what a page writes while it runs, are not sources); every file without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
                             cwd=ROOT, capture_output=True, check=True).stdout.decode()
        files = sorted({ROOT / f for f in out.split("\0") if f})
    except (OSError, subprocess.CalledProcessError):  # not a git work tree
        files = sorted(p for name in SOURCES for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*")))
    return [p for p in files if p.is_file() and SKIP_PARTS.isdisjoint(p.relative_to(ROOT).parts) and p.suffix != ".pyc"]


def source_digest() -> str:
    """SHA-256 over the paths and bytes of every file the book is built from."""
    h = hashlib.sha256()
    for p in source_files():
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def strict_config(dest: Path) -> Path:
    """``_config.yml`` with forced execution, its local extension paths made absolute (the config
    file moves, and jupyter-book resolves them against its folder), written to ``dest``."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    config["execute"]["execute_notebooks"] = "force"
    local = config.get("sphinx", {}).get("local_extensions") or {}
    for name, path in local.items():
        local[name] = str((ROOT / path).resolve())
    dest.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dest


@dataclass
class Build:
    returncode: int
    log: str  # stdout + stderr of jupyter-book
    digest: str  # source_digest() taken before the build started
    html: Path

    @property
    def clean(self) -> bool:
        """Succeeded with no warning (``-W`` makes warnings errors; ``--keep-going`` lists them all)."""
        return self.returncode == 0 and "build succeeded" in self.log and "WARNING" not in self.log

    def stamp(self, passed: bool) -> None:
        STAMP.write_text(json.dumps({"digest": self.digest, "passed": passed}), encoding="utf-8")


def strict_build() -> Build:
    """Build the book strictly into ``_build/strict`` (from scratch)."""
    digest = source_digest()
    shutil.rmtree(STRICT, ignore_errors=True)
    STRICT.mkdir(parents=True)
    config = strict_config(STRICT / "_config.yml")
    cmd = [str(JB), "build", str(ROOT), "--config", str(config), "--path-output", str(STRICT),
           "--builder", "html", "-W", "-n", "--keep-going"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1"))
    return Build(p.returncode, p.stdout + p.stderr, digest, HTML)


def last_stamp() -> dict | None:
    """What the last strict build left: {"digest": ..., "passed": bool}, or None."""
    if not STAMP.is_file() or not (HTML / "index.html").is_file():
        return None
    return json.loads(STAMP.read_text(encoding="utf-8"))
