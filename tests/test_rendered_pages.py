"""The rendered chapters hold no filler: no section whose only content says that nothing is there, no
block of text printed twice on one page, no table whose cells are mostly "–"; and each opens with its picture
(a figure with alt text and a caption under the title, before the first section: issue 29's reader's order).

Each audit reads one page's HTML (BeautifulSoup, the standard-library parser) and returns what it found;
the synthetic pages below show each one fails on its defect. ``test_built_chapters`` runs them on every
chapter of the one build of the current sources (tools/book_build.py's ``current_build()``, or the folder
``$BP_MECH_BOOK_HTML`` names, as tests/test_browser.py reads it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

DASH = "–"
MOSTLY = 0.5  # a table fails when more than this share of its body cells, or of one column's, are "–" or empty ...
MIN_ROWS = 5  # ... and it has at least this many rows
MIN_BLOCK = 80  # characters: a shorter paragraph or output may repeat (a label, a unit)
SHORT = 600  # characters: a section of "nothing here" sentences is empty when no longer than this
# A sentence that says that nothing is there: a section of only such sentences is empty.
NOTHING = re.compile(r"\b(no\b|nothing\b|none\b|not (yet|cached)|is not cached|are not cached)", re.I)
HIDDEN = ("cell_input", "highlight", "headerlink", "toggle-details__summary")  # code sources, link marks


def _soup(html: str) -> BeautifulSoup:
    soup = BeautifulSoup(html, "html.parser")
    for cls in HIDDEN:
        for node in soup.select(f".{cls}"):
            if cls != "highlight" or node.find_parent(class_="cell_output") is None:  # outputs stay
                node.decompose()
    return soup


def _text(node) -> str:
    return re.sub(r"\s+", " ", node.get_text(" ")).strip()


def empty_sections(html: str) -> list[str]:
    """The headings of sections (with no subsection) whose text, code sources aside, is short (``SHORT``)
    and only sentences saying that nothing is there (e.g. "No GPU record is cached yet")."""
    found = []
    for sec in _soup(html).find_all("section"):
        if sec.find("section") is not None:
            continue
        head = sec.find(re.compile(r"h[1-6]"))
        if head is None:
            continue
        title = _text(head)
        head.decompose()
        body = _text(sec)
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", body) if s.strip()]
        if not sentences or (len(body) <= SHORT and all(NOTHING.search(s) for s in sentences)):
            found.append(title)
    return found


def repeated_blocks(html: str) -> list[str]:
    """Paragraphs, list items, tables and printed outputs of at least ``MIN_BLOCK`` characters that
    appear more than once on the page (the first characters of each)."""
    seen, found = set(), []
    for node in _soup(html).select("article p, article li, article table, article .cell_output pre"):
        if node.find_parent(["table", "li"]) is not None and node.name != "table":
            continue
        text = _text(node)
        if len(text) < MIN_BLOCK:
            continue
        if text in seen and text[:60] not in found:
            found.append(text[:60])
        seen.add(text)
    return found


def dash_tables(html: str) -> list[str]:
    """Tables of at least ``MIN_ROWS`` rows more than ``MOSTLY`` of whose body cells, or of one column's
    (the first aside), are "–" or empty (their header)."""
    found = []
    for table in _soup(html).find_all("table"):
        rows = [[_text(td) in (DASH, "-", "—", "") for td in tr.find_all("td")]
                for tr in (table.select("tbody tr") or table.find_all("tr")[1:])]
        rows = [r for r in rows if r]
        if len(rows) < MIN_ROWS:
            continue
        cells = [c for r in rows for c in r]
        columns = [[r[i] for r in rows if i < len(r)] for i in range(1, max(map(len, rows)))]
        if sum(cells) > MOSTLY * len(cells) or any(sum(col) > MOSTLY * len(col) for col in columns):
            found.append(_text(table.find("tr"))[:80])
    return found


def bold_prose(html: str) -> list[str]:
    """Glued sentences set in bold: MyST-NB's ``pasted-text`` spans of four words or more without the book's
    ``pasted-prose`` class (book/_ext/bp_book.py), which bp-book.css sets in the text's own weight."""
    spans = BeautifulSoup(html, "html.parser").select("span.pasted-text")
    return [_text(sp)[:60] for sp in spans if len(_text(sp).split()) >= 4 and "pasted-prose" not in sp["class"]]


AUDITS = (empty_sections, repeated_blocks, dash_tables, bold_prose)


def no_opening_picture(html: str) -> list[str]:
    """The page's title section, when nothing between its title and its first section is a figure with alt
    text and a caption: ["<title>"] (else [])."""
    h1 = BeautifulSoup(html, "html.parser").select_one("section > h1")
    if h1 is None:
        return ["(no title section)"]
    for el in h1.find_next_siblings():
        if el.name == "section":
            break
        img = el.find("img") if el.name == "figure" else None
        if img is not None and img.get("alt", "").strip() and el.find("figcaption") is not None:
            return []
    return [_text(h1)]


