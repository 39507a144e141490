"""The exercises of every chapter teach (issue 19).

- No spoiler: no code shown on a page before its "Exercises" heading (a ``literalinclude`` of a
  function, class or file, a code cell, a fenced block) defines a function or class that the chapter's
  exercise file asks the reader to write.
- Three kinds in every chapter: at least one variant (something the chapter did not print), one
  predict-then-measure exercise, and one open question whose discussion is folded (a dropdown), each
  tagged in its heading: ``**Exercise 9.6 (variant) — ...**``.
- No answer given away (issue 28): the result a prediction or a derivation asks for (``ANSWERS``: its
  spellings) appears neither in the stub's docstrings nor anywhere on the page above its exercise, and
  from the exercise on only folded (a dropdown: the answer, a later question's discussion).
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

# --- what a prediction or a derivation asks for is not handed over (issue 28) -----------------------
# Per graded function, the spellings of the result it asks the reader to find: a predict-then-measure
# formula, or a derivative to derive. Compared after ``squash`` (no spaces, ``$``, braces, ``*``, LaTeX
# spacing, ``\cdot``; ``\lfloor x\rfloor`` -> ``floor(x)``, ``**`` -> ``^``), so "$N C + 4 N I$" and "NC+4NI"
# are one.
ANSWERS = {
    "predict_mlp_saved_bytes": ("NC+4NI", "C+4I", "hidden+4ninter"),
    "predict_eager_saved_bytes": ("3Td+T^2", "3seqhead_dim+seqseq", "3dT+T^2", "TTbooleanmask", "TTboolmask"),
    "predict_naive_weights": ("N/(kn_j)", r"\fracNkn_j", "n/(kc)"),
    "predict_decay_entry": ("u+floor(u/g)", "u+u//g"),
    "predict_recovery_step": ("k-1+mN", "-1+growthsgrowth_interval", "howmanygrowthsundothem"),
    "predict_saved_bytes": ("1+2e", "H+2expansionH", "1+2expansion", "Linearsavesitsinput"),
    "predict_d2h_bytes": ("H+2eH", "2eH", "2inner", "Linearsavesitsinput"),
    "predict_forward_bytes": ("3W+", "W+2W", "twomoments2W", "4n(3C+1)", "M+savedactivations"),
    "predict_first_update_norm": (r"\eta\sqrtn", "sign(g)", "sqrt(numel)", r"\etac\lVertg\rVert",
                                  "elementbyaboutthelearningrate", "moveanelementbyatmost",
                                  "firstupdatealonemovesanelement"),
    "predict_replay_tokens": ("floor(NBq)", "floor(BNq)", "updatesbatchreplay//period", "floor(nq)", "floor(gq)",
                              "floor(nreplay/period)"),
    "predict_rank_tokens": ("T-1-p", "seq-1-p"),
    "predict_logits_line_saving": ("12n+4nC+max(", "-(12n+4nC", "dh,andthelarger"),
    "predict_checkpoint_plan_peak": ("theoretical(cfg", "ledger.theoretical"),
    # derivations the reader makes (the stub states what is computed, never the derivative)
    "rmsnorm_backward": ("g-xhatmean(gxhat)", r"g-\hatx\overlineg\odot\hatx"),
    "layernorm_backward": ("g-mean(g)-xhat", r"g-\overlineg-\hatx"),
    "sequence_weights": ("P/(Rn_s)", "w_s=P/"),
    "linear_backward": ("dx=dyW",), "silu_backward": ("s(1+x(1-s))",),
    "swiglu_mlp_backward": ("dx=dgWg+duWu",), "cross_entropy_backward": ("softmax(z_i)-onehot",),
    "softmax_backward": ("P(dP-rowsum(dPP))",), "attention_head_backward": ("dQ=scaledSk", "dV=P^TdO"),
    "gqa_reduce": ("sumoverr",), "blockwise_backward": ("rowsum(dOO)", "dV_J+="),
    "rope_backward": ("dycos-rotate_half(dysin)",),
}
# derivations the chapter teaches in its math and the exercise asks to implement: only the stub must not
# hand them over (the page's table is the chapter's lesson)
TAUGHT = {"linear_backward", "silu_backward", "swiglu_mlp_backward", "cross_entropy_backward", "softmax_backward",
          "attention_head_backward", "gqa_reduce", "blockwise_backward", "rope_backward"}
HEADING = re.compile(r"^\*\*Exercise [\w.]+ \(([^)]*)\)|^\*\*Exercise [\w.]+\b", re.M)
DROPDOWN = re.compile(r"^(:{3,})\{admonition\}[^\n]*\n((?::[\w-]+:[^\n]*\n)*)(.*?)^\1[ \t]*$", re.M | re.S)


def squash(text: str) -> str:
    text = re.sub(r"\\[lr]floor", lambda m: "floor(" if m.group(0)[1] == "l" else ")", text)
    text = re.sub(r"\\(?:cdot|times|left|right|mathrm|operatorname|text|[,;! ])", "", text)
    return re.sub(r"[\s${}*`]", "", text.replace("**", "^"))


def _visible(text: str) -> str:
    """``text`` with the bodies of folded (dropdown) admonitions removed."""
    return DROPDOWN.sub(lambda m: "" if "dropdown" in m.group(2) else m.group(0), text)


def exercises_of(text: str):
    """(kind or None, the graded function, the heading's offset) for each exercise of a page."""
    heads = list(HEADING.finditer(text))
    for i, m in enumerate(heads):
        block = text[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        shown = re.search(r"\{literalinclude\} \S*exercises/\w+\.py\n:pyobject: (\w+)", block)
        if shown:
            yield m.group(1), shown.group(1), m.start()


def spoilers(function: str, text: str) -> list[str]:
    """The spellings of ``function``'s answer that ``text`` contains."""
    flat = squash(text)
    return [s for s in ANSWERS.get(function, ()) if s in flat]


def page_spoilers(text: str) -> list[str]:
    """'function: spelling' for each answer a page gives away: anywhere above its exercise (a folded
    answer of an earlier exercise too), or visibly (not folded) from its exercise on."""
    found = []
    for _, function, at in exercises_of(text):
        if function not in TAUGHT:
            shown = spoilers(function, text[:at]) + spoilers(function, _visible(text[at:]))
            found += [f"{function}: {s}" for s in shown]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_answer_is_stated_above_its_exercise_nor_shown_unfolded(page):
    found = page_spoilers(page.read_text(encoding="utf-8"))
    assert not found, f"{page.name} gives away what its exercises ask for: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_stub_states_the_answer_it_asks_for(page):
    stub = (ROOT / "exercises" / f"{_exercise_file(_split(page.read_text(encoding='utf-8'))[1])}.py")
    tree = ast.parse(stub.read_text(encoding="utf-8"))
    found = [f"{n.name}: {s}" for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             for s in spoilers(n.name, ast.get_docstring(n) or "")]
    found += [f"module docstring: {s}" for f in ANSWERS for s in spoilers(f, ast.get_docstring(tree) or "")]
    assert not found, f"{stub.name} states what its exercises ask for: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_prediction_declares_its_answer(page):
    """A new predict-then-measure exercise names the spellings of its answer in ``ANSWERS``."""
    for kind, function, _ in exercises_of(page.read_text(encoding="utf-8")):
        if kind == "predict, then measure":
            assert ANSWERS.get(function), f"{page.name}: {function} has no entry in ANSWERS"


def test_a_reintroduced_spoiler_fails():
    stub = "```{literalinclude} ../../exercises/ex09_local_backward.py\n:pyobject: predict_mlp_saved_bytes\n```\n"
    head = "**Exercise 9.7 (predict, then measure) — what the MLP keeps.**\n\n" + stub
    folded = ":::{admonition} Answer\n:class: dropdown\nIt keeps $N C + 4 N I$ elements.\n:::\n"
    assert page_spoilers(head + folded + "**Exercise 9.8 (open question) — next.**\n\n" + folded) == []
    for leak in ("The MLP keeps $NC + 4\\,N I$ elements.\n", "keeps (n * hidden + 4 * n * inter) elements\n"):
        assert page_spoilers(leak + head + folded), leak  # above the exercise
        assert page_spoilers(head + folded + "**Exercise 9.8 (open question) — " + leak), leak  # shown, unfolded
    assert spoilers("predict_decay_entry", r"call $o + u + \lfloor u/g \rfloor$")
    assert spoilers("rmsnorm_backward", "dx = r * (g - xhat * mean(g * xhat))")
    assert not spoilers("predict_mlp_saved_bytes", "the distinct storages autograd keeps, the weights excluded")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_each_page_fails_when_its_prediction_is_given_away(page):
    """The real page, with its prediction's answer put back above the exercise or unfolded below it."""
    text = page.read_text(encoding="utf-8")
    kind, function, at = next(e for e in exercises_of(text) if e[0] == "predict, then measure")
    leak = f"It is ${ANSWERS[function][0]}$.\n\n"
    assert page_spoilers(text[:at] + leak + text[at:]), f"{page.name}: a spoiler above {function} passes"
    end = text.index("**Check your solutions**")
    assert page_spoilers(text[:end] + leak + text[end:]), f"{page.name}: an unfolded spoiler passes"
