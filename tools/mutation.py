"""Mutation testing of the graded code under the exercise checks: the measure the project keeps itself.

``make mutation`` (``python tools/mutation.py [MARKER ...]``, e.g. ``ch12 ch09``; no marker: every chapter). For
each chapter of ``bp_mech.checks.cases()`` the graded code is: every top-level function and class of
``answers/exNN_*.py``, and, for each function or class the exercise file leaves to the learner (its stub raises
``NotImplementedError``) that the answers re-export from ``bp_mech.<module>``, its definition there (of a class, the
methods the stub declares) and the functions and ``self.`` methods it reaches. cosmic-ray 8 (``requirements/
mutation.txt``) makes the mutants of those spans (postponed annotations aside); each is judged by that chapter's
checks only, in a forked child with a timeout (``tools/mutation_run.py``).

Counts per chapter: ``generated`` = ``killed`` (a check failed) + ``timed_out`` (the checks outlived the timeout:
detected, as mutation testers count it) + ``survived`` + ``equivalent`` (a survivor listed, with its reason, in
``tools/mutation_equivalent.toml``); ``score = (killed + timed_out) / (generated - equivalent)``. A mutant is named by
``<file>::<definition>: `<line before>` -> `<line after>``` (a description that does not shift when other mutants
come or go), and ``tools/mutation_equivalent.toml`` is keyed by that name.

The report, ``tools/mutation_report.json``, sits beside the tool and the list it reads, not in ``book/results`` (run
records, schema-validated by ``tests/records``, rewritten by ``make records``). It names the mutated files by SHA-256;
``tests/tools/test_mutation.py`` fails when one changed since, or when CONTRIBUTING.md's "Mutation score" table
(written here) is not the report's. Sessions (cosmic-ray's sqlite) are kept per tree hash under
``mutation_run.SCRATCH``: an interrupted run resumes; ``--summarize COPY`` re-reads them after the list is edited.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import mutation_run

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tools" / "mutation_report.json"
EQUIVALENT = ROOT / "tools" / "mutation_equivalent.toml"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
BEGIN, END = "<!-- mutation-table:begin -->", "<!-- mutation-table:end -->"
TIMEOUT_FACTOR = 5  # a mutant's checks may take this many times the unmutated run...
MIN_TIMEOUT_S = 20  # ...and at least this long (fork, imports, a busy machine)
COUNTS = ("generated", "killed", "timed_out", "survived", "equivalent")


class ChapterError(RuntimeError):
    """A chapter that cannot be measured (its checks fail on the unmutated answers)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def load_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """``{mutant name: why it is equivalent}`` from ``[[equivalent]]`` tables (``mutant``, ``reason``)."""
    rows = tomllib.loads(path.read_text(encoding="utf-8")).get("equivalent", []) if path.exists() else []
    return {r["mutant"]: r["reason"] for r in rows}


def summarize(copy: Path, exercise: str, spans, results, equivalent: dict[str, str], timeout: int) -> dict:
    """A chapter's report entry from cosmic-ray's ``(work item, result)`` pairs."""
    trees = {rel: ast.parse((copy / rel).read_text(encoding="utf-8")) for rel in spans}
    notes = {rel: annotations(tree) for rel, tree in trees.items()}
    counts = dict.fromkeys(COUNTS, 0)
    survivors, equivalents, listed_but_killed, seconds, seen = [], [], [], 0.0, {}
    for item, result in sorted(results, key=lambda r: mutation_run.order(r[0])):
        m = item.mutations[0]
        rel = Path(m.module_path).resolve().relative_to(copy.resolve()).as_posix()
        if result.worker_outcome.value != "normal" or not graded(spans[rel], notes[rel], m.start_pos):
            continue  # skipped (not graded, or an annotation) or no mutation possible
        name = mutation_run.describe(rel, mutation_run.qualname(trees[rel], m.start_pos[0]), result.diff or "")
        seen[name] = seen.get(name, 0) + 1
        name += f" (#{seen[name]})" if seen[name] > 1 else ""
        outcome, took = result.output.split("\n", 1)[0].split()
        seconds += float(took.rstrip("s"))
        counts["generated"] += 1
        if outcome == "survived" and name in equivalent:
            counts["equivalent"] += 1
            equivalents.append({"mutant": name, "reason": equivalent[name]})
        elif outcome == "survived":
            counts["survived"] += 1
            survivors.append(name)
        else:
            counts["timed_out" if outcome == "timeout" else "killed"] += 1
            listed_but_killed += [name] if name in equivalent else []
    detected, judged = counts["killed"] + counts["timed_out"], counts["generated"] - counts["equivalent"]
    return {"exercise": exercise, "files": {rel: sha256(copy / rel) for rel in sorted(spans)},
            "graded": [f"{rel}::{n}" for rel, rows in sorted(spans.items()) for n, _, _ in rows],
            **counts, "score": round(detected / judged, 4) if judged else 1.0,
            "seconds": round(seconds, 1), "timeout_s": timeout, "survivors": survivors,
            "equivalents": equivalents, "listed_equivalent_but_killed": listed_but_killed}