CHAPTER_AUDITS = (*AUDITS, no_opening_picture)  # (a chapter has a title section; the synthetic pages need none)


def page(body: str) -> str:
    return f'<html><body><article class="bd-article">{body}</article></body></html>'


GOOD = page('<section id="a"><h2>Results</h2><p>The step peaks at 3.2 MiB, checkpointing at 2.1 MiB.</p>'
            '<table><thead><tr><th>arm</th><th>peak</th></tr></thead><tbody>'
            + "".join(f"<tr><td>arm {i}</td><td>{i}.0 MiB</td></tr>" for i in range(4)) + "</tbody></table></section>")


def test_a_page_with_content_passes():
    assert [audit(GOOD) for audit in AUDITS] == [[], [], [], []]


def test_a_section_that_only_says_nothing_is_there_fails():
    html = page('<section id="g"><h3>GPU records</h3><div class="cell"><div class="cell_input">'
                '<pre>print(cached.note())</pre></div><div class="cell_output"><pre>No GPU record of TRAIN-X is '
                'cached in book/results yet. Nothing is shown in their place.</pre></div></div></section>')
    assert empty_sections(html) == ["GPU records"]
    assert empty_sections(GOOD + html.replace("No GPU record", "The GPU record")) == []


def test_a_block_repeated_within_a_page_fails():
    block = "<pre>" + "\n".join(f"activation of layer {i}: saved in forward, read in backward" for i in range(3)) + "</pre>"
    html = page(f'<section id="a"><h2>A</h2><div class="cell_output">{block}</div></section>'
                f'<section id="b"><h2>B</h2><div class="cell_output">{block}</div></section>')
    assert repeated_blocks(html) == ["activation of layer 0: saved in forward, read in backward ac"]
    assert repeated_blocks(html.replace("layer 0", "layer 7", 1)) == []


def test_a_table_mostly_of_dashes_fails():
    rows = "".join(f"<tr><td>arm {i}</td><td>{i}.0</td><td>{DASH if i % 2 else '1.0'}</td><td>{DASH * (i < 4)}</td>"
                   "</tr>" for i in range(6))
    html = page(f"<table><thead><tr><th>arm</th><th>a</th><th>b</th><th>c</th></tr></thead><tbody>{rows}</tbody>"
                "</table>")
    assert dash_tables(html) == ["arm a b c"]  # column c: four of six "–"
    assert dash_tables(html.replace(f"<td>{DASH}</td></tr>", "<td>2.0</td></tr>")) == []  # c filled, b half "–"


def test_a_glued_sentence_in_bold_fails():
    value = '<p>It took <span class="pasted-text">14.2 s</span>.</p>'
    sentence = '<p><span class="pasted-text">The holdout loss never rose above the baseline.</span></p>'
    assert bold_prose(value) == [] and bold_prose(sentence) == ["The holdout loss never rose above the baseline."]
    assert bold_prose(sentence.replace('"pasted-text"', '"pasted-text pasted-prose"')) == []


def test_a_chapter_that_opens_with_text_or_a_bare_image_fails():
    figure = ('<figure id="f"><img alt="A stack of layers, plain above, checkpointed below." src="a.png">'
              '<figcaption><p>What this chapter is about, in one picture.</p></figcaption></figure>')
    opening = '<section id="c"><h1>Part 02 · 19 — Checkpointing</h1><p class="experiment-header">X</p>{}{}</section>'
    later = '<section id="q"><h2>The question</h2><p>Why?</p></section>'
    assert no_opening_picture(page(opening.format(figure, later))) == []
    assert no_opening_picture(page(opening.format(later, figure))) == ["Part 02 · 19 — Checkpointing"]
    assert no_opening_picture(page(opening.format(figure.replace('A stack of layers, plain above, checkpointed below.', ' '), later))) != []
    assert no_opening_picture(page(opening.format(figure.replace("<figcaption>", "<div>").replace(
        "</figcaption>", "</div>"), later))) != []


def _chapters() -> list[Path]:
    override = os.environ.get("BP_MECH_BOOK_HTML")
    if override:
        html = Path(override).resolve()
    else:
        import book_build

        build = book_build.current_build()
        if not build.clean:
            pytest.fail("the book's build failed (tests/test_book.py::test_strict_book_build):\n" + build.log[-6000:])
        html = build.html
    return sorted((html / "book").glob("part02/*.html")) + sorted((html / "book").glob("projects/*.html"))


@pytest.mark.book
def test_built_chapters():
    """Every chapter of the build passes every audit and opens with its picture."""
    found = {}
    for path in _chapters():
        text = path.read_text(encoding="utf-8")
        for audit in CHAPTER_AUDITS:
            if hits := audit(text):
                found[f"{path.stem} {audit.__name__}"] = hits
    assert not found, "\n".join(f"{k}: {v}" for k, v in found.items())
