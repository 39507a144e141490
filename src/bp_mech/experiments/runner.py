"""``bp-mech run``: one experiment, or a suite, with its records saved as they are made.

The command line parses ``bp-mech run`` into a ``RunRequest`` (typed, checked when made); ``run`` takes it.
Bad input (unknown ID, suite or mode, options that do not apply, ``real_gpu`` without CUDA) is a
``UsageError`` (the command line prints one line and exits 2). In a suite, a failing experiment prints its
full traceback and the next one runs; the exit status is then 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bp_mech.bench.oom import release_memory
from bp_mech.instruments.workload import model_commit, parse_workload
from bp_mech.records import registry, results
from bp_mech.records.environment import cuda_available


class UsageError(ValueError):
    """Bad input to a command: one line, exit status 2."""


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


def progress_bar(it, **kw):
    from tqdm.auto import tqdm

    return tqdm(it, file=sys.stderr, leave=False, **kw)


def run_one(semantic_id: str, mode: str, workload: str | None, out: Path | None, run_label: str | None,
            source: dict | None = None, smoke: bool = False, options: dict | None = None) -> int:
    """Run (or, in ``dry_run`` mode, dry-run) one experiment. With ``out``, every record is saved the moment
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
    ctx = registry.make_context(semantic_id, mode, workload, run_label, progress=progress_bar, source=source,
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


SUITE_ESTIMATE_MODE = {"gpu": "real_gpu", "cpu": "cpu"}  # whose ``modes.<m>.estimated_seconds`` a suite sums
RUN_OPTIONS = ("domain_text", "holdout_text", "state_dir", "resume_from")  # experiment options (ctx.options)


@dataclass(frozen=True)
class RunRequest:
    """One ``bp-mech run`` command, checked: one experiment, or a suite.

    Example:
        >>> RunRequest(suite="gpu").mode_or_default, RunRequest(id="TRAIN-OFFLOAD", model_id="me/model").source
        ('real_gpu', {'source': 'config', 'model_id': 'me/model', 'revision': 'main', 'local_files_only': False})
        >>> RunRequest(suite="gpu", domain_text=Path("d.txt"))
        Traceback (most recent call last):
        ...
        bp_mech.experiments.runner.UsageError: --domain-text applies to one experiment, not a suite
    """

    id: str | None = None  # the experiment ID (None: a suite)
    suite: str | None = None  # "gpu" | "cpu": every experiment (SUITE_ESTIMATE_MODE)
    workload: str | None = None  # a workload ID (a suite: every experiment at it); None: each one's default
    mode: str | None = None  # registry.MODES; None: cpu, or real_gpu for the gpu suite
    out: Path | None = None  # where each record is saved as soon as it is made
    run_label: str | None = None  # the records' run label; None: the mode's default
    smoke: bool = False  # every code path once with few steps (not evidence)
    model_source: str = "config"  # "config" (random init) | "pretrained" (downloaded weights)
    model_id: str | None = None  # a hub id or local directory of a pretrained model
    revision: str = "main"  # its hub revision, resolved to a commit
    local_files_only: bool = False  # never touch the network
    domain_text: Path | None = None  # TRAIN-CONTINUAL-PRETRAIN: the domain text
    holdout_text: Path | None = None  # TRAIN-CONTINUAL-PRETRAIN: the holdout text
    state_dir: Path | None = None  # TRAIN-CONTINUAL-PRETRAIN: keep the saved training states here
    resume_from: Path | None = None  # TRAIN-CONTINUAL-PRETRAIN: resume the "resumed" candidate from it

    def __post_init__(self):
        if self.suite is not None:
            if self.suite not in SUITE_ESTIMATE_MODE:
                raise UsageError(f"unknown suite {self.suite!r}; use 'gpu' or 'cpu'")
            if self.id:
                raise UsageError("give either an experiment ID or --suite, not both")
            if self.options:
                raise UsageError(f"{_flags(self.options)} applies to one experiment, not a suite")
        elif not self.id:
            raise UsageError("run needs an experiment ID or --suite gpu")

    @property
    def options(self) -> dict:
        """The experiment options given (``RUN_OPTIONS``: what ``ctx.options`` holds)."""
        return {k: v for k in RUN_OPTIONS if (v := getattr(self, k)) is not None}

    @property
    def source(self) -> dict | None:
        """Where the weights come from (``instruments.workload.parse_workload``'s keywords); None: the
        default, a random init from the config."""
        if self.model_source == "config" and not (self.model_id or self.local_files_only):
            return None
        return dict(source=self.model_source, model_id=self.model_id, revision=self.revision,
                    local_files_only=self.local_files_only)

    @property
    def mode_or_default(self) -> str:
        """``mode``, or the default: ``real_gpu`` for the gpu suite, else ``cpu``."""
        return self.mode or ("real_gpu" if self.suite == "gpu" else "cpu")


def run(r: RunRequest) -> int:
    """``bp-mech run``: the suite (``run_suite``) or the one experiment (``run_one``) of request ``r``.

    Args:
        r: the command's request, checked when it was made.

    Returns:
        The exit status: 0, or 1 when an experiment of a suite failed.

    Raises:
        UsageError: bad input found only now (``real_gpu`` without CUDA, an option the experiment does not
            take), in one line.
    """
    if r.suite:
        return run_suite(r)
    return run_one(r.id, r.mode_or_default, r.workload, r.out, r.run_label, r.source, r.smoke, r.options)


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


def _flags(options) -> str:
    """The command-line spelling of option names: ``domain_text`` -> ``--domain-text``."""
    return ", ".join("--" + o.replace("_", "-") for o in options)


def run_suite(a: RunRequest) -> int:
    """Every experiment of the suite in registry order, at ``--workload`` if given (else each one's
    default). A failing experiment prints its full traceback and the next one runs; exit 1 names
    the failed ones."""
    mode, source = a.mode_or_default, a.source
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
