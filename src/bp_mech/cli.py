"""``bp-mech``: run experiments, check exercises, validate records, preflight a profile.

Bad input (unknown ID, profile or mode, a shape the model cannot take, ``real_gpu`` without
CUDA, a corrupt record, a pretrained model missing from the offline cache) prints one line on
stderr and exits with status 2. In a suite, a failing experiment prints its full traceback and
the next one runs; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bp_mech import RESULTS_DIR, ROOT
from bp_mech.records import provenance, registry, results
from bp_mech.records.environment import ProfileError, check_profile, cuda_available, preflight
from bp_mech.bench.timing import SMOKE_SCHEDULE
from bp_mech.bench.oom import release_memory
from bp_mech.training_state import TrainingStateError
from bp_mech.bench.workload import WorkloadError, model_commit, parse_workload



class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2
        raise UsageError(message)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


TABLE_FIELDS = ("candidate", "all_finite", "output_error", "grad_error", "peak_allocated", "step_median_s",
                "step_p95_s", "decision", "failure")


def print_table(records: list[results.Record], file=None) -> None:
    file = file or sys.stdout
    cols = [f for f in TABLE_FIELDS if any(getattr(r, f) is not None for r in records) or f == "candidate"]
    rows = [[_fmt(getattr(r, f)) for f in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)), file=file)
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


def _progress(it, **kw):
    from tqdm.auto import tqdm

    return tqdm(it, file=sys.stderr, leave=False, **kw)


def run_one(semantic_id: str, mode: str, workload: str | None, out: Path | None, run_label: str | None,
            source: dict | None = None, smoke: bool = False, options: dict | None = None) -> int:
    """Run (or, in ``dry_run``, plan) one experiment. With ``out``, every record is saved the moment
    ``ctx.record`` makes it (validated, atomically), so a later failure loses nothing already made."""
    if mode == "real_gpu" and not cuda_available():
        raise UsageError("--mode real_gpu needs CUDA, and this torch reports no CUDA device; use --mode cpu or dry_run")
    handled: list[results.Record] = []  # saved, or refused as invalid (kept alive, so ``is`` identifies them)
    invalid: list[results.RecordError] = []

    def save_now(rec: results.Record) -> None:
        handled.append(rec)
        try:
            path = results.save_record(rec, out)
        except results.RecordError as e:  # the run goes on; reported (exit 2) when it ends
            print(f"bp-mech: not saved: {e}", file=sys.stderr)
            invalid.append(e)
            return
        print(f"saved {path}", file=sys.stderr)

    unknown = sorted(set(options) - set(getattr(registry.get(semantic_id).load(), "OPTIONS", ()))) if options else []
    if unknown:
        raise UsageError(f"{_flags(unknown)} does not apply to {semantic_id}")
    ctx = registry.make_context(semantic_id, mode, workload, run_label, progress=_progress, source=source,
                                options=options,
                                on_record=save_now if out is not None and mode != "dry_run" else None, smoke=smoke)
    if mode == "dry_run":
        print(json.dumps(registry.dry_run(ctx), indent=1, default=str, ensure_ascii=False))
        return 0
    if ctx.workload.source == "pretrained":
        model_commit(ctx.workload)  # resolve the snapshot now: a missing cache is one line, exit 2
    if ctx.options and hasattr(mod := ctx.experiment.load(), "check_options"):
        mod.check_options(ctx)  # a missing text file, a bad saved state: one line, exit 2, before anything runs
    print(f"== {ctx.experiment.semantic_id} ({ctx.experiment.page}) on {ctx.workload.workload_id}, "
          f"mode {mode}", file=sys.stderr)
    recs = registry.run(ctx)
    print_table(recs)
    if out is not None:
        for r in recs:  # records not made through ctx.record (or replaced since); none is saved twice
            if not any(r is h for h in handled):
                save_now(r)
    if invalid:
        raise invalid[0]
    return 0


def _source(a) -> dict | None:
    if a.model_source == "config" and not (a.model_id or a.local_files_only):
        return None
    return dict(source=a.model_source, model_id=a.model_id, revision=a.revision, local_files_only=a.local_files_only)


SUITE_ESTIMATE_MODE = {"gpu": "real_gpu", "cpu": "cpu"}  # whose ``modes.<m>.estimated_seconds`` a suite sums


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def dry_run_suite(suite: str, exps: list, workload: str | None, run_label: str | None, source: dict | None,
                  smoke: bool = False) -> int:
    """Every experiment's dry run and the suite's total estimate, as ONE JSON document
    ``{"dry_runs": [...], "summary": {...}}`` on stdout and a summary line on stderr. An experiment whose
    dry run cannot be made at ``workload`` gets one line and the rest go on (exit 1)."""
    key, label = SUITE_ESTIMATE_MODE[suite], run_label or f"{suite}-default"
    runs, seconds, no_estimate, failed = [], {}, [], []
    for e in exps:
        w = workload or (e.gpu_workload if suite == "gpu" else e.cpu_workload)
        try:
            p = registry.dry_run(registry.make_context(e.semantic_id, "dry_run", w, label, source=source, smoke=smoke))
        except Exception as exc:  # noqa: BLE001 (one line per experiment, then the next)
            print(f"bp-mech: {e.semantic_id}: no dry run at {w}: {_one_line(exc)}", file=sys.stderr)
            failed.append(dict(semantic_id=e.semantic_id, workload=w, error=_one_line(exc)))
            continue
        runs.append(p)
        est = ((p.get("modes") or {}).get(key) or {}).get("estimated_seconds")
        if isinstance(est, (int, float)):
            seconds[e.semantic_id] = est
        else:
            no_estimate.append(e.semantic_id)
    total = round(sum(seconds.values()), 1)
    summary = dict(suite=suite, estimate_mode=key, workload=workload or "each experiment's default", smoke=smoke,
                   estimated_seconds=seconds, total_estimated_seconds=total, no_estimate=no_estimate,
                   no_dry_run=failed)
    print(json.dumps(dict(dry_runs=runs, summary=summary), indent=1, default=str, ensure_ascii=False))
    line = (f"bp-mech: suite {suite} at {summary['workload']}: {len(runs)} dry run(s), estimated {total:.0f} s "
            f"({total / 60:.1f} min) in mode {key}")
    if no_estimate:
        line += f"; no estimate: {', '.join(no_estimate)}"
    if failed:
        line += f"; no dry run: {', '.join(u['semantic_id'] for u in failed)}"
    print(line, file=sys.stderr)
    return 1 if failed else 0


def cmd_run(a) -> int:
    if a.suite:
        return run_suite(a)
    if not a.id:
        raise UsageError("run needs an experiment ID or --suite gpu")
    return run_one(a.id, a.mode or "cpu", a.workload, a.out, a.run_label, _source(a), a.smoke, _options(a))


RUN_OPTIONS = ("domain_text", "holdout_text", "state_dir", "resume_from")  # experiment options (ctx.options)


def _options(a) -> dict:
    return {k: getattr(a, k) for k in RUN_OPTIONS if getattr(a, k, None) is not None}


def _flags(options) -> str:
    """The command-line spelling of option names: ``domain_text`` -> ``--domain-text``."""
    return ", ".join("--" + o.replace("_", "-") for o in options)


def run_suite(a) -> int:
    """Every experiment of the suite in registry order, at ``--workload`` if given (else each one's
    default). A failing experiment prints its full traceback and the next one runs; exit 1 names
    the failed ones."""
    if a.suite not in SUITE_ESTIMATE_MODE:
        raise UsageError(f"unknown suite {a.suite!r}; use 'gpu' or 'cpu'")
    if a.id:
        raise UsageError("give either an experiment ID or --suite, not both")
    if options := _options(a):
        raise UsageError(f"{_flags(options)} applies to one experiment, not a suite")
    mode, source = a.mode or ("real_gpu" if a.suite == "gpu" else "cpu"), _source(a)
    exps = registry.gpu_suite() if a.suite == "gpu" else list(registry.EXPERIMENTS.values())
    if a.workload:
        parse_workload(a.workload, **(source or {}))  # bad text or shape: one line, exit 2, nothing run
    if mode == "dry_run":
        return dry_run_suite(a.suite, exps, a.workload, a.run_label, source, a.smoke)
    if mode == "real_gpu" and not cuda_available():
        raise UsageError("--mode real_gpu needs CUDA, and this torch reports no CUDA device; use --mode cpu or dry_run")
    if exps and source and source["source"] == "pretrained":  # resolve once, before anything runs
        model_commit(parse_workload(a.workload or exps[0].gpu_workload, **source))
    failed = []
    for e in exps:
        w = a.workload or (e.gpu_workload if a.suite == "gpu" else None)
        t0 = time.perf_counter()
        try:
            run_one(e.semantic_id, mode, w, a.out, a.run_label, source, a.smoke)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 (one experiment failing must not stop the suite)
            print(f"bp-mech: {e.semantic_id} failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            failed.append(e.semantic_id)
        release_memory("cuda" if mode == "real_gpu" else "cpu")  # after the except block: the traceback is gone
        print(f"== {e.semantic_id} {'FAILED' if e.semantic_id in failed else 'done'} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if failed:
        print(f"bp-mech: {len(failed)} of {len(exps)} experiment(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cmd_results(a) -> int:
    d = Path(a.dir) if a.dir else RESULTS_DIR
    if not d.exists():
        raise results.RecordError(f"{d}: no such file or directory")
    # validates every file; raises RecordError naming the first bad one
    items = [(d, results.load_record(d))] if d.is_file() else results.load_records(d)
    if a.action == "validate":
        groups: dict[tuple, list] = {}
        for p, r in items:
            groups.setdefault((r.semantic_id, r.run_label, r.workload_id), []).append((p, r))
        for g in groups.values():
            results.check_mergeable(g)
        print(f"{len(items)} record(s) valid in {d}")
        return 0
    for p, r in items:
        stale = provenance.is_stale(r, registry.get(r.semantic_id).module)
        print(f"{p.name}  {r.evidence_level}  {r.workload_id}  {r.candidate}{'  STALE' if stale else ''}")
    return 0


def cmd_check(a) -> int:
    """One line per exercise function and a summary (bp_mech.checks.runner); ``-v``: pytest's full output."""
    from bp_mech.checks import runner as check

    try:
        if a.verbose:
            cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "checks" / "test_exercises.py"), "-m",
                   check.marker(a.chapter), f"--impl={check.solutions_dir(a.dir)}", "-v", "-p", "no:cacheprovider"]
            return subprocess.call(cmd, cwd=ROOT)
        lines = check.check_chapter(a.chapter, a.dir)
    except check.CheckError as e:
        raise UsageError(str(e)) from None
    print(check.format_report(lines))
    return check.exit_code(lines)


