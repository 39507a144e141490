"""No number typed into a chapter's prose: every digit a reader sees in the text is glued (computed
when the page is built) or read from a record, except the names of things (``ALLOWED``).

``prose(text)`` masks everything of a MyST page that is not prose, keeping its line numbers: the
front matter, code cells and fenced code, ``literalinclude`` and every other directive but the
admonitions (whose body is prose; their options are not), math (``$...$``, ``$$...$$``,
``\\begin{...}``), inline code, glue roles (and the substitutions ``{{ ... }}``), link targets
(``(target)``, ``<target>`` of a role, label lines ``(label)=``), HTML comments; inline math stays
when it is only a number (``MATH_NUMBER``). ``violations(text)`` then finds each digit-bearing word
that no ``ALLOWED`` pattern covers.

Regenerate the list of today's violations with
``.venv/bin/python tests/book/test_prose.py > /tmp/prose_violations.txt``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted(p for d in ("part02", "projects", "appendix") for p in (ROOT / "book" / d).glob("*.md"))

PROSE_DIRECTIVES = {"admonition", "note", "warning", "tip", "important", "caution", "attention", "hint",
                    "seealso", "margin", "sidebar", "topic", "dropdown"}  # their body is text a reader reads
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,}|:{3,})\s*(?:\{(?P<name>[^}]+)\})?(?P<rest>.*)$")
OPTION = re.compile(r"^\s*:[\w-]+:")  # a directive's option line, ``:class: dropdown``

# --- the names of things, the only digits prose may type -------------------------------------
NN = r"\d{2}[a-z]?\b"  # a chapter's number: 09, 12b, 76
ALLOWED: dict[str, tuple[str, str]] = {  # what: (pattern, an example)
    "chapter number": (rf"\b(?:Part 02 ·|Part|[Cc]hapters?|[Pp]rojects?) {NN}(?:(?:,| and| or) {NN})*|\bPart \d{{2}}\b",
                       "Part 02 · 19, chapters 19, 42 and 11, project 76"),
    "exercise number": (r"\bExercises? (?:\d+|[A-Z])\.\d+(?:(?:,| and| or) (?:\d+|[A-Z])\.\d+)*", "Exercises 9.1 and A.2"),
    "citation year": (r"\b[A-Z][\w-]+(?: et al\.| (?:&|and) [A-Z][\w-]+)?,? \(?(?:19|20)\d{2}[a-z]?\b",
                      "Griewank & Walther 2000; Dao et al. 2022; Korthikanti et al. (2022)"),
    "workload or arm name": (r"\b(?:tiny|qwen05)(?:-b\d+s\d+)?\b|\bb\d+s\d+\b|\b0-update\b",
                             "qwen05-b2s512, tiny-b2s64, b2s512, the 0-update baseline"),
    "number format": (r"(?i:\b(?:fp|bf|float|bfloat|int|uint|tf)(?:8|16|32|64)\b)|\b(?:8|16|32|64)[- ]bits?\b",
                      "fp16, BF16, float32, TF32, 16-bit, 16 bits"),
    "model name": (r"\bQwen2(?:\.5)?(?:-0\.5B|-7B)?\b|\b0\.5B\b|\b7B\b|\bLlama-3-70B\b",
                   "Qwen2.5-0.5B, Qwen2, a 0.5B model, Qwen2.5-7B, the 7B, Llama-3-70B"),
    "device name": (r"\bRTX \d{4}(?: Ti)?\b|\b[AHB]100\b|\bH200\b", "RTX 5070 Ti, H200"),
    "technical term": (r"\b(?:[DH]2[DH]|P(?:50|95|99)|sha256|UTF-8|FSDP2|ZeRO-[123])\b",
                       "D2H and H2D, median and P95, sha256, UTF-8, FSDP2, ZeRO-3"),
}
ALLOWED_RE = re.compile("|".join(f"(?:{p})" for p, _ in ALLOWED.values()).replace(" ", r"\s+"))  # across line breaks
DIGITS = re.compile(r"[^\s()\[\]{},;:\"'“”‘’*_]*\d[^\s()\[\]{},;:\"'“”‘’*_]*")  # a word with a digit in it


def _blank(s: str) -> str:
    return re.sub(r"[^\n]", " ", s)


def _mask(pattern: str, text: str, keep: int | None = None, flags: int = 0) -> str:
    """Blank every match of ``pattern`` (all of it, or all but group ``keep``), newlines kept."""
    def sub(m):
        if keep is None or m.group(keep) is None:
            return _blank(m.group(0))
        a, b = m.span(keep)
        a, b = a - m.start(), b - m.start()
        return _blank(m.group(0)[:a]) + m.group(0)[a:b] + _blank(m.group(0)[b:])
    return re.sub(pattern, sub, text, flags=flags)


# a number in math's clothing: ``$4864$``, ``$16$``, ``$T=1024$``, ``$I \approx 5.4\,C$`` is typed all the same
# (a formula such as ``$3 \cdot 4nV$`` or ``$2\,\text{lr}$``, one digit, ``$0$``, ``$k = 2$``, a power, ``$10^{-16}$``,
# is not)
MATH_NUMBER = re.compile(r"^\s*(?P<name>[A-Za-z](?:_\{?[\w\\]+\}?)?\s*(?:=|\\approx|\\sim)\s*)?"
                         r"(?P<num>-?\d(?:[\d.,]|\{,\})*(?:\\[,;!]\s*\d+)*)\s*(?:\\,)?\s*"
                         r"(?P<unit>\\text\{[^}]*\}|\\%|[A-Za-z])?\s*$")


def _math(m: re.Match) -> str:
    """Blank inline math, unless it is a number in math's clothing: then its body stays, to be read."""
    n = MATH_NUMBER.match(m.group(1))
    if n and not n["name"] and len(n["unit"] or "") == 1:  # $12n$: a formula
        n = None
    if n and len(re.sub(r"\D", "", n["num"])) >= 2:  # one digit is math: $0$, $k = 2$, $2\,\text{lr}$
        return " " + m.group(1) + " "
    return _blank(m.group(0))


