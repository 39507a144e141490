"""The exercises of every chapter teach (issue 19).

- No spoiler: no code shown on a page before its "Exercises" heading (a ``literalinclude`` of a
  function, class or file, a code cell, a fenced block) defines a function or class that the chapter's
  exercise file asks the reader to write.
- Three kinds in every chapter: at least one variant (something the chapter did not print), one
  predict-then-measure exercise, and one open question whose discussion is folded (a dropdown), each
  tagged in its heading: ``**Exercise 9.6 (variant) — ...**``.
"""

import ast
import re
from pathlib import Path

import pytest

from bp_mech import ROOT
from bp_mech.checks.runner import exercise_functions

PAGES = sorted((ROOT / "book" / "part02").glob("*.md")) + sorted((ROOT / "book" / "projects").glob("*.md"))
KINDS = ("variant", "predict, then measure", "open question")
EXERCISE = re.compile(r"^\*\*Exercise [\w.]+ \(([^)]*)\)", re.M)


def _split(text: str) -> tuple[str, str]:
    """(before the "## Exercises" heading, from it on)."""
    m = re.search(r"^## Exercises\s*$", text, re.M)
    assert m, "no '## Exercises' heading"
    return text[: m.start()], text[m.start():]


def _defined(source: str) -> set[str]:
    """Top-level and nested function/class names that ``source`` defines (parsed; by regex if it does not parse)."""
    try:
        return {n.name for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    except SyntaxError:
        return set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", source, re.M))


def _included(page: Path, arg: str, options: dict) -> set[str]:
    """What a ``literalinclude`` shows: its ``:pyobject:`` (a method counts for its class too), else the
    names the included lines define."""
    if "pyobject" in options:
        return set(options["pyobject"].split("."))
    lines = (page.parent / arg).resolve().read_text(encoding="utf-8").splitlines()
    if "lines" in options:
        keep = []
        for part in options["lines"].split(","):
            a, _, b = part.partition("-")
            keep += lines[int(a) - 1: int(b or a)] if b or a else []
        lines = keep
    text = "\n".join(lines)
    if "start-after" in options:
        text = text.split(options["start-after"], 1)[-1]
    if "end-before" in options:
        text = text.split(options["end-before"], 1)[0]
    return _defined(text)


def shown_definitions(page: Path, text: str) -> set[str]:
    """Every function or class name that the code shown in ``text`` (a part of ``page``) defines."""
    names = set()
    for m in re.finditer(r"^(`{3,}|:{3,})\s*\{?([\w-]*)\}?[ \t]*([^\n]*)\n(.*?)^\1[ \t]*$", text, re.M | re.S):
        directive, arg, body = m.group(2), m.group(3).strip(), m.group(4)
        options = dict(re.findall(r"^:([\w-]+):[ \t]*(.*)$", body, re.M))
        code = "\n".join(line for line in body.splitlines() if not re.match(r"^:[\w-]+:", line))
        if directive == "literalinclude":
            names |= _included(page, arg, options)
        elif directive in ("code-cell", "python", "code", "code-block", ""):
            names |= _defined(code)
    return names


def _exercise_file(text: str) -> str:
    files = set(re.findall(r"exercises/(ex\w+)\.py", text))
    assert len(files) == 1, f"expected one exercise file, found {sorted(files)}"
    return files.pop()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_graded_function_is_shown_before_its_exercise(page):
    text = page.read_text(encoding="utf-8")
    before, after = _split(text)
    graded = set(exercise_functions(_exercise_file(after)))
    spoiled = sorted(graded & shown_definitions(page, before))
    assert not spoiled, f"{page.name} shows the implementation of {spoiled} before its exercises"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_chapter_has_a_variant_a_prediction_and_an_open_question(page):
    _, exercises = _split(page.read_text(encoding="utf-8"))
    kinds = EXERCISE.findall(exercises)
    missing = [k for k in KINDS if k not in kinds]
    assert not missing, f"{page.name} has no exercise of kind {missing} (tagged '**Exercise N.k (kind) — ...**')"
    for block in re.split(r"^(?=\*\*Exercise )", exercises, flags=re.M):
        if block.startswith("**Exercise") and "(open question)" in block.splitlines()[0]:
            assert ":class: dropdown" in block, f"{page.name}: an open question without a folded discussion"


def test_the_spoiler_finder_sees_each_way_code_is_shown(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def shown():\n    pass\n\n\nclass Hidden:\n    def method(self):\n        pass\n")
    page = tmp_path / "p.md"
    text = ("```{literalinclude} m.py\n:pyobject: Hidden.method\n```\n\n"
            "```{literalinclude} m.py\n:lines: 1-2\n```\n\n"
            "```{code-cell} ipython3\n:tags: [hide-input]\ndef in_cell(x):\n    return x\n```\n\n"
            "```python\nclass InFence:\n    pass\n```\n")
    assert shown_definitions(page, text) == {"Hidden", "method", "shown", "in_cell", "InFence"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_included_object_exists(page):
    """A ``:pyobject:`` that names nothing fails the strict build late; here it fails in a second."""
    text = page.read_text(encoding="utf-8")
    for m in re.finditer(r"^```\{literalinclude\}\s*(\S+)\n((?::[\w-]+:.*\n)*)", text, re.M):
        path = (page.parent / m.group(1)).resolve()
        assert path.exists(), f"{page.name}: {m.group(1)} does not exist"
        obj = dict(re.findall(r"^:([\w-]+):[ \t]*(.*)$", m.group(2), re.M)).get("pyobject")
        if obj:
            node = ast.parse(path.read_text(encoding="utf-8"))
            for part in obj.split("."):
                found = [n for n in getattr(node, "body", []) if getattr(n, "name", None) == part]
                assert found, f"{page.name}: {m.group(1)} defines no {obj}"
                node = found[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_included_objects_fit_the_code_box(page):
    """The browser test's ``long_code_lines`` for every ``:pyobject:`` include, in a second, not after a build."""
    from browser_text import MAX_CODE_LINE

    text, long = page.read_text(encoding="utf-8"), []
    for m in re.finditer(r"^```\{literalinclude\}\s*(\S+)\n((?::[\w-]+:.*\n)*)", text, re.M):
        obj = dict(re.findall(r"^:([\w-]+):[ \t]*(.*)$", m.group(2), re.M)).get("pyobject")
        if not obj:
            continue
        source = (page.parent / m.group(1)).resolve().read_text(encoding="utf-8")
        node = ast.parse(source)
        for part in obj.split("."):
            node = next(n for n in node.body if getattr(n, "name", None) == part)
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        long += [f"{obj}: {len(line.rstrip())} columns" for line in source.splitlines()[first - 1: node.end_lineno]
                 if len(line.rstrip()) > MAX_CODE_LINE]
    assert not long, f"{page.name} shows lines longer than {MAX_CODE_LINE} columns: {long}"
