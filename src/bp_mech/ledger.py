"""Part 02 · 43 — TRAIN-STATE-LEDGER: where a training step's memory goes, stage by stage.

The experiment fills one ledger (lifecycle stage x object class, ``bp_mech.ledger_formula``)
per strategy from three independent sources and asks whether they agree:

* ``theoretical``: the formula for the Qwen2 block (``bp_mech.ledger_formula``);
* ``track(..., fake=True)``: the step under ``FakeTensorMode``, storages counted by the
  tracker of ``bp_mech.ledger_tracker`` (``fake-tensor``);
* ``track(..., fake=False)``: the step run for real, storages tracked (``tracked-cpu``) or,
  on CUDA, the caching allocator's counters beside them (``cuda-allocator``).

The chapter's names are re-exported here (``__all__``), so ``from bp_mech import ledger as L``
reaches them all.
"""

from __future__ import annotations

import torch

from bp_mech.ledger_formula import (
    CLASS_LABELS, CLASSES, STAGE_LABELS, STAGES, STRATEGIES, Ledger, LedgerConfig, adam_state_bytes,
    attention_probs_bytes, block_saved_bytes, gpt_activation_bytes, grad_bytes, param_bytes, theoretical)
from bp_mech.ledger_tracker import _Tracker, track, train_step

__all__ = ["CANDIDATES", "CLASSES", "CLASS_LABELS", "STAGES", "STAGE_LABELS", "TOL", "Ledger", "LedgerConfig",
           "adam_state_bytes", "attention_probs_bytes", "block_saved_bytes", "conformance", "gpt_activation_bytes",
           "gpu_references", "grad_bytes", "param_bytes", "plan", "run", "stage_errors", "theoretical", "track",
           "train_step"]  # the chapter's names, from this module and its two parts

CANDIDATES = STRATEGIES
CODE_MODULES = ("bp_mech.ledger_formula", "bp_mech.ledger_tracker")  # hashed into code_hash with this one
TOL = 0.05  # the formula must agree with the measured and the estimated ledger within 5 % per stage


def stage_errors(ledger: Ledger, reference: Ledger) -> dict[str, float]:
    """Relative error of ``ledger`` against ``reference``, per stage and for the peak."""
    out = {s: ledger.total(s) / reference.total(s) - 1 for s in STAGES}
    out["peak"] = ledger.peak / reference.peak - 1
    return out


def _metrics(led: Ledger, formula: Ledger | None = None) -> dict:
    m = dict(source=led.source, stages=led.stages, totals=led.totals(), forward_peak=led.forward_peak,
             host=led.host, rounded_512=led.rounded, allocator=led.allocator)
    if formula is not None:
        m["formula_error"] = stage_errors(formula, led)
    return m


def _decision(errors: dict) -> str:
    return "accept" if max(abs(v) for v in errors.values()) <= TOL else "tune"


def run(ctx) -> list:
    """Per strategy: the measured ledger (CPU tracker or CUDA allocator), the fake-tensor estimate
    and the formula, each its own record; decision: does the formula hold within ``TOL``?

    ``--mode real_gpu`` (not in the GPU suite) measures on CUDA: the record's peaks are the
    allocator's, per phase; the estimate stays on the CPU with AdamW's CUDA default (foreach);
    a strategy that runs out of memory is that strategy's failure."""
    from bp_mech.measure import free, guarded
    from bp_mech.workload import ARCHITECTURES

    w, recs, gpu = ctx.workload, [], ctx.device == "cuda"
    for s in ctx.progress(CANDIDATES, desc="strategies"):
        cfg = LedgerConfig(strategy=s)
        if s == "accumulation" and w.batch % cfg.micro_batches:
            why = f"batch {w.batch} is not divisible into {cfg.micro_batches} micro-batches"
            recs.append(ctx.record(s, failure=why))
            continue
        formula = theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, cfg, ctx.device)
        est = track(w, LedgerConfig(strategy=s, foreach=True if gpu else None), fake=True)  # CPU kernels
        free(ctx.device)  # the last strategy's model and cached blocks out: these peaks are this one's own
        meas, failure = guarded(track, w, cfg, ctx.device)
        if meas is None:
            recs.append(ctx.record(s, failure=failure, memory_source=ctx.memory_source))
        else:
            al = meas.allocator
            err = stage_errors(formula, meas)
            recs.append(ctx.record(
                s, all_finite=meas.finite, update_count=meas.updates - (meas.skipped or 0),
                skipped_updates=meas.skipped, memory_source=ctx.memory_source,
                peak_allocated=max(v for k, v in al.items() if k.endswith("_peak")) if gpu else meas.peak,
                peak_reserved=max(v for k, v in al.items() if k.endswith("_reserved")) if gpu else None,
                decision=_decision(err), next_step=None if _decision(err) == "accept" else
                "find the ledger line the formula misses (largest stage error in metrics.formula_error)",
                metrics=_metrics(meas, formula)))
        err = stage_errors(formula, est)
        recs.append(ctx.record(f"{s}-estimated", evidence_level="estimated", memory_source="fake-tensor",
                               peak_allocated=est.peak, decision=_decision(err), metrics=_metrics(est, formula)))
        recs.append(ctx.record(f"{s}-formula", evidence_level="theoretical", memory_source="formula",
                               peak_allocated=formula.peak, metrics=_metrics(formula)))
    return recs