def run_chapter(copy: Path, marker: str, exercise: str, factor: float) -> dict:
    """Make (or resume) the chapter's cosmic-ray session, run its pending mutants, summarize (with the equivalent
    list as it is when the chapter ends)."""
    from cosmic_ray.commands.init import init
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans = graded_spans(copy, exercise)
    with use_db(str(copy / f"{marker}.sqlite"), WorkDB.Mode.create) as db:
        if db.num_work_items == 0:
            init([copy / rel for rel in spans], db, {})
            notes = {rel: annotations(ast.parse((copy / rel).read_text(encoding="utf-8"))) for rel in spans}
            for item in db.work_items:
                m = item.mutations[0]
                rel = Path(m.module_path).resolve().relative_to(copy.resolve()).as_posix()
                if not graded(spans[rel], notes[rel], m.start_pos):
                    db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
        base = mutation_run.run_checks(copy, marker, 600)
        if base.outcome != "survived":
            raise ChapterError(f"{marker}: the checks fail on the unmutated answers ({base.outcome}: {base.message})")
        timeout = max(MIN_TIMEOUT_S, math.ceil(factor * base.seconds))
        print(f"{marker}: {len(db.pending_work_items)} mutants to run, unmutated checks {base.seconds:.1f}s, "
              f"timeout {timeout}s", flush=True)
        mutation_run.execute(copy, marker, db, timeout, progress=lambda s: print(s, flush=True))
        return summarize(copy, exercise, spans, db.completed_work_items, load_equivalent(), timeout)


def render_table(report: dict) -> str:
    """The "Mutation score" table of CONTRIBUTING.md, from the report."""
    rows = ["| chapter | exercise | mutants | killed | timed out | survived | equivalent | score | minutes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for marker, c in report["chapters"].items():
        if "score" not in c:
            rows.append(f"| {marker} | `{c['exercise']}` | not run yet | | | | | | |")
            continue
        counts = " | ".join(str(c[k]) for k in COUNTS)
        rows.append(f"| {marker} | `{c['exercise']}` | {counts} | {c['score']:.1%} | {c['seconds'] / 60:.1f} |")
    return "\n".join(rows)


def write_contributing(report: dict, path: Path = CONTRIBUTING) -> None:
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{render_table(report)}\n{END}{tail}", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("markers", nargs="*", help="chapters to run (pytest markers: ch09, amp, ...); none: all")
    parser.add_argument("--timeout-factor", type=float, default=TIMEOUT_FACTOR)
    parser.add_argument("--list", action="store_true", help="print each chapter's graded spans and stop")
    parser.add_argument("--summarize", type=Path, metavar="COPY",
                        help="only rewrite the report from the sessions kept in this scratch copy (after editing "
                             "the equivalent list), running nothing")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize_sessions(args.summarize, args.markers)

    copy = mutation_run.scratch_copy(ROOT)
    chapters = mutation_run.prepare(copy)
    if set(args.markers) - set(chapters):
        raise SystemExit(f"unknown chapters {sorted(set(args.markers) - set(chapters))}; known: {sorted(chapters)}")
    if args.list:
        for marker, exercise in chapters.items():
            print(marker, json.dumps(graded_spans(copy, exercise)))
        return 0
    old = json.loads(REPORT.read_text(encoding="utf-8")) if REPORT.exists() else {"chapters": {}}
    report = {"tool": "cosmic-ray " + version("cosmic-ray") + ", driven by tools/mutation.py",
              "score": "(killed + timed_out) / (generated - equivalent)", "chapters": {}}
    failed = []
    for marker in args.markers or chapters:  # in the order asked for
        try:
            report["chapters"][marker] = run_chapter(copy, marker, chapters[marker], args.timeout_factor)
        except ChapterError as e:  # the other chapters still run; this one keeps its old entry
            print(e, flush=True)
            failed.append(marker)
        _write(report, old, chapters)  # after each chapter: an interrupted run keeps what it measured
    return 1 if failed else 0


def summarize_sessions(copy: Path, markers: list[str]) -> int:
    """Rewrite the report's entries of the chapters with a session in ``copy`` (all, or ``markers``)."""
    from cosmic_ray.work_db import WorkDB, use_db

    old = json.loads(REPORT.read_text(encoding="utf-8"))
    chapters = {m: c["exercise"] for m, c in old["chapters"].items()}
    report = {k: v for k, v in old.items() if k != "chapters"} | {"chapters": {}}
    for marker, exercise in chapters.items():
        if (copy / f"{marker}.sqlite").exists() and (not markers or marker in markers):
            with use_db(str(copy / f"{marker}.sqlite"), WorkDB.Mode.open) as db:
                report["chapters"][marker] = summarize(copy, exercise, graded_spans(copy, exercise),
                                                       db.completed_work_items, load_equivalent(),
                                                       old["chapters"][marker].get("timeout_s", 0))
            print(marker, {k: report["chapters"][marker][k] for k in (*COUNTS, "score")})
    _write(report, old, chapters)
    return 0


def _write(report: dict, old: dict, chapters: dict[str, str]) -> None:
    """Merge this run's chapters into the old report (chapters not rerun keep their entry) and write both files."""
    merged = dict(report, chapters={m: report["chapters"].get(m) or old["chapters"].get(m) or
                                    {"exercise": e, "status": "not run"} for m, e in chapters.items()})
    REPORT.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    write_contributing(merged)


if __name__ == "__main__":
    sys.exit(main())
