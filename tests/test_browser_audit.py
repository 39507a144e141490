"""The test of the browser test's audit (tests/browser_pages.py, tests/browser_text.py): two small
pages made like the book's (the theme's article, MyST-NB's cells, Sphinx's MathJax 3 set-up and the
offline MathJax the book ships), served the same way and read by the same ``open_page``. One holds
each defect once and each is reported; the other holds their look-alikes that are fine (a sentence
running on into a display formula, list items and captions without a full stop, ``\\text{height}``,
an 88-character line, a long line in an output) and nothing is reported.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from browser_pages import browser_missing, chrome, open_page, serve
from browser_text import MAX_CODE_LINE

from bp_mech import ROOT

pytestmark = pytest.mark.browser

HEAD = """<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>audit</title>
<script>window.MathJax = {"options": {"processHtmlClass": "tex2jax_process|mathjax_process|math|output_area"}}</script>
<script defer="defer" src="_static/mathjax/tex-chtml.js"></script>
<style>body{margin:0} article{width:900px;margin:0 auto} pre{overflow-x:auto}</style></head>
<body><main><article class="bd-article"><section class="tex2jax_ignore mathjax_ignore">
<h1>A page<a class="headerlink" href="#">#</a></h1>
"""
TAIL = "</section></article></main></body></html>\n"


def math(tex: str) -> str:
    return f'<span class="math notranslate nohighlight">\\({tex}\\)</span>'


def cell(code: str, output: str = "", hidden: bool = False) -> str:
    source = f'<div class="highlight-ipython3 notranslate"><div class="highlight"><pre>{code}</pre></div></div>'
    if hidden:  # a hide-input cell: folded behind a toggle, expandable
        source = f'<details class="hide above-input"><summary>Show code cell source</summary>{source}</details>'
    out = f'<div class="cell_output docutils container">{output}</div>' if output else ""
    return f'<div class="cell docutils container"><div class="cell_input docutils container">{source}</div>{out}</div>'


def include(code: str) -> str:  # a literalinclude (or a fenced code block) as Sphinx writes it
    return f'<div class="highlight-python notranslate"><div class="highlight"><pre>{code}</pre></div></div>'


LONG = "x = " + "1 + " * 30 + "1"  # longer than MAX_CODE_LINE
TAB, CR, FF, BS = chr(9), chr(13), chr(12), chr(8)  # what "\t", "\r", "\f", "\b" are in a non-raw string
DEFECTS = {  # name: (HTML, the audit key that must report it, a piece of the report)
    "TeX error": ("<p>A power " + math("x^1^2") + " here.</p>", "math_errors", "Double exponent"),
    "undefined macro": ("<p>A macro " + math("\\nosuchmacro + 1") + " here.</p>", "math_errors",
                        "undefined \\nosuchmacro"),
    "tab": ("<p>The error " + math("g_" + TAB + "ext{1 process}") + " here.</p>", "broken_math",
            'control character in "g_<U+0009>ext{1 process}"'),
    "carriage return": ("<p>The norm " + math("(g " + CR + "ight)") + " here.</p>", "broken_math", '"ight"'),
    "form feed": ("<p>A half " + math(FF + "rac{1}{2}") + " here.</p>", "broken_math", "<U+000C>rac{1}{2}"),
    "backspace": ("<p>The rate " + math(BS + "eta") + " here.</p>", "broken_math", '"<U+0008>eta"'),
    "stray fragment": ("<p>Bounded by " + math("x ext{ bytes}") + " here.</p>", "broken_math", '"ext{"'),
    "broken-off paragraph": ("<p>and the CUDA context sits outside its counters. With</p>", "unterminated",
                             "counters. With"),
    "paragraph into one symbol": ('<p>The rule is</p><div class="math notranslate nohighlight">\\[x\\]</div>',
                                  "unterminated", "The rule is"),
    "unrendered table": ('<div class="cell_output docutils container"><p>| a | median |g| |\n|---|---|\n| 1 | 2 |</p></div>',
                         "raw_markdown", "| a | median"),
    "long line in a cell": (cell("y = 2\n" + LONG), "long_code_lines", LONG[:40]),
    "long line in a folded cell": (cell(LONG.replace("x", "z"), hidden=True), "long_code_lines", "z = 1 + 1"),
    "long line in an include": (include("def f():\n    return " + LONG.replace("x = ", "")), "long_code_lines",
                                "return 1 + 1"),
}
FINE = "\n".join([
    "<p>A sentence ends here. So does this one: (in brackets.) And “in quotes.”</p>",
    "<p>Does it ask? It does! And it ends with a formula " + math("a = b.") + "</p>",
    "<p>The full-batch loss is the token mean</p>",
    '<div class="math notranslate nohighlight">\\[\nL = \\frac{1}{N} \\sum_i \\ell_i ,\n\\qquad'
    ' \\text{height} = \\left( \\dfrac{a}{b} \\right)\n\\]</div>',
    "<p>the fraction by which one update moves " + math("\\lVert g - g_\\text{1 process}\\rVert") + ".</p>",
    "<ul><li><p>a list item without a full stop</p></li><li>another</li></ul>",
    '<figure><img alt="a plot" src="data:image/gif;base64,R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7" width="1" height="1">'
    '<figcaption><p>Peak bytes over the step</p></figcaption></figure>',
    '<div class="admonition"><p class="admonition-title">Answer</p><p>The body ends well.</p></div>',
    "<table><tr><td><p>a cell</p></td></tr></table><dl><dt>a term</dt><dd><p>Its meaning.</p></dd></dl>",
    "<h2>A heading<a class='headerlink' href='#'>#</a></h2><p class='rubric'>A rubric</p>",
    cell("z = " + "1" * (MAX_CODE_LINE - 4), output="<pre>" + "0123456789 " * 12 + "</pre><p>printed, no stop</p>"),
    cell("w = 1", hidden=True),
    include("def f():\n    return 1"),
])


def page(body: str) -> str:
    return HEAD + body + TAIL


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    """``read(body)``: the audit of a page holding ``body``, served and opened as the book's pages are."""
    reason = browser_missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    spec = importlib.util.spec_from_file_location("bp_book", ROOT / "book" / "_ext" / "bp_book.py")
    bp_book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp_book)
    site = tmp_path_factory.mktemp("audit-site")
    (site / "_static").mkdir()
    (site / "_static" / "mathjax").symlink_to(bp_book.mathjax_source(), target_is_directory=True)
    pages = {}
    with serve(site) as url, chrome(tmp_path_factory.mktemp("chromium-profile")) as driver:
        def audit(body: str) -> dict:
            name = f"page{len(pages)}.html"
            (site / name).write_text(page(body), encoding="utf-8", newline="")
            pages[name] = open_page(driver, url + name)
            return pages[name]
        yield audit


