"""The strict book build: every page executed afresh, no cell errors, Sphinx warnings are
errors (including any cell writing to stderr), and no measured number typed into prose."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JB = Path(sys.executable).with_name("jupyter-book")


def prose_lines(path: Path):
    inside = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith(("```", "~~~")):
            inside = not inside
            continue
        if not inside:
            yield n, line


MEASURED = re.compile(r"\d+(\.\d+)?\s*(%|×|x faster|x slower| MiB| GiB| KiB| ms\b| s\b)")


def test_no_measured_number_is_typed_into_prose():
    hits = []
    for p in (ROOT / "book").rglob("*.md"):
        for n, line in prose_lines(p):
            if "{glue" in line or "reference" in line.lower() or "seed" in line.lower():
                continue
            if MEASURED.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "glue these from computed values or records:\n" + "\n".join(hits)


@pytest.mark.book
def test_strict_book_build(tmp_path):
    config = (ROOT / "_config.yml").read_text()
    assert "execute_notebooks: cache" in config and "allow_errors: false" in config
    strict = tmp_path / "_config.yml"
    strict.write_text(config.replace("execute_notebooks: cache", "execute_notebooks: force"))
    cmd = [str(JB), "build", str(ROOT), "--config", str(strict), "--path-output", str(tmp_path),
           "--builder", "html", "-W", "-n", "--keep-going"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1"))
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "build succeeded" in log and "WARNING" not in log, log[-6000:]
    html = tmp_path / "_build" / "html"
    assert (html / "index.html").exists() and (html / "book" / "part02" / "09-local-backward.html").exists()
    page = (html / "book" / "part02" / "09-local-backward.html").read_text()
    assert "Traceback" not in page and "glue" not in re.sub(r"<[^>]+>", "", page).split("Exercises")[0].lower()
