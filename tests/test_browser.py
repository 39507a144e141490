"""The built book as a reader sees it: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) reads ``_build/html`` served on a loopback port, with
every request outside the loopback address refused.

It opens the landing page and every page of the table of contents and asserts: every formula
typeset by the MathJax that ships with the build (no raw ``\\(`` or ``$$`` left), every figure
loaded, every glued value present and non-empty, no error or stderr output cell, no table, code
block, figure or display formula wider than the content column unless inside a scroll container,
no console error from the book's own assets, no request that left the loopback address. Then: the
exercise answers open, the search page finds each chapter from a word of its title, the landing
page maps every chapter, and one chapter downloaded as ``.ipynb`` from its page runs again with
nbclient in this (TRAIN-CPU) environment. A full-page screenshot of each page goes to the test's
temporary folder.

The book is the strict build tests/test_book.py leaves (tests/book_build.py), built here when it
is missing or older than the sources. Without Chromium the test skips, saying why; under CI
(``$CI`` set) it fails instead.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import book_build
import pytest

pytestmark = pytest.mark.browser

from bp_mech import ROOT
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1280, 900)  # a laptop screen: the theme shows both sidebars, so the content column is at its narrowest
TAKEAWAY = "book/part02/09-local-backward"  # the chapter downloaded as .ipynb and run again (~15 s)
SUMMARY: dict = {"pages": 0, "formulas": 0, "figures": 0, "glued": 0, "tables": 0, "code blocks": 0,
                 "answers opened": 0}


def toc_pages() -> list[str]:
    """Every page of the table of contents (docnames), from the sources: the landing page, the
    front matter, the chapters of Part 02 and the projects."""
    book = ROOT / "book"
    front = ["book/index", "book/quickstart", "book/registry"]
    chapters = sorted(p for d in ("part02", "projects") for p in (book / d).glob("*.md"))
    return front + [str(p.relative_to(ROOT).with_suffix("")) for p in chapters]


PAGES = toc_pages()
CHAPTERS = [p for p in PAGES if p.startswith(("book/part02/", "book/projects/"))]


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing: apt-get install chromium chromium-driver (Debian's packages; .ci/run does it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is missing: pip install -r requirements/book.txt"
    return None


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
    stamp = book_build.last_stamp()
    if stamp and stamp["digest"] == book_build.source_digest():
        if not stamp["passed"]:
            pytest.fail("the strict build of these sources failed: see tests/test_book.py::test_strict_book_build")
        return book_build.HTML
    build = book_build.strict_build()  # none yet, or the sources changed since
    build.stamp(build.clean)
    if not build.clean:
        pytest.fail("the strict book build failed:\n" + build.log[-6000:])
    return build.html


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(html_dir):
    """The book served on 127.0.0.1 (a free port); yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def driver(site, tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                 # every request outside loopback goes to a proxy that is not there: refused
                 # (loopback itself bypasses proxies); the performance log shows any attempt
                 "--proxy-server=http://127.0.0.1:9"):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # Selenium Manager must not look for (or download) a browser or driver
        d = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    d.set_page_load_timeout(60)
    d.set_script_timeout(60)
    yield d
    d.quit()


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


# --- what a page shows ---------------------------------------------------------------------------

WAIT_READY = """
const done = arguments[arguments.length - 1];
(async () => {
  if (document.querySelector('.math')) {           // the page has formulas: MathJax must load and finish
    for (let i = 0; i < 300 && !(window.MathJax && MathJax.startup && MathJax.startup.promise); i++)
      await new Promise(r => setTimeout(r, 100));
    if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) return done('MathJax did not load');
    await MathJax.startup.promise;
  }
  await Promise.all([...document.images].map(img => img.complete ? null :
    new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); })));
  done('');
})().catch(e => done(String(e)));
"""

AUDIT = r"""
const col = document.querySelector('article.bd-article') || document.querySelector('main');
const colBox = col.getBoundingClientRect();
const inside = (el, sel) => !!el.closest(sel);
const shown = el => { const b = el.getBoundingClientRect(); return b.width > 0 && b.height > 0; };
const out = {};

const math = [...col.querySelectorAll('.math')];
out.formulas = math.length;
out.untypeset = math.filter(m => !m.querySelector('mjx-container')).map(m => m.textContent.slice(0, 80));
out.math_errors = [...col.querySelectorAll('mjx-merror')].map(e => e.getAttribute('data-mjx-error') || e.textContent);

// raw TeX left in the text a reader sees (code blocks and scripts excepted)
const walker = document.createTreeWalker(col, NodeFilter.SHOW_TEXT);
out.raw_tex = [];
for (let n = walker.nextNode(); n; n = walker.nextNode()) {
  const el = n.parentElement;
  if (inside(el, 'pre, code, script, style, mjx-container, .highlight')) continue;
  const m = n.textContent.match(/\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\{glue/);
  if (m) out.raw_tex.push(n.textContent.trim().slice(0, 100));
}

out.figures = [...col.querySelectorAll('img')].length;
out.broken_images = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);

const glued = [...col.querySelectorAll('[class*="pasted"]')];
out.glued = glued.length;
out.empty_glue = glued.filter(g => !g.textContent.trim() && !g.querySelector('img, table, mjx-container'))
                      .map(g => g.outerHTML.slice(0, 120));

out.error_outputs = [...col.querySelectorAll('.cell_output .output.traceback, .cell_output .output.error, .cell_output .output.stderr')]
  .map(o => o.textContent.trim().slice(0, 200));

// wider than the column, and not inside a scroll container that fits the column
const scrolls = el => { const o = getComputedStyle(el).overflowX; return o === 'auto' || o === 'scroll'; };
const fits = b => b.left >= colBox.left - 1 && b.right <= colBox.right + 1;
function extent(el) {   // the box, plus content that spills out of a box that does not scroll
  const b = el.getBoundingClientRect();
  const spill = scrolls(el) ? 0 : Math.max(0, el.scrollWidth - el.clientWidth);
  return {left: b.left, right: b.right + spill};
}
out.tables = 0; out.code_blocks = 0; out.too_wide = [];
const wide = [...col.querySelectorAll('table, pre, div.highlight, img, mjx-container[display="true"]')].filter(shown);
for (const el of wide) {
  if (el.tagName === 'TABLE') out.tables++;
  if (el.tagName === 'PRE') out.code_blocks++;
  if (fits(extent(el))) continue;
  let a = el.parentElement, ok = false;
  for (; a && a !== col.parentElement; a = a.parentElement)
    if (scrolls(a)) { ok = fits(a.getBoundingClientRect()); break; }
  if (!ok) out.too_wide.push(`${el.tagName.toLowerCase()}.${el.className} right edge ${Math.round(extent(el).right)} > column ${Math.round(colBox.right)}: ${el.textContent.trim().slice(0, 60)}`);
}
out.page_scrolls_sideways = document.documentElement.scrollWidth > window.innerWidth + 1;

const nb = document.querySelector('a.btn-download-notebook-button, .btn-download-notebook-button');
out.notebook_link = nb ? (nb.href || nb.getAttribute('href') || (nb.closest('a') || {}).href || '') : '';
return out;
"""