def test_each_defect_is_reported(read):
    a = read("\n".join(html for html, _, _ in DEFECTS.values()))
    assert a["formulas"] == sum(html.count('class="math') for html, _, _ in DEFECTS.values())
    for name, (_, key, piece) in DEFECTS.items():
        assert any(piece in item for item in a[key]), f"{name}: {piece!r} not in {key}: {a[key]}"
    assert len(a["broken_math"]) == 5 and len(a["long_code_lines"]) == 3


@pytest.mark.parametrize("name", DEFECTS)
def test_one_defect_alone_is_reported(read, name):
    html, key, piece = DEFECTS[name]
    a = read(FINE + "\n" + html)
    found = {k: a[k] for k in ("math_errors", "broken_math", "unterminated", "raw_markdown", "long_code_lines") if a[k]}
    assert any(piece in item for item in found.get(key, [])), found
    # MathJax itself stumbles over a form feed or a backspace (a script error inside it, an error node)
    assert set(found) <= {key} | ({"math_errors"} if name in ("form feed", "backspace") else set()), found


def test_a_clean_page_reports_nothing(read):
    a = read(FINE)
    assert a["formulas"] == FINE.count('class="math') == 3 and a["code_blocks"] >= 3 and a["figures"] == 1
    reported = {k: v for k, v in a.items() if isinstance(v, (list, bool)) and v}
    assert not reported, reported
