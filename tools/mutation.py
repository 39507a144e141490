"""Mutation testing of the graded code under the exercise checks: the measure the project keeps itself.

``make mutation`` (``python tools/mutation.py [MARKER ...]``, e.g. ``ch12 ch09``; no marker: every chapter). For
each chapter of ``bp_mech.checks.cases()`` the graded code is: every top-level function and class of
``answers/exNN_*.py``, and, for each function or class the exercise file leaves to the learner (its stub raises
``NotImplementedError``) that the answers re-export from ``bp_mech.<module>``, its definition there (of a class, the
methods the stub declares) and the functions and ``self.`` methods it reaches (``tools/mutation_spans.py``).
cosmic-ray 8 (``requirements/mutation.txt``) makes the mutants of those spans (postponed annotations and the
statements listed as ``[[ungraded]]`` in ``tools/mutation_equivalent.toml`` aside: ``mutation_spans.skipped``); each
is judged by that chapter's checks only, in a forked child with a timeout (``tools/mutation_run.py``).

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
from mutation_spans import graded, graded_spans, skipped

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


def listed(kind: str, path: Path = EQUIVALENT) -> list[dict]:
    """The ``[[kind]]`` tables of ``tools/mutation_equivalent.toml``."""
    return tomllib.loads(path.read_text(encoding="utf-8")).get(kind, []) if path.exists() else []


def load_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """``{mutant name: why it is equivalent}`` from ``[[equivalent]]`` tables (``mutant``, ``reason``)."""
    return {r["mutant"]: r["reason"] for r in listed("equivalent", path)}


def summarize(copy: Path, exercise: str, spans, results, equivalent: dict[str, str], timeout: int) -> dict:
    """A chapter's report entry from cosmic-ray's ``(work item, result)`` pairs."""
    trees = {rel: ast.parse((copy / rel).read_text(encoding="utf-8")) for rel in spans}
    ungraded = [r for r in listed("ungraded") if r["exercise"] == exercise]
    notes = skipped(copy, spans, ungraded)
    counts = dict.fromkeys(COUNTS, 0)
    survivors, equivalents, listed_but_killed, seconds, seen = [], [], [], 0.0, {}
    for item, result in sorted(results, key=lambda r: mutation_run.order(r[0])):
        m = item.mutations[0]
        rel = Path(m.module_path).resolve().relative_to(copy.resolve()).as_posix()
        if result.worker_outcome.value != "normal" or not graded(spans[rel], notes[rel], m.start_pos):
            continue  # skipped (not graded, an annotation, ungraded) or no mutation possible
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
            "equivalents": equivalents, "listed_equivalent_but_killed": listed_but_killed,
            "ungraded": ungraded}


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
            notes = skipped(copy, spans, [r for r in listed("ungraded") if r["exercise"] == exercise])
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