def plan(ctx) -> dict:
    """The dry-run plan: what is measured where, and the formula's peak per strategy (no model)."""
    from bp_mech.workload import ARCHITECTURES

    w = ctx.workload
    peaks = {dev: {s: theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, LedgerConfig(strategy=s), dev).peak
                   for s in CANDIDATES} for dev in ("cpu", "cuda")}
    return dict(sources=["measured (" + ctx.memory_source + ")", "estimated (fake-tensor)", "theoretical (formula)"],
                stages=list(STAGES), classes=list(CLASSES), tolerance=TOL,
                steps_per_strategy="1 warm-up update (retried while the GradScaler skips it) + 1 measured update",
                formula_peak_bytes_cpu=peaks["cpu"], formula_peak_bytes_cuda=peaks["cuda"],
                records_per_strategy=["<strategy>", "<strategy>-estimated", "<strategy>-formula"])


def conformance():
    """The tracker against PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` on the
    same steady-state plain step of tiny-b2s64: the model's forward peak, its state when backward
    starts (our "after forward"), its backward peak and its state after backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b2s64")
    led = track(w)
    model, batch = build_model(w), make_batches(w, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, batch, LedgerConfig(), _Tracker("cpu"))  # warm-up, as in track()
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        train_step(model, opt, batch, LedgerConfig(), _Tracker("cpu"))
    snap = {k: v[-1][torch.device("cpu")]["Total"] for k, v in mt.memory_tracking[model].snapshots.items()}
    pairs = {"forward_peak": (led.forward_peak, snap[_ModState.PEAK_FW]),
             "forward": (led.total("forward"), snap[_ModState.PRE_BW]),
             "backward_peak": (led.total("backward_peak"), snap[_ModState.PEAK_BW]),
             "backward": (led.total("backward"), snap[_ModState.POST_BW])}
    errs = {k: a / b - 1 for k, (a, b) in pairs.items()}
    worst = max(errs, key=lambda k: abs(errs[k]))
    return ConformanceRow("Part 02 · 43", "TRAIN-STATE-LEDGER", "torch MemTracker (module snapshots, plain step)",
                          abs(errs[worst]) <= 1e-3, f"max rel. difference {errs[worst]:+.1e} at {worst} "
                          f"({pairs[worst][0]} B vs {pairs[worst][1]} B) over 4 snapshots (tol 1e-3)")


def gpu_references() -> list[dict]:
    """Cached GPU records of 19, 42 and 76 beside the formula for the same workload and strategy."""
    from bp_mech import report
    from bp_mech.workload import ARCHITECTURES, parse_workload

    rows = []
    for sid in ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-MEMORY-STRATEGY"):
        for label, recs in report.cached(sid).gpu().items():
            for r in recs:
                w = parse_workload(r.workload_id)
                f = theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, LedgerConfig(strategy=r.candidate), "cuda") \
                    if r.candidate in CANDIDATES and r.peak_allocated else None
                rows.append(dict(experiment=sid, run_label=label, candidate=r.candidate, workload=r.workload_id,
                                 peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved,
                                 formula_peak=f.peak if f else None,
                                 formula_error=f.peak / r.peak_allocated - 1 if f else None))
    return rows
