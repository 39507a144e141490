"""No page hands over what a prediction asks for (issue 28, item 3), also through what it shows of a stub.

- The four give-aways found on the pages stay caught: put back where they stood, above their
  exercise, each fails ``page_spoilers`` (the spellings in ``test_exercise_pages.ANSWERS``).
- A stub's docstring shown above a predict-then-measure exercise (a ``literalinclude`` of
  ``exercises/exNN_*.py`` with ``:pyobject:``, as 56 shows ``ReplayStream`` above Exercise 56.5) does
  not state that prediction's answer: the page's own text is checked by ``test_exercise_pages``,
  the included docstrings here.
"""

import ast
import re
from pathlib import Path

import pytest

from bp_mech import ROOT
from book.test_exercise_pages import ANSWERS, PAGES, exercises_of, page_spoilers, spoilers

PART02 = ROOT / "book" / "part02"
# (page, the exercise's graded function, the text that gave its answer away before it was moved)
LEAKS = [
    ("56-continual-pretrain.md", "predict_replay_tokens",  # Exercise 56.4's text, above 56.5
     "Write the stream that does it deterministically — after $n$ rows exactly\n"
     "$\\lfloor n q \\rfloor$ replayed — and make its state part of what a resumed run restores.\n\n"),
    ("43-state-ledger.md", "predict_forward_bytes",  # the stage table of the math section
     "| after forward | $W$ + optimizer states $M$ + saved activations + what the loss saved |\n\n"),
    ("10-attention-backward.md", "predict_eager_saved_bytes",  # the results' account of autograd's extra
     "probabilities: the $T\\times T$ boolean mask of `masked_fill` ({glue:text}`mask_bytes`) and\n\n"),
    ("55-update-dynamics.md", "predict_first_update_norm",  # the results' base-LR move, per element
     "At the base LR the {glue:text}`ud_n` updates move an element by at most about\n"
     "{glue:text}`ud_base_move:g` in all.\n\n"),
]


@pytest.mark.parametrize("name, function, leak", LEAKS, ids=[c[0][:2] for c in LEAKS])
def test_a_give_away_put_back_above_its_exercise_fails(name, function, leak):
    text = (PART02 / name).read_text(encoding="utf-8")
    assert page_spoilers(text) == [], f"{name} gives an answer away as it stands"
    at = next(a for _, f, a in exercises_of(text) if f == function)
    found = page_spoilers(text[:at] + leak + text[at:])
    assert any(s.startswith(f"{function}: ") for s in found), f"{name}: the old give-away of {function} passes"


def test_the_replay_stub_no_longer_states_the_count():
    """ReplayStream's docstring gave the count Exercise 56.5 asks for; the spellings catch that sentence."""
    old = "so that after n rows exactly floor(n * replay / period) were replayed, spread evenly"
    assert spoilers("predict_replay_tokens", old)
    stub = (ROOT / "exercises" / "ex56_continual_pretrain.py").read_text(encoding="utf-8")
    assert not spoilers("predict_replay_tokens", stub)


def _docstrings(path: Path, obj: str) -> str:
    """The docstrings of ``obj`` (``Class`` or ``Class.method``) in ``path`` and of everything inside it."""
    node = ast.parse(path.read_text(encoding="utf-8"))
    for part in obj.split("."):
        node = next(n for n in node.body if getattr(n, "name", None) == part)
    return "\n".join(ast.get_docstring(n) or "" for n in ast.walk(node)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def shown_stub_spoilers(page: Path, text: str) -> list[str]:
    """'function: object: spelling' for each prediction whose answer the docstring of a stub object
    shown above its exercise states."""
    found = []
    for kind, function, at in exercises_of(text):
        if kind != "predict, then measure":
            continue
        for m in re.finditer(r"^```\{literalinclude\}\s*(\S*exercises/\w+\.py)\n:pyobject: ([\w.]+)", text[:at], re.M):
            doc = _docstrings((page.parent / m.group(1)).resolve(), m.group(2))
            found += [f"{function}: {m.group(2)}: {s}" for s in spoilers(function, doc)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_stub_shown_above_a_prediction_states_its_answer(page):
    found = shown_stub_spoilers(page, page.read_text(encoding="utf-8"))
    assert not found, f"{page.name} shows a stub that gives a prediction away: {found}"


def test_a_stub_shown_above_a_prediction_is_read(tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ex56_x.py").write_text(
        'class ReplayStream:\n    """After n rows exactly floor(n * replay / period) were replayed."""\n')
    page = tmp_path / "book" / "p.md"
    text = ("```{literalinclude} ../exercises/ex56_x.py\n:pyobject: ReplayStream\n```\n\n"
            "**Exercise 56.5 (predict, then measure) — tokens.**\n\n"
            "```{literalinclude} ../exercises/ex56_x.py\n:pyobject: predict_replay_tokens\n```\n")
    assert "predict_replay_tokens" in ANSWERS
    assert shown_stub_spoilers(page, text) == ["predict_replay_tokens: ReplayStream: floor(nreplay/period)"]