def _closes(m: re.Match | None, fence: str) -> bool:
    """Is this fence line (``FENCE``'s match) the end of the block ``fence`` opened?"""
    return bool(m) and m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence) and not (m["name"] or m["rest"].strip())


def _blocks(lines: list[str]) -> list[str]:
    """Blank the front matter, fenced code, non-prose directives and directive options."""
    out, stack = list(lines), []  # stack: (fence, prose?) of the open blocks
    start = 0
    if lines and lines[0].strip() == "---":
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
        out[: end + 1] = [""] * (end + 1)
        start = end + 1
    options = False  # just after a prose directive's opening line: its options come first
    for i in range(start, len(lines)):
        line, m = lines[i], FENCE.match(lines[i])
        if stack and not stack[-1][1]:  # inside code or a non-prose directive: only its closing fence counts
            out[i] = ""
            if _closes(m, stack[-1][0]):
                stack.pop()
            continue
        if options and (OPTION.match(line) or not line.strip()):
            out[i] = ""
            continue
        options = False
        if stack and _closes(m, stack[-1][0]):
            stack.pop()
            out[i] = ""
        elif m:
            name = (m["name"] or "").strip()
            prose = name in PROSE_DIRECTIVES
            stack.append((m["fence"], prose))
            out[i] = " " * (m.end("rest") - len(m["rest"])) + m["rest"] if prose else ""  # keep a title
            options = prose
    return out


def prose(text: str) -> str:
    """``text`` with every part that is not prose blanked; the same lines, the same line numbers."""
    t = "\n".join(_blocks(text.split("\n")))
    t = _mask(r"<!--.*?-->", t, flags=re.S)
    t = _mask(r"^\([\w-]+\)=\s*$", t, flags=re.M)  # label lines
    t = _mask(r"\{\{.*?\}\}", t, flags=re.S)  # substitutions
    t = _mask(r"\{(?:glue|math|eq|numref|download)[\w:-]*\}(`+).*?\1", t, flags=re.S)  # glued, math, numbers, files
    t = _mask(r"\{[\w:-]+\}(`+)(.*?)(?:\s*<[^>]*>)?\1", t, keep=2, flags=re.S)  # a role: its text stays, not its target
    t = _mask(r"(`+).+?\1", t, flags=re.S)  # inline code
    t = _mask(r"\$\$.*?\$\$", t, flags=re.S)
    t = _mask(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", t, flags=re.S)
    t = re.sub(r"(?<![\\$])\$(?!\$)((?:\\.|[^$\\])+?)\$", _math, t, flags=re.S)
    t = _mask(r"\\\(.*?\\\)", t, flags=re.S)
    t = _mask(r"\]\([^)\s]*\)", t)  # [text](target): the target
    t = _mask(r"<(?:https?|mailto):[^>]+>", t)  # autolinks
    t = _mask(r"^\s*\[[^\]]+\]:.*$", t, flags=re.M)  # link definitions
    t = _mask(r"^\s*\d+[.)]\s", t, flags=re.M)  # the marker of a numbered list item
    return t


def violations(text: str) -> list[tuple[int, str, str]]:
    """(line number, the digit-bearing word, the line) for every number typed into the prose."""
    lines = text.split("\n")
    free = _mask(ALLOWED_RE.pattern, prose(text)).split("\n")
    return [(n, m.group(0), lines[n - 1].strip()) for n, line in enumerate(free, 1) for m in DIGITS.finditer(line)]


def report(paths=CHAPTERS) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: [{word}] {line}" for p in paths
            for n, word, line in violations(p.read_text(encoding="utf-8"))]


