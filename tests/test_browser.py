"""The built book as a reader sees it: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) reads ``_build/html`` served on a loopback port, with
every request outside the loopback address refused.

It opens the landing page and every page of the table of contents and asserts: every formula
typeset by the MathJax that ships with the build (no raw ``\\(`` or ``$$`` left), every figure
loaded, every glued value present and non-empty, no error or stderr output cell, no table, code
block, figure or display formula wider than the content column unless inside a scroll container,
no console error from the book's own assets, no request that left the loopback address, and each
chapter's header line tells the evidence ``registry.status`` computes. The text whole
(tests/browser_text.py): no formula MathJax failed on or that holds a control character or a stray
``ext{``, no paragraph that breaks off, no unrendered Markdown table, no shown code line over
``MAX_CODE_LINE`` characters (the pages that fail a check today are listed in ``KNOWN``, strict
xfails). Then: the exercise answers open, the search page finds each chapter from a word of its
title, the landing page maps every chapter, and one chapter downloaded as ``.ipynb`` from its page
runs again with nbclient in this (TRAIN-CPU) environment. A full-page screenshot of each page goes
to the test's temporary folder. tests/test_browser_audit.py tests the audit itself.

The book is the one build of the current sources (tools/book_build.py: `make book`'s or
tests/test_book.py's), built here when there is none yet. Without Chromium the test skips, saying why; under CI
(``$CI`` set) it fails instead.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import book_build
import pytest
from browser_pages import (CHAPTERS, OPEN_ANSWER, PAGES, SUMMARY, TAKEAWAY, WINDOW, browser_missing, chrome, load,
                           open_page, screenshot, serve)

from bp_mech import RESULTS_DIR, ROOT
from bp_mech.records import registry

TEXT_CHECKS = ("broken_math", "unterminated", "raw_markdown", "long_code_lines")  # tests/browser_text.py

pytestmark = pytest.mark.browser


# --- fixtures: the book, a loopback server, the browser ----------------------------------------

@pytest.fixture(scope="module")
def html_dir() -> Path:
    reason = browser_missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    override = os.environ.get("BP_MECH_BOOK_HTML")
    if override:
        return Path(override).resolve()
    build = book_build.current_build()  # `make book`'s or tests/test_book.py's, when of these sources
    if not build.clean:
        pytest.fail("the book's build failed (tests/test_book.py::test_strict_book_build):\n" + build.log[-6000:])
    return build.html


@pytest.fixture(scope="module")
def site(html_dir):
    """The book served on 127.0.0.1 (a free port); yields its base URL."""
    with serve(html_dir) as url:
        yield url


@pytest.fixture(scope="module")
def driver(site, tmp_path_factory):
    with chrome(tmp_path_factory.mktemp("chromium-profile")) as d:
        yield d


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module", autouse=True)
def summary(request, shots):
    """What the browser saw (pages, formulas, figures ... and the time): printed at the end, and
    written beside the screenshots."""
    start = time.perf_counter()
    yield
    if not SUMMARY["pages"]:
        return
    line = "browser: " + ", ".join(f"{v} {k}" for k, v in SUMMARY.items()) + \
        f" in {time.perf_counter() - start:.0f} s; screenshots in {shots}"
    (shots / "summary.txt").write_text(line + "\n", encoding="utf-8")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)


# --- the tests -------------------------------------------------------------------------------------

AUDITS: dict[str, dict] = {}  # page -> what open_page read there (each page is opened once)


def audited(driver, site, html_dir, page: str) -> dict:
    if page not in AUDITS:
        assert (html_dir / f"{page}.html").is_file(), f"{page}.html was not built: is it in _toc.yml?"
        AUDITS[page] = open_page(driver, site + f"{page}.html")
    return AUDITS[page]


@pytest.mark.parametrize("page", PAGES)
def test_page_reads_right(page, html_dir, site, driver, shots):
    AUDITS.pop(page, None)  # read afresh: the answer is opened below
    a = audited(driver, site, html_dir, page)
    screenshot(driver, shots / f"{page.replace('/', '__')}.png")
    SUMMARY["pages"] += 1
    for key, n in (("formulas", "formulas"), ("figures", "figures"), ("glued", "glued"),
                   ("tables", "tables"), ("code blocks", "code_blocks")):
        SUMMARY[key] += a[n]

    assert not a["outside"], f"{page}: requests left the loopback address: {a['outside'][:5]}"
    assert not a["untypeset"], f"{page}: {len(a['untypeset'])} of {a['formulas']} formulas not typeset: {a['untypeset'][:3]}"
    assert not a["math_errors"], f"{page}: MathJax errors: {a['math_errors'][:3]}"
    assert not a["raw_tex"], f"{page}: raw TeX or glue markup in the text: {a['raw_tex'][:3]}"
    assert not a["broken_images"], f"{page}: figures that did not load: {a['broken_images']}"
    assert not a["empty_glue"], f"{page}: empty glued values: {a['empty_glue'][:3]}"
    assert not a["error_outputs"], f"{page}: error output cells: {a['error_outputs'][:3]}"
    assert not a["too_wide"], f"{page}: wider than the content column, no scroll container: {a['too_wide'][:3]}"
    assert not a["page_scrolls_sideways"], f"{page}: the page itself scrolls sideways at {WINDOW[0]} px"
    assert not a["console"], f"{page}: console errors: {a['console'][:5]}"
    if page in CHAPTERS:  # the header line tells what the registry computes from the records
        e = next(e for e in registry.EXPERIMENTS.values() if e.doc == f"{page}.md")
        assert a["header_evidence"] == registry.status(e, ROOT, RESULTS_DIR), f"{page}: header {a['header_evidence']!r}"
        assert a["notebook_link"].endswith(f"_sources/{page}.ipynb"), f"{page}: no .ipynb download: {a['notebook_link']!r}"
        # the exercise answer is folded away until the reader opens it, and then shows its code
        answer = driver.execute_async_script(OPEN_ANSWER)
        assert answer is not None, f"{page}: no exercise answer dropdown"
        assert not answer["before"], f"{page}: the answer is open before the reader asks"
        assert answer["after"] and answer["code"], f"{page}: the answer did not open to its code"
        SUMMARY["answers opened"] += 1


# (check, page) pairs known to fail: each is a strict xfail, so it fails the moment its page is fixed,
# and must then leave this list. None is known today.
KNOWN: dict[str, set[str]] = {
    "broken_math": set(),
    "unterminated": set(),
    "raw_markdown": set(),
    "long_code_lines": set(),
}


def text_cases():
    for page in PAGES:
        for check in TEXT_CHECKS:
            known = page in KNOWN[check]
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError,
                                       reason=f"{check}: a known defect of this page")]
            yield pytest.param(page, check, marks=marks if known else [], id=f"{page}:{check}")


@pytest.mark.parametrize("page, check", list(text_cases()))
def test_page_text_is_whole(page, check, html_dir, site, driver):
    """No broken formula (a control character, a stray ``ext{``), no paragraph that breaks off, no
    Markdown table left unrendered, no code line wider than the column (tests/browser_text.py)."""
    found = audited(driver, site, html_dir, page)[check]
    assert not found, f"{page}: {len(found)} {check}:\n" + "\n".join(found[:10])


def test_landing_page_maps_every_chapter(site, driver):
    """The landing page (the site's root redirects to it) lists every chapter of the registry in
    the course's order, with a computed status and whether it needs a GPU, and the set-up commands."""
    driver.get(site)
    rows = None
    for _ in range(100):  # the root redirects to the landing page
        if driver.current_url.endswith("book/index.html"):
            rows = driver.execute_script("""
              if (document.readyState !== 'complete') return null;
              const h = [...document.querySelectorAll('article h2')].find(h => /map/i.test(h.textContent));
              const t = h && h.closest('section').querySelector('table');
              return t ? [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.textContent.trim())) : null;""")
        if rows:
            break
        time.sleep(0.1)
    assert driver.current_url.endswith("book/index.html"), f"the site's root did not lead to the landing page: {driver.current_url}"
    assert rows, "no map table under a 'map' heading on the landing page"
    expected = sorted(registry.EXPERIMENTS.values(), key=lambda e: e.doc)
    assert [r[1] for r in rows] == [e.semantic_id for e in expected], "chapters missing or out of order"
    for row, e in zip(rows, expected):
        assert row[2] == registry.status(e, ROOT, ROOT / "book" / "results"), f"{e.semantic_id}: status {row[2]!r}"
        assert row[3].startswith("yes" if e.gpu else "no"), f"{e.semantic_id}: GPU column {row[3]!r}"
    links = driver.execute_script("return [...document.querySelectorAll('article a.reference.internal')].map(a => a.href)")
    for e in expected:
        if (ROOT / e.doc).exists():
            assert any(l.split("#")[0].endswith(e.doc.removesuffix(".md") + ".html") for l in links), f"no link to {e.doc}"
    code = driver.execute_script("return [...document.querySelectorAll('article pre')].map(p => p.textContent).join('\\n')")
    assert "make book" in code and "make test" in code


def title_word(title: str) -> str:
    """A word of a chapter's title to search for: its longest word."""
    return max(re.findall(r"[A-Za-z][A-Za-z-]+", title), key=len).lower()


@pytest.mark.parametrize("page", CHAPTERS)
def test_search_finds_chapter(page, html_dir, site, driver):
    built = html_dir / f"{page}.html"
    assert built.is_file(), f"{page}.html was not built: is it in _toc.yml?"
    title = re.sub(r"<[^>]+>", "", re.search(r"<h1>(.*?)</h1>", built.read_text(encoding="utf-8"), re.S).group(1))
    word = title_word(title.replace("#", ""))
    load(driver, site + "search.html?q=" + urllib.parse.quote(word))
    found = None
    for _ in range(100):
        found = driver.execute_script("""
          const s = document.querySelector('#search-results .search-summary, #search-results p');
          const links = [...document.querySelectorAll('#search-results ul.search li a')].map(a => a.href);
          return (links.length || (s && /did not match/.test(s.textContent))) ? links : null;""")
        if found is not None:
            break
        time.sleep(0.1)
    assert found, f"searching {word!r} (from {title.strip()!r}) found nothing"
    assert any(l.split("#")[0].split("?")[0].endswith(f"{page}.html") for l in found), \
        f"searching {word!r} did not find {page}: {found[:5]}"


def test_downloaded_chapter_runs_again(site, driver, tmp_path):
    """The chapter a reader downloads from its page is the executed notebook, and it runs again
    with nbclient in this environment, from a folder of the reader's (not the repository)."""
    import nbclient
    import nbformat

    load(driver, site + f"{TAKEAWAY}.html")
    href = driver.execute_script("const a = document.querySelector('.btn-download-notebook-button');"
                                 "return a ? (a.href || a.closest('a').href) : null")
    assert href and href.endswith(".ipynb"), f"no .ipynb download on {TAKEAWAY}: {href!r}"
    with urllib.request.urlopen(href, timeout=30) as r:  # the loopback server, as the link points
        body = r.read()
    nb = nbformat.reads(body.decode("utf-8"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    shipped = [i for i, c in enumerate(code) if c.outputs]
    assert shipped, "the download is not the executed notebook (no outputs)"
    (tmp_path / "chapter.ipynb").write_bytes(body)
    for c in code:
        c.outputs = []
    where = nbformat.v4.new_code_cell("import sys; print(sys.prefix)")  # which environment the kernel runs in
    nb.cells.append(where)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[:1]
    assert where.outputs[0]["text"].strip() == sys.prefix, "the kernel did not run in this (TRAIN-CPU) environment"
    missing = [i for i in shipped if not code[i].outputs]  # (glue-only cells ship without outputs: MyST-NB keeps those apart)
    assert not missing, f"re-running it left code cells {missing} without the outputs they shipped with"
