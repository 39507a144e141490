"""The one build of the book: `make book` makes it, the tests read it.

    python tools/book_build.py            # build into _build/html unless the last build is of these sources
    python tools/book_build.py --records  # run every page once to compute its computed records (make records)

The build executes every page afresh (``execute_notebooks: force``), turns Sphinx warnings into errors
(``-W``, with ``--keep-going`` so the log lists them all) and goes to ``_build/html``. Beside it,
``_build/stamp.json`` records the digest of the sources it was built from (``source_digest``: the
configuration, the pages, the package, the exercises and answers, the records) and whether it came out
clean; ``_build/build.log`` keeps jupyter-book's output. ``current_build()`` gives that build back while the
sources are unchanged and builds afresh otherwise, under a file lock: `make book` followed by `make test`
builds the book once, and so does a test run whose workers both need it (tests/test_book.py checks the
build, tests/test_browser.py reads it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "_build"  # jupyter-book's output folder (git-ignored)
HTML = BUILD / "html"
STAMP = BUILD / "stamp.json"
LOG = BUILD / "build.log"
LOCK = BUILD / "build.lock"
SOURCES = ("_config.yml", "_toc.yml", "book", "src/bp_mech", "exercises", "answers")  # what the pages are built from
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", "_build"}
# pages read and executed side by side (Sphinx's parallel read; every extension the book uses declares it safe): on
# two cores the cold build's pages take about half the time; BP_MECH_BOOK_JOBS=1 builds one page at a time
JOBS = int(os.environ.get("BP_MECH_BOOK_JOBS", min(2, os.cpu_count() or 1)))
# jupyter-book's command line, with Sphinx's ``parallel`` (its ``build_sphinx`` takes ``jobs``; the CLI offers none)
# and one page per parallel chunk, longest first (``page_order``). Sphinx cuts the sorted pages into ``jobs``
# runs of consecutive pages: the live-run chapters (19 to 76) fell into one, which took 176 s of executed pages
# while the other was done after 111 s. Page by page, longest first (``chunks``), a free worker takes the next.
_JB = """
import functools, json, sys
sys.path.insert(0, sys.argv.pop(1))
import book_build
import jupyter_book.sphinx as s
import sphinx.builders as b
from jupyter_book.cli.main import main
s.build_sphinx = functools.partial(s.build_sphinx, jobs=int(sys.argv.pop(1)))
b.make_chunks = functools.partial(book_build.chunks, order=json.loads(sys.argv.pop(1)))
main()
"""


def chunks(docs: list[str], nproc: int, maxbatch: int = 10, *, order: list[str] = ()) -> list[list[str]]:
    """Sphinx's ``make_chunks`` for the build: one page per chunk, so that Sphinx's ``ParallelTasks`` runs them
    in ``order`` (pages it does not name first). It starts the first ``nproc`` chunks, then always the last
    one still waiting; hence the rest go in reversed."""
    rank = {d: i for i, d in enumerate(order)}
    docs = sorted(docs, key=lambda d: rank.get(d, -1))
    return [[d] for d in docs[:nproc] + docs[nproc:][::-1]]


def page_order() -> list[str]:
    """The book's pages (Sphinx docnames), the longest to execute first: the seconds the last build's log gives
    a page (``Executed notebook in ... seconds``), else its source's size at the log's seconds per byte (at
    one second per kilobyte without a log)."""
    pages = sorted((ROOT / "book").rglob("*.md"))
    seconds = {}
    if LOG.is_file():
        for m in re.finditer(r"^(\S+\.md): Executed notebook in ([0-9.]+) seconds", LOG.read_text(encoding="utf-8"),
                             re.M):
            seconds[Path(m.group(1)).resolve()] = float(m.group(2))
    known = [p for p in pages if p in seconds]
    rate = sum(seconds[p] for p in known) / sum(p.stat().st_size for p in known) if known else 1e-3
    cost = {p: seconds.get(p, p.stat().st_size * rate) for p in pages}
    return [str(p.relative_to(ROOT).with_suffix("")) for p in sorted(pages, key=cost.get, reverse=True)]


def jupyter_book(*args: str) -> list[str]:
    """The command that runs ``jupyter-book build ROOT *args`` with ``JOBS`` pages at a time."""
    return [sys.executable, "-c", _JB, str(ROOT / "tools"), str(JOBS), json.dumps(page_order()), "build", str(ROOT),
            *args]


def source_files() -> list[Path]:
    """The files the book is built from: under SOURCES, those git tracks or would track (ignored ones, such
    as what a page writes while it runs, are not sources); every file there without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
                             cwd=ROOT, capture_output=True, check=True).stdout.decode()
        files = sorted({ROOT / f for f in out.split("\0") if f})
    except (OSError, subprocess.CalledProcessError):  # not a git work tree
        files = sorted(p for name in SOURCES
                       for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*")))
    return [p for p in files if p.is_file() and SKIP_PARTS.isdisjoint(p.relative_to(ROOT).parts) and p.suffix != ".pyc"]


def source_digest() -> str:
    """SHA-256 over the paths and bytes of every file the book is built from."""
    h = hashlib.sha256()
    for p in source_files():
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass
class Build:
    """A build of the book: how jupyter-book exited, its output, the sources' digest, where the HTML is."""

    returncode: int
    log: str  # stdout + stderr of jupyter-book
    digest: str  # source_digest() taken before the build started
    html: Path
    reused: bool = False  # True: the build of an earlier run, of the same sources

    @property
    def clean(self) -> bool:
        """Succeeded with no warning (``-W`` makes warnings errors; ``--keep-going`` lists them all)."""
        return self.returncode == 0 and "build succeeded" in self.log and "WARNING" not in self.log


def build() -> Build:
    """Build the book afresh into ``_build/html``, every page executed, warnings as errors; stamp it."""
    digest = source_digest()
    shutil.rmtree(HTML, ignore_errors=True)
    shutil.rmtree(BUILD / "jupyter_execute", ignore_errors=True)
    BUILD.mkdir(exist_ok=True)
    cmd = jupyter_book("--builder", "html", "-W", "-n", "--keep-going")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1"))
    b = Build(p.returncode, p.stdout + p.stderr, digest, HTML)
    LOG.write_text(b.log, encoding="utf-8")
    STAMP.write_text(json.dumps({"digest": digest, "returncode": b.returncode}), encoding="utf-8")
    return b


def last_build() -> Build | None:
    """The build the last run left, if its HTML, log and stamp are all there."""
    if not (STAMP.is_file() and LOG.is_file() and (HTML / "index.html").is_file()):
        return None
    stamp = json.loads(STAMP.read_text(encoding="utf-8"))
    return Build(stamp["returncode"], LOG.read_text(encoding="utf-8"), stamp["digest"], HTML, reused=True)


def current_build() -> Build:
    """The build of the sources as they are now: the last one when its digest matches, else a new one.
    Callers in several processes at once wait for one another (a file lock), so the book is built once."""
    from filelock import FileLock

    BUILD.mkdir(exist_ok=True)
    with FileLock(str(LOCK)):
        last = last_build()
        if last is not None and last.digest == source_digest():
            return last
        return build()


def compute_records() -> int:
    """Run every page once with ``BP_MECH_COMPUTE=refresh`` (``records.computed``): each computed record a
    page asks for is traced and saved. The HTML goes to ``_build/records`` and is not the book."""
    out = BUILD / "records"
    shutil.rmtree(out, ignore_errors=True)
    cmd = jupyter_book("--builder", "html", "--path-output", str(out))
    p = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=7200,
                       env=dict(os.environ, BP_MECH_COMPUTE="refresh", PYDEVD_DISABLE_FILE_VALIDATION="1"))
    if p.returncode:
        print((p.stdout + p.stderr)[-6000:], file=sys.stderr)
    return p.returncode


def main() -> int:
    if sys.argv[1:] == ["--records"]:
        return compute_records()
    b = current_build()
    print(b.log[-3000:] if not b.clean else f"book: {b.html / 'index.html'}"
          + (" (unchanged sources: the last build)" if b.reused else ""))
    return 0 if b.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
