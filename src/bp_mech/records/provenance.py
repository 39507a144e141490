"""Provenance of a record: when, from which code, at which commit.

* ``code_hash(module)``: what decides whether a record is *stale*. It hashes the code that determines
  the record's numbers: the experiment module and every ``bp_mech`` module it imports, followed
  transitively (``code_modules``), each as its syntax tree with docstrings, comments and line numbers
  removed (``canonical``). A docstring edit leaves records fresh; a code change in anything the
  experiment runs makes them stale. Modules that only store, show or describe results are not hashed
  (``NOT_HASHED``).
* ``git_commit()``: the commit of the tree, or ``$BP_MECH_GIT_COMMIT`` where the tree was copied without
  ``.git`` (the GPU machine).
* ``provenance(module)``: the provenance fields of a record.
"""

from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import importlib
import importlib.util
import inspect
import os
import subprocess
from functools import lru_cache
from pathlib import Path

# Modules that store, show or describe results and compute none of their numbers: a change in
# them leaves every record fresh. ``environment`` describes the machine (its output is the
# record's environment fields) and says which candidates can run; the package root holds the
# version, recorded as ``bp_mech_version``.
NOT_HASHED = frozenset({"bp_mech", "bp_mech.__main__", "bp_mech.cli", "bp_mech.book.report", "bp_mech.book.plots",
                        "bp_mech.records.registry", "bp_mech.records.results", "bp_mech.records.provenance", "bp_mech.records.environment"})


def module_source(name: str) -> str:
    """The source text of module ``name``, read from its file."""
    spec = importlib.util.find_spec(name)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return inspect.getsource(importlib.import_module(name))
    return Path(spec.origin).read_text(encoding="utf-8")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # "bp_mech.bench.oom.attempt": a name imported from a module
        return False


def _is_docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def canonical(node) -> str:
    """The text of a syntax tree that only code changes change: node types and their non-empty
    fields sorted by name, without positions (so no line numbers) and without bare string
    statements (docstrings). Fields a newer Python added are empty in code that does not use
    them (``type_params``), so the text is the same on Python 3.10 to 3.13; comments never
    reach the tree."""
    if isinstance(node, ast.AST):
        fields = []
        for name in sorted(node._fields):
            value = getattr(node, name, None)
            if isinstance(value, list):
                value = [v for v in value if not _is_docstring(v)]
            if value is not None and not (isinstance(value, list) and not value):
                fields.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical(v) for v in node) + "]"
    return f"{type(node).__name__}:{node!r}"


@lru_cache(maxsize=256)
def _analyse(name: str, source: str) -> tuple[str, tuple[str, ...]]:
    """(sha256 of the canonical tree, the bp_mech modules it imports or lists in CODE_MODULES)."""
    tree = ast.parse(source)
    spec = importlib.util.find_spec(name)
    package = name if spec is not None and spec.submodule_search_locations is not None else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(tree):  # every import statement, those inside functions too
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            named.add(base)
            named.update(f"{base}.{a.name}" for a in node.names)  # from bp_mech import measure
    for node in tree.body:  # CODE_MODULES = ("bp_mech.x", ...): explicit additions
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CODE_MODULES" for t in node.targets):
            named.update(ast.literal_eval(node.value))
    deps = sorted(m for m in named if m.split(".")[0] == "bp_mech" and _is_module(m))
    return hashlib.sha256(canonical(tree).encode()).hexdigest(), tuple(deps)


def code_modules(module: str) -> list[str]:
    """The modules whose code determines an experiment's numbers: the experiment module and,
    transitively, every ``bp_mech`` module it imports (import statements anywhere in the file,
    read with ``ast``; ``importlib`` calls are not followed) or lists in ``CODE_MODULES``, less
    NOT_HASHED."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or (name in NOT_HASHED and name != module):
            continue
        seen.add(name)
        todo.extend(_analyse(name, module_source(name))[1])
    return sorted(seen)


def code_hash(module: str) -> str:
    """sha256 (16 hex) over ``code_modules(module)``: each one's name and canonical tree. A
    docstring or comment edit, or a change in a module the experiment does not import, leaves
    it unchanged; any code change in one it imports changes it."""
    h = hashlib.sha256()
    for name in code_modules(module):
        h.update(f"{name}\0{_analyse(name, module_source(name))[0]}\0".encode())
    return h.hexdigest()[:16]


def is_stale(record, module: str) -> bool:
    return record.code_hash != code_hash(module)


GIT_COMMIT_ENV = "BP_MECH_GIT_COMMIT"  # the commit, where the tree was copied without .git (the GPU suite)


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the repository this package's source tree is the work tree of; else the value of
    ``$BP_MECH_GIT_COMMIT``; else None. A git repository around an installed or copied tree
    (its top level is not this tree's root) is not this code's history and is ignored."""
    from bp_mech import ROOT as root

    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root / "src" / "bp_mech",
                             capture_output=True, text=True, timeout=5)
        lines = out.stdout.splitlines()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root:
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(GIT_COMMIT_ENV, "").strip() or None


def provenance(module: str) -> dict:
    from bp_mech import __version__

    return dict(
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        bp_mech_version=__version__,
        code_hash=code_hash(module),
        git_commit=git_commit(),
    )
