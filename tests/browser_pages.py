"""What the browser test reads on a page (tests/test_browser.py): the pages of the table of contents,
why the browser cannot run here, the loopback server and the browser, and the scripts run in each
page (wait for MathJax and images, audit formulas, figures, glued values, widths, and the text with
tests/browser_text.py; open an exercise answer) with their Python helpers."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import json
import threading
import time
import urllib.parse
from pathlib import Path

from browser_text import MAX_CODE_LINE, TEXT_AUDIT

from bp_mech import ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1280, 900)  # a laptop screen: the theme shows both sidebars, so the content column is at its narrowest
TAKEAWAY = "book/part02/09-local-backward"  # the chapter downloaded as .ipynb and run again (~15 s)
SUMMARY: dict = {"pages": 0, "formulas": 0, "figures": 0, "glued": 0, "tables": 0, "code blocks": 0,
                 "answers opened": 0}


def toc_pages() -> list[str]:
    """Every page of the table of contents (docnames, in its order), read from ``_toc.yml``: the
    landing page, the front matter, the chapters of Part 02, the projects, the appendix."""
    import yaml

    def walk(entries):
        for entry in entries or ():
            if "file" in entry:
                yield str(Path(entry["file"]).with_suffix(""))
            elif "glob" in entry:  # jupyter-book's glob: file-name order
                yield from sorted(str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.glob(entry["glob"])
                                  if p.suffix in (".md", ".ipynb"))
            yield from walk(entry.get("sections"))

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    return [toc["root"]] + [page for part in toc.get("parts", ()) for page in walk(part.get("chapters"))]


PAGES = toc_pages()
CHAPTERS = [p for p in PAGES if p.startswith(("book/part02/", "book/projects/"))]


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing: apt-get install chromium chromium-driver (Debian's packages; .ci/run does it)"
    if importlib.util.find_spec("selenium") is None:
        return "selenium is missing: pip install -r requirements/book.txt"
    return None


# --- the book on a loopback port, and the browser -------------------------------------------------

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory: Path):
    """``directory`` served on 127.0.0.1 (a free port); yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chrome(profile: Path):
    """Headless Chromium at WINDOW, every request outside loopback refused, its logs kept."""
    import pytest
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
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # Selenium Manager must not look for (or download) a browser or driver
        d = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    d.set_page_load_timeout(60)
    d.set_script_timeout(60)
    try:
        yield d
    finally:
        d.quit()


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

const evidence = col.querySelector('p.experiment-header .evidence');  // the header line's (book/_ext/bp_book.py)
out.header_evidence = evidence ? evidence.textContent.trim() : null;

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
    audit.update(driver.execute_script(TEXT_AUDIT, MAX_CODE_LINE))
    audit["url"] = driver.current_url
    audit["outside"] = outside_requests(driver.get_log("performance"))
    audit["console"] = console_errors(driver.get_log("browser"), url.split("/book/")[0])
    return audit


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