def cmd_conformance(a) -> int:
    check_profile(a.profile)
    if not a.all_part02:
        raise UsageError("conformance needs --all-part02")
    rows = []
    for e in registry.EXPERIMENTS.values():
        if hasattr(mod := e.load(), "conformance"):
            rows.append(mod.conformance())
    for r in rows:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.page:<26} {r.semantic_id:<28} vs {r.reference}: {r.detail}")
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if (a.require_passed and (failed or not rows)) else 0


def cmd_preflight(a) -> int:
    report = preflight(a.profile)
    print(json.dumps(report, indent=1))
    return 0 if report["status"] == "ok" else 1


def cmd_plan(a) -> int:
    from bp_mech.planner import report as plan_report

    return plan_report.run(a, progress=_progress)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bp-mech", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run one experiment (all candidates) or the GPU suite")
    r.add_argument("id", nargs="?", help="experiment ID, e.g. TRAIN-LOCAL-BACKWARD")
    r.add_argument("--suite", help="'gpu': every GPU experiment, numeric paths first; 'cpu': every implemented experiment on the CPU")
    r.add_argument("--workload", help="e.g. tiny-b2s64, qwen05-b2s512 (with --suite: every experiment at it)")
    r.add_argument("--smoke", action="store_true",
                   help=f"every code path once with few steps (SMOKE_SCHEDULE {SMOKE_SCHEDULE}): its records check "
                        "that the run works; they are not evidence (give them their own --run-label)")
    r.add_argument("--mode", choices=registry.MODES)
    r.add_argument("--out", type=Path, help="directory to save the records in (each one as soon as it is made)")
    r.add_argument("--run-label", help="run label (a shrunken matrix needs its own)")
    r.add_argument("--model-source", choices=("config", "pretrained"), default="config",
                   help="random init from the config (default) or downloaded weights")
    r.add_argument("--model-id", help="hub id or local directory of a pretrained model")
    r.add_argument("--revision", default="main", help="hub revision, resolved to a commit")
    r.add_argument("--local-files-only", action="store_true", help="pretrained: never touch the network")
    r.add_argument("--domain-text", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: your domain text file (UTF-8)")
    r.add_argument("--holdout-text", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: your holdout (retention) text file")
    r.add_argument("--state-dir", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: keep the saved training states here")
    r.add_argument("--resume-from", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: resume the 'resumed' candidate from this "
                   "saved training state (a step directory, or a --state-dir whose 'latest' names one)")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("results", help="list or validate cached records")
    s.add_argument("action", choices=("list", "validate"))
    s.add_argument("dir", nargs="?", help="default: book/results")
    s.set_defaults(fn=cmd_results)
    c = sub.add_parser("check", help="check your solutions of a chapter's exercises")
    c.add_argument("chapter", help="chapter number, e.g. 09 (or 'amp')")
    c.add_argument("--dir", help="directory holding your exNN_*.py (default: exercises/)")
    c.add_argument("-v", "--verbose", action="store_true", help="pytest's full output instead of one line per function")
    c.set_defaults(fn=cmd_check)
    f = sub.add_parser("conformance", help="framework-conformance rows of Part 02")
    f.add_argument("--all-part02", action="store_true")
    f.add_argument("--profile", default="TRAIN-CPU")
    f.add_argument("--require-passed", action="store_true")
    f.set_defaults(fn=cmd_conformance)
    pl = sub.add_parser("plan", help="which memory strategies fit a budget: a fake-tensor step per strategy")
    pl.add_argument("--config", help="a Hugging Face causal-LM config.json (or its directory)")
    pl.add_argument("--workload", help="or a workload ID, e.g. qwen05-b2s512 (its batch and seq unless given)")
    pl.add_argument("--batch", type=int, help="sequences per step")
    pl.add_argument("--seq", type=int, help="tokens per sequence")
    pl.add_argument("--budget", required=True, help="device memory, e.g. 8GiB, 80GB")
    pl.add_argument("--device-name", help="use cached GPU records of this device only (e.g. H200)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--workers", type=int, help="processes tracing the strategies (default: CPUs, at most 4)")
    pl.set_defaults(fn=cmd_plan)
    q = sub.add_parser("preflight", help="check a profile's environment")
    q.add_argument("--profile", required=True)
    q.set_defaults(fn=cmd_preflight)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
        if getattr(a, "cmd", None) == "preflight":
            check_profile(a.profile)
        return a.fn(a)
    except (UsageError, registry.RegistryError, WorkloadError, results.RecordError, ProfileError, TrainingStateError) as e:
        print(f"bp-mech: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
