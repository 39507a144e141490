"""Every chapter lists the works it relies on (issue 29): it cites them where it uses them
(``{footcite}`key```, sphinxcontrib-bibtex's footnote citations) and ends with a "References"
section, after its exercises, that lists exactly those (``{footbibliography}``). Every key cited is
in book/references.bib, every entry there is cited by some chapter, and the appendix lists them all.

Read from the sources, in a second: the strict build (tests/test_book.py) fails on an unknown key
too, but only after minutes.
"""

import re

import pytest

from bp_mech import ROOT

PAGES = sorted((ROOT / "book" / "part02").glob("*.md")) + sorted((ROOT / "book" / "projects").glob("*.md"))
BIB = ROOT / "book" / "references.bib"
APPENDIX = ROOT / "book" / "appendix" / "references.md"
ROLE = re.compile(r"\{(\w+(?::\w+)?)\}`([^`]*)`")  # {role}`text`
# the sections every chapter has, in the reader's order (others may stand between them)
ORDER = ("## The question", "## Mechanism and math", "## Key takeaways", "## Exercises", "## References")


def bib_keys() -> list[str]:
    return re.findall(r"^@\w+\{([^,\s]+),", BIB.read_text(encoding="utf-8"), re.M)


def cited(text: str) -> list[str]:
    """The keys of the page's citation roles (``{footcite}``, and ``{cite}``, which it must not use)."""
    return [k.strip() for role, keys in ROLE.findall(text) if role.split(":")[0] in ("footcite", "cite")
            for k in keys.split(",")]


def headings(text: str) -> list[str]:
    """The page's ``## `` headings, outside code cells and fences."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^(`{3,}|:{3,})", line)
        if m and fence is None and len(line.strip()) > len(m.group(1)):
            fence = m.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None and line.startswith("## "):
            out.append(line.rstrip())
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_chapter_cites_what_it_relies_on_and_ends_with_its_references(page):
    text = page.read_text(encoding="utf-8")
    keys = cited(text)
    assert keys, f"{page.name} cites nothing"
    assert "{cite}" not in text and "{cite:" not in text, (
        f"{page.name}: a {{cite}} role goes to the appendix's list, not the chapter's; use {{footcite}}")
    heads = headings(text)
    assert heads and heads[-1] == "## References", f"{page.name} does not end with a References section: {heads[-3:]}"
    assert [h for h in heads if h in ORDER] == list(ORDER), f"{page.name}: sections out of order: {heads}"
    tail = text[text.rindex("## References"):]
    assert re.fullmatch(r"## References\s+```\{footbibliography\}\s*```\s*", tail), (
        f"{page.name}: its References section should hold only the {{footbibliography}} of what it cites")
    missing = sorted(set(keys) - set(bib_keys()))
    assert not missing, f"{page.name} cites keys that book/references.bib lacks: {missing}"


def test_the_bibliography_is_whole_and_every_entry_is_cited():
    keys = bib_keys()
    assert len(keys) == len(set(keys)), "a key is defined twice in book/references.bib"
    assert not any(c.isdigit() for k in keys for c in k), "keys carry no digits (test_prose reads role text)"
    accents = re.findall(r"\{\\['`^\"~]\w\}", BIB.read_text(encoding="utf-8"))
    assert not accents, f"LaTeX accents {accents}: write the letter in UTF-8 (the appendix's labels spell them out)"
    uncited = sorted(set(keys) - {k for p in PAGES for k in cited(p.read_text(encoding="utf-8"))})
    assert not uncited, f"entries no chapter cites: {uncited}"
    appendix = APPENDIX.read_text(encoding="utf-8")
    assert re.search(r"```\{bibliography\}\n:all:\n```", appendix), "the appendix lists every entry (:all:)"


def test_no_page_uses_markdown_footnotes():
    """The build suppresses MyST's footnote warnings (they would flag every footcite), so the book
    uses no Markdown footnotes whose mistakes those warnings would have caught."""
    pages = PAGES + sorted((ROOT / "book").rglob("*.md"))
    found = [p.name for p in set(pages) if re.search(r"\[\^[^\]]+\]", p.read_text(encoding="utf-8"))]
    assert not found, f"Markdown footnotes in {found}"


def test_the_checks_see_a_missing_section_and_a_plain_cite():
    page = ("## The question\n\n## Mechanism and math\n\nA claim {footcite}`kingma-adam`.\n\n"
            "```{code-cell} ipython3\n## not a heading\n```\n\n## Key takeaways\n\n## Exercises\n\n"
            "## References\n\n```{footbibliography}\n```\n")
    assert cited(page) == ["kingma-adam"]
    assert headings(page) == list(ORDER)
    assert cited("see {cite}`a-key, b-key`") == ["a-key", "b-key"]
    assert headings(page.replace("## References\n\n```{footbibliography}\n```\n", ""))[-1] == "## Exercises"