# --- the test of the test ---------------------------------------------------------------------

PAGE = """---
jupytext: {formats: "md:myst", version: 1.16}
---
(ch99-example)=
# Part 02 · 99 — An example

The step saves NUMBER of the peak.

```{code-cell} ipython3
glue("saving", 0.337, display=False); x = 2 ** 10
```

```{literalinclude} ../../src/bp_mech/ledger.py
:pyobject: theoretical
:lines: 1-30
```

:::{admonition} Answer
:class: dropdown
:name: answer-1
```python
print(12345)
```
:::

Math $\\sqrt{2}\\,4nV$ and $$ 16\\,\\text{B} $$ and `b = 4096` and \\(3\\) are not prose, nor is
{download}`the notebook <../../data/2024-run1.ipynb>`, [a link](https://example.org/v2/page3) or
{ref}`the first exercise <ch99-ex1>`. Nor are the names of things: NAMES.
"""
TYPED, GLUED = "33.7 %", "{glue:text}`saving:.1%`"


def test_a_typed_number_fails():
    found = violations(PAGE.replace("NUMBER", TYPED).replace("NAMES", "fp16"))
    assert [(n, w) for n, w, _ in found] == [(7, "33.7")], found


def test_the_same_number_glued_passes():
    assert violations(PAGE.replace("NUMBER", GLUED).replace("NAMES", "fp16")) == []


@pytest.mark.parametrize("what", ALLOWED)
def test_each_allowlist_entry_passes(what):
    example = ALLOWED[what][1]
    assert re.search(r"\d", example)
    assert violations(PAGE.replace("NUMBER", GLUED).replace("NAMES", example)) == [], what


def test_prose_inside_an_admonition_counts():
    page = PAGE.replace("NUMBER", GLUED).replace("NAMES", "fp16").replace("print(12345)\n```\n", "print(1)\n```\nIt took 12 s.\n")
    assert [(n, w) for n, w, _ in violations(page)] == [(24, "12")]


def test_a_number_in_math_is_typed_a_formula_is_not():
    page = PAGE.replace("NUMBER", GLUED)
    for typed in ("$4864$ wide", "$16$ bytes", "at $T=1024$", "$N = 2000$", "$I \\approx 5.4\\,C$", "$1{,}024\\,\\text{MiB}$"):
        assert violations(page.replace("NAMES", typed)), typed
    for formula in ("$3 \\cdot 4nV$", "$12n$", "$0$", "$k = 2$", "$2\\,\\text{lr}$", "$2W$", "$2^{120}$", "$10^{-16}$", "$1/\\sqrt{C}$"):
        assert violations(page.replace("NAMES", formula)) == [], formula


def test_a_near_name_is_not_a_name():
    for typed in ("fp17", "Qwen3 shows 1.5x", "RTX 5070 reached 88 %", "b2s512x", "Smith 1850"):
        assert violations(PAGE.replace("NUMBER", GLUED).replace("NAMES", typed)), typed


# --- the chapters ------------------------------------------------------------------------------

def test_chapters_type_no_number():
    assert CHAPTERS, "no chapter pages found"
    hits = report()
    assert not hits, f"{len(hits)} numbers typed into prose (glue them):\n" + "\n".join(hits)


if __name__ == "__main__":
    lines = report()
    print("\n".join(lines))
    print(f"# {len(lines)} typed numbers in {len({l.split(':')[0] for l in lines})} of {len(CHAPTERS)} chapters",
          file=sys.stderr)
