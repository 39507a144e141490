"""One import path per public name: every ``from bp_mech.X import name`` names the module that defines
``name`` (a ``def``, a ``class`` or an assignment in X), never one that merely imports it from a sibling
and passes it on; a submodule (``from bp_mech import amp``) is its own path. No private name (a leading
underscore) is imported across modules, except by a test from the module it tests.

Checked everywhere a reader or a module imports from: ``src``, ``tests``, ``answers``, ``exercises`` (with
the doctests in their docstrings) and the code cells of the book's pages."""

import ast
import re
from functools import cache
from pathlib import Path

import bp_mech

SRC = Path(bp_mech.__file__).parent
ROOT = SRC.parents[1]
CELL = re.compile(r"```\{code-cell\}[^\n]*\n(.*?)```", re.S)


def module_file(module: str) -> Path | None:
    path = SRC.parent.joinpath(*module.split("."))
    return next((p for p in (path / "__init__.py", path.with_suffix(".py")) if p.is_file()), None)


@cache
def defined(module: str) -> frozenset[str]:
    """The names ``module`` defines at its top level (in ``if``/``try``/``with`` blocks too); imports are not
    definitions."""
    names, todo = set(), list(ast.parse(module_file(module).read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return frozenset(names)


def doctests(tree: ast.AST) -> str:
    """The doctest lines of every docstring in ``tree``, prompts stripped."""
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n".join(line.strip()[4:] for d in docs for line in d.splitlines()
                     if line.strip().startswith((">>> ", "... ")))


def sources():
    """(file, code) for every file and, within it, its doctests; a page's code cells one by one."""
    for folder in ("src", "tests", "answers", "exercises"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            yield path, tree
            try:
                yield path, ast.parse(doctests(tree))
            except SyntaxError:  # a doctest continued in a way this crude join cannot parse: skip it
                pass
    for path in sorted((ROOT / "book").rglob("*.md")):
        if "_build" not in path.parts:
            for cell in CELL.findall(path.read_text()):
                code = "\n".join(x for x in cell.splitlines() if not x.startswith((":", "%", "!")))
                yield path, ast.parse(code)


def own_test(path: Path, module: str) -> bool:
    """Whether ``path`` is the test of ``module`` (tests/.../test_<name>.py; test_contract_NN.py for a
    chapter's checks)."""
    name, last = path.stem.removeprefix("test_"), module.rpartition(".")[2]
    chapter = name.removeprefix("contract_")
    return ROOT / "tests" in path.parents and (
        name == last or name.startswith(last + "_") or last in (f"ex{chapter}", f"ex{chapter}_contract"))


def violations(path: Path, tree: ast.AST) -> list[str]:
    """``file: from X import name (why)`` for each import of ``tree`` (from ``path``, absolute) that breaks
    the rules; a private name read off an imported module (``mod._name``) counts as its import."""
    out, where, modules = [], path.relative_to(ROOT) if path.is_absolute() else path, {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bp_mech")):
            continue
        if module_file(node.module) is None:
            out.append(f"{where}: from {node.module} import ... (no such module)")
            continue
        for alias in node.names:
            name = alias.name
            if module_file(f"{node.module}.{name}") is not None:
                modules[alias.asname or name] = f"{node.module}.{name}"
            elif name not in defined(node.module) and not name.startswith("__"):
                out.append(f"{where}: from {node.module} import {name} (not defined there: a re-export)")
            elif private(name) and module_file(node.module) != path and not own_test(path, node.module):
                out.append(f"{where}: from {node.module} import {name} (a private name from another module)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and private(node.attr) and not own_test(path, modules[node.value.id]):
            out.append(f"{where}: {modules[node.value.id]}.{node.attr} (a private name from another module)")
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_import_names_the_module_that_defines_the_name():
    bad = [v for path, tree in sources() for v in violations(path, tree)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_re_export_a_private_name_and_lets_a_submodule_pass():
    code = ast.parse("from bp_mech.ledger import theoretical, STAGES\nfrom bp_mech import amp\n"
                     "from bp_mech.instruments.tracking import storage_of\n"
                     "from bp_mech.planner.trace import _missing_on_purpose\n")
    assert "STAGES" in defined("bp_mech.ledger_table") and "theoretical" in defined("bp_mech.ledger")
    bad = violations(Path("answers/x.py"), code)
    assert len(bad) == 2 and "import STAGES (not defined there" in bad[0] and "_missing_on_purpose" in bad[1]
    private = ast.parse("from bp_mech.checks.ex19 import _Counted")
    assert violations(ROOT / "tests/checks/test_contract_19.py", private) == []
    assert "private name" in violations(ROOT / "tests/projects/test_x.py", ast.parse(
        "from bp_mech.planner.pool import _call"))[0]
    assert "private name" in violations(ROOT / "answers/x.py", ast.parse(
        "from bp_mech.planner import pool\npool._call(1)"))[0]
