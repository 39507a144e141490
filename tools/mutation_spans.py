"""What ``tools/mutation.py`` mutates: the graded spans of a chapter, less what is never run or never reached.

The graded code of an exercise (``graded_spans``): every top-level function and class of ``answers/exNN_*.py``, and,
for each function or class the exercise file leaves to the learner (its stub raises ``NotImplementedError``) that the
answers re-export from ``bp_mech.<module>``, its definition there (of a class, the methods the stub declares) and the
functions and ``self.`` methods it reaches. Left out of those spans (``skipped``): postponed annotations, never
evaluated, and the statements ``tools/mutation_equivalent.toml`` lists as ``[[ungraded]]``.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _defs(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _span(node) -> tuple[int, int]:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]), node.end_lineno


def _raises_not_implemented(node) -> bool:
    raised = [n.exc.func if isinstance(n.exc, ast.Call) else n.exc for n in ast.walk(node) if isinstance(n, ast.Raise)]
    return any(isinstance(r, ast.Name) and r.id == "NotImplementedError" for r in raised)


def graded_names(exercise: Path) -> list[str]:
    """The functions and classes an exercise file leaves to the learner (their stubs raise NotImplementedError)."""
    tree = ast.parse(exercise.read_text(encoding="utf-8"))
    return [name for name, node in _defs(tree).items() if not name.startswith("_") and _raises_not_implemented(node)]


def _stub_methods(exercise: Path, name: str) -> list[str]:
    """The methods the exercise file's class ``name`` declares (what the learner writes)."""
    node = _defs(ast.parse(exercise.read_text(encoding="utf-8")))[name]
    return [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _with_helpers(start: list[str], defs: dict[str, ast.AST]) -> list[str]:
    """The definitions ``start`` names (``f``, ``Class.method``) and, transitively, the module's functions they
    name and the methods of their own class they reach through ``self.<name>``."""
    found, todo = [], list(start)
    while todo:
        qual = todo.pop(0)
        if qual in found:
            continue
        found.append(qual)
        cls, _, _ = qual.rpartition(".")
        for u in ast.walk(_node(qual, defs)):
            if isinstance(u, ast.Name) and isinstance(defs.get(u.id), (ast.FunctionDef, ast.AsyncFunctionDef)):
                todo.append(u.id)
            elif cls and isinstance(u, ast.Attribute) and isinstance(u.value, ast.Name) and u.value.id == "self":
                todo += [f"{cls}.{u.attr}"] if u.attr in _methods(defs[cls]) else []
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _node(qual: str, defs: dict[str, ast.AST]) -> ast.AST:
    cls, _, name = qual.rpartition(".")
    return _methods(defs[cls])[name] if cls else defs[name]


def graded_spans(root: Path, exercise: str) -> dict[str, list[tuple[str, int, int]]]:
    """``{file relative to root: [(definition, first line, last line)]}``: what is mutated for one chapter."""
    answers = root / "answers" / f"{exercise}.py"
    tree = ast.parse(answers.read_text(encoding="utf-8"))
    defs = _defs(tree)
    spans = {answers.relative_to(root).as_posix(): [(n, *_span(node)) for n, node in defs.items()]}
    imported = {a.asname or a.name: (n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("bp_mech") for a in n.names}
    for name in graded_names(root / "exercises" / f"{exercise}.py"):
        if name in defs:
            continue
        if name not in imported:
            raise SystemExit(f"{answers.name}: graded {name!r} is neither defined nor imported from bp_mech")
        module, original = imported[name]
        path = root / "src" / Path(*module.split(".")).with_suffix(".py")
        mdefs = _defs(ast.parse(path.read_text(encoding="utf-8")))
        if original not in mdefs:
            raise SystemExit(f"{answers.name}: {original!r} is not defined in {module}")
        start = [original]
        if isinstance(mdefs[original], ast.ClassDef):  # only the methods the exercise asks for (and what they use)
            stub = _stub_methods(root / "exercises" / f"{exercise}.py", name)
            start = [f"{original}.{m}" for m in stub if m in _methods(mdefs[original])]
        rows = spans.setdefault(path.relative_to(root).as_posix(), [])
        rows += [(q, *_span(_node(q, mdefs))) for q in _with_helpers(start, mdefs) if q not in {r[0] for r in rows}]
    return spans


def annotations(tree: ast.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of the annotations of a module that postpones them (``from __future__ import
    annotations``): never evaluated, so a mutant there is equivalent by construction and is not run."""
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations"
               for a in n.names) for n in tree.body):
        return []
    found = [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found += [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign))]
    return [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found if a is not None]


def graded(spans: list[tuple[str, int, int]], notes, pos: tuple[int, int]) -> bool:
    """Whether a mutant at ``pos`` (line, column) is in a graded span and outside every annotation."""
    return any(a <= pos[0] <= b for _, a, b in spans) and not any(a <= tuple(pos) < b for a, b in notes)


def skipped(root: Path, rels, ungraded: list[dict]) -> dict[str, list[tuple[tuple[int, int], tuple[int, int]]]]:
    """``{file: [(start, end) positions]}`` not mutated: the postponed annotations (``annotations``) and each statement
    an ``[[ungraded]]`` table of the chapter names (``exercise``, ``file``, ``definition``, ``statement``: its first
    line as ``ast.unparse`` writes it, ``reason``): a branch of graded code that the chapter's exercise never reaches
    (a package extension the stub does not have), left out whole rather than each of its mutants listed as
    equivalent. A table that names no statement, or two, stops the run."""
    out = {}
    for rel in rels:
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        out[rel] = annotations(tree)
        for row in (r for r in ungraded if r["file"] == rel):
            hits = [s for s in ast.walk(_node(row["definition"], _defs(tree))) if isinstance(s, ast.stmt)
                    and ast.unparse(s).split("\n", 1)[0] == row["statement"]]
            if len(hits) != 1:
                raise SystemExit(f"[[ungraded]] {row['statement']!r}: {len(hits)} statements of {rel}::"
                                 f"{row['definition']}, expected one")
            out[rel].append(((hits[0].lineno, 0), (hits[0].end_lineno + 1, 0)))
    return out
