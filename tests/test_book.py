"""The book's build: every page executed afresh, no cell errors, Sphinx warnings are errors
(including any cell writing to stderr), and no measured number typed into prose. The build is
the one `make book` makes and tests/test_browser.py reads (tools/book_build.py): made once for
the sources as they are."""

import json
import re
from pathlib import Path

import book_build
import pytest

from bp_mech import ROOT


def prose_lines(path: Path):
    inside = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith(("```", "~~~")):
            inside = not inside
            continue
        if not inside:
            yield n, line


MEASURED = re.compile(r"\d+(\.\d+)?\s*(%|×|x faster|x slower| MiB| GiB| KiB| ms\b| s\b)")


def test_no_measured_number_is_typed_into_the_front_pages():
    """The chapters and the appendix: tests/book/test_prose.py (every digit). The front pages (landing,
    quickstart, registry) state requirements and versions, so only measured-looking quantities count."""
    hits = []
    for p in (ROOT / "book").glob("*.md"):
        for n, line in prose_lines(p):
            if "{glue" in line or "reference" in line.lower() or "seed" in line.lower():
                continue
            if MEASURED.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "glue these from computed values or records:\n" + "\n".join(hits)


@pytest.mark.book
def test_strict_book_build():
    """Every page executed afresh, warnings are errors: the build of the current sources (`make book`'s,
    when it has built them already), which tests/test_browser.py then reads."""
    config = (ROOT / "_config.yml").read_text()
    assert "execute_notebooks: force" in config and "allow_errors: false" in config
    build = book_build.current_build()
    assert build.digest == book_build.source_digest()
    log = build.log
    assert build.returncode == 0, log[-6000:]
    assert build.clean, log[-6000:]
    html = build.html
    assert (html / "index.html").exists() and (html / "book" / "part02" / "09-local-backward.html").exists()
    page = (html / "book" / "part02" / "09-local-backward.html").read_text()
    assert "Traceback" not in page and "glue" not in re.sub(r"<[^>]+>", "", page).split("Exercises")[0].lower()
    # math ships with the build: the page loads the packaged MathJax, which is there
    assert "_static/mathjax/tex-chtml.js" in page and (html / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert "cdn.jsdelivr.net" not in page and "mathjax@" not in page
    # the executed chapter is offered for download, with its outputs
    assert "_sources/book/part02/09-local-backward.ipynb" in page
    nb = json.loads((html / "_sources" / "book" / "part02" / "09-local-backward.ipynb").read_text())
    assert any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_every_test_file_that_reads_the_build_runs_on_the_building_worker():
    """A test file that calls ``current_build()`` outside the book group would block the other xdist worker
    for the whole build (tests/conftest.py's BOOK_TESTS)."""
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    readers = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
               if "current_build()" in p.read_text()}
    assert readers and all(f'"{r}"' in conftest.split("BOOK_TESTS = ")[1].split(")")[0] for r in readers), readers
