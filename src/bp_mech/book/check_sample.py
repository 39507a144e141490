"""What ``bp-mech check NN`` tells a reader about a typical mistake, run when a chapter is built.

A typical wrong solution is the answer with one slip: a result off by a constant factor, as a forgotten
normalisation (a mean taken as a sum over one more or one fewer element, a missing ``1/n``) leaves it.
``mistake_sample`` writes such a variant beside the untouched stubs (every other function still raises
``NotImplementedError``, so only the wrong one is graded), runs the chapter's checks on it through the
check entry the page hands in (``bp_mech.checks.runner.check_chapter``: the book's layer does not import
the checks) and returns the command and the line the reader gets for that function.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from bp_mech import ROOT

FACTOR = 1 + 2**-6  # the slip: every floating-point result of the wrong function times this


def exercise_file(chapter: str) -> Path:
    """``exercises/exNN_<topic>.py`` of a chapter ("09", "amp", ...)."""
    pattern = f"ex{chapter}_*.py" if chapter.isdigit() else f"ex_{chapter}_*.py"
    found = sorted((ROOT / "exercises").glob(pattern))
    if len(found) != 1:
        raise ValueError(f"chapter {chapter}: expected one exercise file {pattern}, found {len(found)}")
    return found[0]


def _scaled(out):
    """``out`` with each float and floating-point tensor in it (alone, or in a tuple, list or dict) times
    ``FACTOR``; a nonzero int (a count of bytes) grows by its 64th part, at least 1."""
    import torch

    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out * FACTOR
    if isinstance(out, float):
        return out * FACTOR
    if isinstance(out, int) and not isinstance(out, bool) and out:  # a count (bytes): off by its 64th part
        return out + (abs(out) >> 6 or 1)
    if isinstance(out, dict):
        return {k: _scaled(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(_scaled(x) for x in out)
    return out


def off_by_a_factor(fn):
    """``fn`` with its floating-point results times ``FACTOR`` (the slip of ``mistake_sample``)."""

    @functools.wraps(fn)
    def wrong(*args, **kwargs):
        return _scaled(fn(*args, **kwargs))

    return wrong


VARIANT = '''

# --- the sample's slip: {name} is the answer's, off by a constant factor ---
import importlib.util as _util
import sys as _sys

_spec = _util.spec_from_file_location("_bp_mech_sample_answer_{stem}", {answer!r})
_answer = _util.module_from_spec(_spec)
_sys.modules[_spec.name] = _answer
_spec.loader.exec_module(_answer)
from bp_mech.book.check_sample import off_by_a_factor as _off_by_a_factor  # noqa: E402

{name} = _off_by_a_factor(_answer.{name})
'''


def variant_text(stub: Path, name: str) -> str:
    """The stub file's text with ``name`` replaced by the answer's, off by ``FACTOR``."""
    answer = ROOT / "answers" / stub.name
    return stub.read_text(encoding="utf-8") + VARIANT.format(name=name, stem=stub.stem, answer=str(answer))


def mistake_sample(chapter: str, check_chapter) -> str:
    """The command and the line ``bp-mech check`` prints for the first function of the chapter's exercise
    file that the slip makes fail (the others, untouched stubs, are left out), or why none failed.
    ``check_chapter(chapter, directory)``: the check entry, ``bp_mech.checks.runner.check_chapter``."""
    import ast

    stub = exercise_file(chapter)
    tree = ast.parse(stub.read_text(encoding="utf-8"))
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            (Path(tmp) / stub.name).write_text(variant_text(stub, name), encoding="utf-8")
            lines = check_chapter(chapter, tmp)
            line = next((x for x in lines if x.function == name and x.status == "FAIL"), None)
            if line is not None:
                return (f"$ bp-mech check {chapter}   # {stub.name}: {name} returns the answer's result plus a "
                        f"64th of it (a count: at least 1 more); the other functions are still stubs\n{line}")
    return f"$ bp-mech check {chapter}   # no function of {stub.name} returns a number the slip changes"
