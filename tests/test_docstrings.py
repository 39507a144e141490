"""Every public function and class of a mechanism module (``bp_mech.<mechanism>``), and every public
method of its public classes, documents itself. The rule, one for functions and methods alike:

- **Example**: always, with ``>>>`` lines that ``pytest --doctest-modules`` runs (``make test`` does,
  through pyproject's ``addopts``); a class's own docstring needs only this.
- **Args**: where it takes arguments (``self`` and ``cls`` do not count; ``ctx`` of an autograd
  ``Function`` does).
- **Returns** (or **Yields** for a generator): where it takes arguments (the rule for functions
  before methods were checked; one that returns nothing says ``None`` and what it changes) or
  returns a value.
- **Raises**: where its own body has a ``raise`` of an exception (a bare re-``raise`` and a ``raise``
  inside a nested function do not count).

Exempt: names starting with ``_`` (dunder methods included) and properties (their docstring is the
attribute's description).
"""

import ast
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
MECHANISMS = sorted(p for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__", "cli"))
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _own_nodes(node: ast.AST):
    """The nodes of ``node``'s body, not descending into nested functions, classes or lambdas."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (*FUNCTIONS, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def _arguments(fn: ast.FunctionDef, method: bool) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
    static = any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list)
    return names[1:] if method and not static and names[:1] in (["self"], ["cls"]) else names


def missing_sections(fn: ast.FunctionDef, method: bool = False) -> list[str]:
    """The sections the rule asks of ``fn`` that its docstring lacks, in the order Example, Args,
    Returns (or Yields), Raises."""
    doc = ast.get_docstring(fn) or ""
    need = ["Example"]
    gives = any(isinstance(n, (ast.Yield, ast.YieldFrom)) or isinstance(n, ast.Return) and n.value
                is not None for n in _own_nodes(fn))
    if args := _arguments(fn, method):
        need.append("Args")
    if args or gives:
        need.append("Yields" if "Yields:" in doc else "Returns")
    if any(isinstance(n, ast.Raise) and n.exc is not None for n in _own_nodes(fn)):
        need.append("Raises")
    return [k for k in need if f"{k}:" not in doc or k == "Example" and ">>>" not in doc]


def _public_methods(cls: ast.ClassDef):
    for node in cls.body:
        decorators = {ast.unparse(d).split(".")[-1] for d in getattr(node, "decorator_list", ())}
        if isinstance(node, FUNCTIONS) and not node.name.startswith("_") \
                and not decorators & {"property", "setter", "deleter", "cached_property"}:
            yield node


def undocumented(source: str) -> list[str]:
    """``name: missing sections`` for each public top-level function or class of ``source`` and each
    public method (``Class.method``) of a public class."""
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node) or ""
            missing = [] if "Example:" in doc and ">>>" in doc else ["Example"]
            methods = [(f"{node.name}.{m.name}", missing_sections(m, method=True))
                       for m in _public_methods(node)]
        else:
            missing, methods = missing_sections(node), []
        out += [f"{name}: {', '.join(m)}" for name, m in [(node.name, missing), *methods] if m]
    return out


def test_every_mechanism_function_and_method_has_its_sections_and_a_running_example():
    assert len(MECHANISMS) >= 13
    gaps = {p.name: g for p in MECHANISMS if (g := undocumented(p.read_text()))}
    assert not gaps, gaps


def test_the_check_sees_a_missing_example_and_missing_args():
    src = 'def f(x):\n    """Doubles.\n\n    Returns:\n        2x.\n    """\n    return 2 * x\n'
    assert undocumented(src) == ["f: Example, Args"]
    assert undocumented('def _private(x):\n    return x\n') == []


DOC = '"""Does.\n\n        Args:\n            x: a.\n\n        Returns:\n            b.\n\n        Example:\n            >>> 1\n            1\n        """'


def test_the_check_reads_methods_and_exempts_properties_dunders_and_private_ones():
    src = (f'class C:\n    """C.\n\n    Example:\n        >>> C()\n    """\n'
           f'    def __init__(self, x):\n        pass\n'
           f'    @property\n    def p(self):\n        return 1\n'
           f'    def _hidden(self, x):\n        return x\n'
           f'    def fine(self, x):\n        {DOC}\n        return x\n'
           f'    def bare(self):\n        return 1\n'
           f'    @staticmethod\n    def forward(ctx, x):\n        """F."""\n        return x\n'
           f'    def load(self, s):\n        {DOC}\n        raise ValueError(s)\n')
    assert undocumented(src) == ["C.bare: Example, Returns", "C.forward: Example, Args, Returns",
                                 "C.load: Raises"]


def test_a_raise_counts_only_in_the_own_body_and_never_a_bare_reraise():
    src = ('def f(x):\n    """F.\n\n    Args:\n        x: a.\n\n    Returns:\n        b.\n\n'
           '    Example:\n        >>> f(1)\n        1\n    """\n'
           '    def inner():\n        raise ValueError\n'
           '    try:\n        return x\n    except OSError:\n        raise\n')
    assert undocumented(src) == []
    assert undocumented(src.replace("raise\n", "raise KeyError(x)\n")) == ["f: Raises"]