def outside_requests(entries) -> list[str]:
    """URLs the page asked for that are not on the book's loopback server (http, https, ws)."""
    urls = []
    for e in entries:
        msg = json.loads(e["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            url = msg["params"]["request"]["url"]
            host = urllib.parse.urlsplit(url).hostname or ""
            if url.split(":", 1)[0] in ("http", "https", "ws", "wss") and host not in ("127.0.0.1", "localhost"):
                urls.append(url)
    return urls


def console_errors(entries, base: str) -> list[str]:
    """Console errors from the book's own assets (a failed load, a script error); the browser's
    automatic /favicon.ico request is not the book's (it has none)."""
    return [e["message"] for e in entries if e["level"] == "SEVERE"
            and (base in e["message"] or e.get("source") in ("javascript", "console-api"))
            and "favicon.ico" not in e["message"]]


def screenshot(driver, path: Path) -> None:
    """The whole page: the window made as tall as the page for the shot (a capture beyond the
    viewport misplaces the theme's sticky columns)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WINDOW[0], min(height + 100, 16000))
    driver.save_screenshot(str(path))
    driver.set_window_size(*WINDOW)


def load(driver, url: str) -> None:
    """Open ``url`` and wait until it has loaded (``get`` can return while the document of a
    freshly started navigation is still loading)."""
    driver.get(url)
    for _ in range(300):
        if driver.execute_script("return document.readyState") == "complete" and \
                driver.current_url.split("#")[0].split("?")[0] == url.split("#")[0].split("?")[0]:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not finish loading: at {driver.current_url}")


def open_page(driver, url: str) -> dict:
    driver.get_log("performance"), driver.get_log("browser")  # forget the previous page's
    load(driver, url)
    problem = driver.execute_async_script(WAIT_READY)
    assert not problem, f"{url}: {problem}"
    time.sleep(0.2)  # late console messages
    audit = driver.execute_script(AUDIT)
    audit["url"] = driver.current_url
    audit["outside"] = outside_requests(driver.get_log("performance"))
    audit["console"] = console_errors(driver.get_log("browser"), url.split("/book/")[0])
    return audit


# --- the tests -------------------------------------------------------------------------------------

OPEN_ANSWER = """
const done = arguments[arguments.length - 1];
const box = [...document.querySelectorAll('article .admonition.dropdown')]
  .find(a => /answer/i.test((a.querySelector('.admonition-title') || {}).textContent || ''));
if (!box) return done(null);
const body = () => [...box.children].filter(c => !c.classList.contains('admonition-title'));
const visible = () => body().some(c => c.getBoundingClientRect().height > 0);
const before = visible();
box.scrollIntoView();
(box.querySelector('button.toggle-button') || box.querySelector('.admonition-title')).click();
setTimeout(() => done({before, after: visible(),
                       code: body().some(c => c.querySelector('pre') && c.getBoundingClientRect().height > 0)}), 400);
"""


@pytest.mark.parametrize("page", PAGES)
def test_page_reads_right(page, html_dir, site, driver, shots):
    assert (html_dir / f"{page}.html").is_file(), f"{page}.html was not built: is it in _toc.yml?"
    a = open_page(driver, site + f"{page}.html")
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
    if page in CHAPTERS:
        assert a["notebook_link"].endswith(f"_sources/{page}.ipynb"), f"{page}: no .ipynb download: {a['notebook_link']!r}"
        # the exercise answer is folded away until the reader opens it, and then shows its code
        answer = driver.execute_async_script(OPEN_ANSWER)
        assert answer is not None, f"{page}: no exercise answer dropdown"
        assert not answer["before"], f"{page}: the answer is open before the reader asks"
        assert answer["after"] and answer["code"], f"{page}: the answer did not open to its code"
        SUMMARY["answers opened"] += 1


def test_landing_page_maps_every_chapter(site, driver):
    """The landing page (the site's root redirects to it) lists every chapter of the registry in
    the course's order, with a computed status and whether it needs a GPU, and the set-up commands."""
    from bp_mech.records import registry

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
