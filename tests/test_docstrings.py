"""Every public function and class of a mechanism module (``bp_mech.<mechanism>``) documents itself:
Args and Returns (or Yields) where it takes arguments, and an Example that ``pytest --doctest-modules``
runs (``make test`` does, through pyproject's ``addopts``)."""

import ast
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
MECHANISMS = sorted(p for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__", "cli"))


def undocumented(source: str) -> list[str]:
    """``name: missing sections`` for each public top-level function or class of ``source``."""
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        need = ["Example"]
        if isinstance(node, ast.FunctionDef) and node.args.args:
            need += ["Args", "Yields" if "Yields:" in doc else "Returns"]
        if missing := [k for k in need if f"{k}:" not in doc or k == "Example" and ">>>" not in doc]:
            out.append(f"{node.name}: {', '.join(missing)}")
    return out


def test_every_mechanism_function_has_args_returns_and_a_running_example():
    assert len(MECHANISMS) >= 13
    gaps = {p.name: g for p in MECHANISMS if (g := undocumented(p.read_text()))}
    assert not gaps, gaps


def test_the_check_sees_a_missing_example_and_missing_args():
    src = 'def f(x):\n    """Doubles.\n\n    Returns:\n        2x.\n    """\n    return 2 * x\n'
    assert undocumented(src) == ["f: Example, Args"]
    assert undocumented('def _private(x):\n    return x\n') == []
