"""Part 02 · 43 — TRAIN-STATE-LEDGER, the experiment: do the three sources of the ledger agree?

Per strategy, one ledger (lifecycle stage x object class, ``bp_mech.ledger``) from each source:

* ``theoretical``: the formula for the Qwen2 block (``bp_mech.ledger.theoretical``);
* ``track(..., fake=True)``: the step under ``FakeTensorMode``, storages counted by the storage
  tracker (``bp_mech.planner.lifecycle``, ``fake-tensor``);
* ``track(..., fake=False)``: the step run for real, storages tracked (``tracked-cpu``) or, on
  CUDA, the caching allocator's counters beside them (``cuda-allocator``).

The decision (``decide``): is the formula good enough for each strategy, against the measured
and against the estimated ledger? ``conformance`` checks the tracker against PyTorch's
``MemTracker``. The strategies are the book's own (``bench.strategy``: checkpointing of Part 02 · 19, the
offload of Part 02 · 42; the AdamW of ``bench.optimizer.make_optimizer``), and so are their names:
``gpu_references`` puts the GPU records of those chapters beside the formula of the strategy each record names (its
``strategy`` field), or says why the formula has none (``ledger.unmodelled``).
"""

from __future__ import annotations

import torch

from bp_mech import ledger
from bp_mech.planner import lifecycle
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.ledger_table import CLASSES, STAGES, Ledger
from bp_mech.records.decision import Decision

CANDIDATES = ("plain", "checkpoint-all", "offload", "fp16", "micro2")  # the strategies the formula models

# Decision rule: the formula is accepted for a strategy when, against the measured (or the estimated)
# ledger, every stage total (and the peak) agrees within STAGE_TOL and every large line within
# CLASS_TOL; otherwise "tune", with the worst stage or line named in next_step.
STAGE_TOL = 0.05  # relative error of each stage total and of the peak
CLASS_TOL = 0.03  # relative error of each large line
LARGE_CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss")
LARGE_SHARE = 0.05  # a line is large at a stage when it holds at least 5 % of that stage's total (either side)
CONFORMANCE_TOL = 1e-3  # the tracker against MemTracker: relative difference of each snapshot


def stage_errors(led: Ledger, reference: Ledger) -> dict[str, float]:
    """Relative error of ``led`` against ``reference``, per stage and for the peak."""
    out = {s: led.total(s) / reference.total(s) - 1 for s in STAGES}
    out["peak"] = led.peak / reference.peak - 1
    return out


def class_errors(led: Ledger, reference: Ledger) -> dict[str, float]:
    """Relative error of ``led`` against ``reference`` per large line, keyed ``"stage/class"``: the
    classes of ``LARGE_CLASSES`` at the stages where the line holds at least ``LARGE_SHARE`` of the
    stage's total in either ledger (a line the reference lacks is an infinite error)."""
    out = {}
    for s in STAGES:
        for c in LARGE_CLASSES:
            got, ref = led.stages[s][c], reference.stages[s][c]
            if max(got / led.total(s), ref / reference.total(s)) >= LARGE_SHARE:
                out[f"{s}/{c}"] = got / ref - 1 if ref else float("inf")
    return out


def peak_shares(led: Ledger) -> tuple[str, dict[str, float]]:
    """The ledger stage that holds the most bytes, and each line's share of that stage.

    Example:
        >>> rows = {s: {"parameters": 1, "saved_activations": 3 if s == "forward" else 0} for s in STAGES}
        >>> peak_shares(Ledger("formula", "plain", rows))
        ('forward', {'parameters': 0.25, 'saved_activations': 0.75})
    """
    stage = max(STAGES, key=led.total)
    return stage, {c: b / led.total(stage) for c, b in led.stages[stage].items()}


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    k = max(errors, key=lambda k: abs(errors[k]))
    return k, errors[k]


def formula_errors(formula: Ledger, led: Ledger) -> dict:
    """The formula's errors against ``led``, as a record's metrics keep them.

    Args:
        formula: the formula's ledger of a strategy.
        led: the measured or estimated ledger of the same strategy.

    Returns:
        ``formula_error`` (per stage and the peak, ``stage_errors``), ``formula_class_error`` (per large line,
        ``class_errors``), and the worst of each: ``worst_stage``, ``worst_line``.

    Example:
        >>> rows = lambda a: {s: dict.fromkeys(LARGE_CLASSES, 100) | {"saved_activations": a} for s in STAGES}
        >>> e = formula_errors(Ledger("formula", "plain", rows(90)), Ledger("tracked-cpu", "plain", rows(100)))
        >>> e["worst_line"]
        'load/saved_activations'
    """
    stage, line = stage_errors(formula, led), class_errors(formula, led)
    return dict(formula_error=stage, formula_class_error=line, worst_stage=_worst(stage)[0], worst_line=_worst(line)[0])


def decide(formula: Ledger, led: Ledger) -> Decision:
    """Does the formula hold against ``led`` (measured or estimated)? By the rule above.

    Args:
        formula: the formula's ledger of a strategy (``formula``).
        led: the measured or estimated ledger of the same strategy.

    Returns:
        The ``Decision``; its reason names the worst stage and the worst large line with their errors.

    Example:
        >>> rows = lambda a: {s: dict.fromkeys(LARGE_CLASSES, 100) | {"saved_activations": a} for s in STAGES}
        >>> d = decide(Ledger("formula", "plain", rows(90)), Ledger("tracked-cpu", "plain", rows(100)))
        >>> d.verdict, d.reason
        ('tune', 'line load/saved_activations is off by -10.0% (CLASS_TOL 3%)')
    """
    (ws, es), (wl, el) = _worst(stage_errors(formula, led)), _worst(class_errors(formula, led))
    if abs(es) <= STAGE_TOL and abs(el) <= CLASS_TOL:
        return Decision("accept", f"worst stage {ws} {es:+.1%} (STAGE_TOL {STAGE_TOL:.0%}), worst line {wl} {el:+.1%} "
                        f"(CLASS_TOL {CLASS_TOL:.0%})")
    off = [(what, f"{kind} {what} is off by {e:+.1%} ({name} {tol:.0%})") for kind, what, e, name, tol in (
        ("stage", ws, es, "STAGE_TOL", STAGE_TOL), ("line", wl, el, "CLASS_TOL", CLASS_TOL)) if abs(e) > tol]
    return Decision("tune", "; ".join(why for _, why in off),
                    f"find what the formula misses at {' and '.join(what for what, _ in off)}")


def _metrics(led: Ledger) -> dict:
    return dict(source=led.source, stages=led.stages, totals=led.totals(), forward_peak=led.forward_peak,
                host=led.host, rounded_512=led.rounded, allocator=led.allocator, moment=led.moment)


def formula(arch, batch: int, seq: int, s, device, options: StepOptions = StepOptions()) -> Ledger:
    """``ledger.theoretical`` of strategy ``s`` with ``options`` (AdamW, offload threshold) resolved for
    ``device``: the formula of the step ``planner.lifecycle`` measures with the same options."""
    o = options.for_device(device)
    return ledger.theoretical(arch, batch, seq, s, device, adamw=o.adamw, offload_min_bytes=o.offload_min_bytes)


def run(ctx) -> list:
    """Per strategy: the measured ledger (CPU tracker or CUDA allocator), the fake-tensor estimate
    and the formula, each its own record (candidates ``<strategy>``, ``<strategy>-estimated`` and
    ``<strategy>-formula``, each with the strategy's name in ``strategy``); decision: does the formula
    hold (``decide``)?

    ``updates`` counts the optimizer steps that applied an update for a measurement (the warm-up ones
    included; ``skipped_updates``: those the GradScaler skipped, fp16 only). ``--mode real_gpu`` (not in
    the GPU suite) measures on CUDA: the record's peaks are the allocator's, per phase; the estimate
    stays on the CPU with the GPU's settings (fused AdamW, CUDA's offload threshold); a strategy that
    runs out of memory is that strategy's failure."""
    from bp_mech.bench.oom import Failed, attempt, release_memory
    from bp_mech.instruments.workload import ARCHITECTURES

    w, recs, gpu = ctx.workload, [], ctx.device == "cuda"
    options = StepOptions().for_device(ctx.device)
    for name in ctx.progress(CANDIDATES, desc="strategies"):
        s = parse(name)
        if w.batch % s.micro_batches:
            why = f"batch {w.batch} is not divisible into {s.micro_batches} micro-batches"
            recs.append(ctx.record(name, strategy=name, failure=why, next_step="pick a batch the micro-batches divide"))
            continue
        f = formula(ARCHITECTURES[w.arch], w.batch, w.seq, s, ctx.device)
        est = lifecycle.track(w, s, fake=True, options=options)  # on the CPU, with the settings of ctx.device
        release_memory(ctx.device)  # the last strategy's model and cached blocks out: these peaks are this one's own
        meas = attempt(lifecycle.track, w, s, ctx.device, options=options)
        if isinstance(meas, Failed):
            recs.append(ctx.record(name, strategy=name, failure=meas.failure, memory_source=ctx.memory_source,
                                   next_step="does not fit: see the failure"))
        else:
            al = meas.allocator
            decided, m = decide(f, meas), formula_errors(f, meas)
            recs.append(ctx.record(
                name, strategy=name, all_finite=meas.finite, updates=meas.updates - (meas.skipped or 0),
                skipped_updates=meas.skipped, memory_source=ctx.memory_source,
                peak_allocated=max(v for k, v in al.items() if k.endswith("_peak")) if gpu else meas.peak,
                peak_reserved=max(v for k, v in al.items() if k.endswith("_reserved")) if gpu else None,
                **decided.record_fields(), metrics=dict(_metrics(meas), **m)))
        decided, m = decide(f, est), formula_errors(f, est)
        recs.append(ctx.record(f"{name}-estimated", strategy=name, evidence_level="estimated",
                               memory_source="fake-tensor", updates=est.updates, peak_allocated=est.peak,
                               **decided.record_fields(), metrics=dict(_metrics(est), **m)))
        recs.append(ctx.record(f"{name}-formula", strategy=name, evidence_level="theoretical", memory_source="formula",
                               peak_allocated=f.peak, metrics=_metrics(f)))
    return recs


def dry_run(ctx) -> dict:
    """What is measured where, and the formula's peak per strategy (no model)."""
    from bp_mech.instruments.workload import ARCHITECTURES

    w = ctx.workload
    peaks = {dev: {n: formula(ARCHITECTURES[w.arch], w.batch, w.seq, parse(n), dev).peak for n in CANDIDATES}
             for dev in ("cpu", "cuda")}
    return dict(sources=["measured (" + ctx.memory_source + ")", "estimated (fake-tensor)", "theoretical (formula)"],
                stages=list(STAGES), classes=list(CLASSES), stage_tolerance=STAGE_TOL,
                class_tolerance=CLASS_TOL, large_classes=list(LARGE_CLASSES), large_share=LARGE_SHARE,
                mechanisms=dict(checkpoint="checkpointing.configure(model, 'checkpoint-all')",
                                offload="offload.ActivationOffload(min_bytes=offload.min_bytes(device))",
                                adamw="bench.optimizer.make_optimizer (StepOptions.for_device: fused on CUDA, foreach on the CPU)"),
                steps_per_strategy="1 warm-up update (retried while the GradScaler skips it) + 1 measured update",
                formula_peak_bytes_cpu=peaks["cpu"], formula_peak_bytes_cuda=peaks["cuda"],
                records_per_strategy=["<strategy>", "<strategy>-estimated", "<strategy>-formula"])


def conformance():
    """The tracker against PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` on the
    same steady-state plain step of tiny-b2s64: the model's forward peak, its state when backward
    starts (our "after forward"), its backward peak and its state after backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from bp_mech.bench.step import train_step
    from bp_mech.bench.optimizer import make_optimizer
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload
    from bp_mech.records.registry import ConformanceRow

    w = parse_workload("tiny-b2s64")
    led = lifecycle.track(w)
    model, batch = build_model(w), make_batches(w, 1)[0]
    opt = make_optimizer(model.parameters(), StepOptions(), "cpu")
    train_step(model, opt, batch)  # warm-up, as in track()
    mt = MemTracker()
    mt.track_external(model, opt, *batch.values())  # the batch exists before the step, as in track()
    with mt:
        train_step(model, opt, batch)
    snap = {k: v[-1][torch.device("cpu")]["Total"] for k, v in mt.memory_tracking[model].snapshots.items()}
    pairs = {"forward_peak": (led.forward_peak, snap[_ModState.PEAK_FW]),
             "forward": (led.total("forward"), snap[_ModState.PRE_BW]),
             "backward_peak": (led.total("backward_peak"), snap[_ModState.PEAK_BW]),
             "backward": (led.total("backward"), snap[_ModState.POST_BW])}
    errs = {k: a / b - 1 for k, (a, b) in pairs.items()}
    worst = max(errs, key=lambda k: abs(errs[k]))
    return ConformanceRow("Part 02 · 43", "TRAIN-STATE-LEDGER", "torch MemTracker (module snapshots, plain step)",
                          abs(errs[worst]) <= CONFORMANCE_TOL, f"max rel. difference {errs[worst]:+.1e} at {worst} "
                          f"({pairs[worst][0]} B vs {pairs[worst][1]} B) over 4 snapshots (tol {CONFORMANCE_TOL:g})")


# --- the GPU records of the chapters that own the strategies ------------------------------

# Their GPU runs measure the full step (forward, backward, AdamW update with its moments allocated by a
# warm-up update, zero_grad), as the ledger does, so the formula's peak and the record's
# ``peak_allocated`` both hold parameters, gradients and AdamW's moments.
GPU_EXPERIMENTS = ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION",
                   "TRAIN-MEMORY-STRATEGY")


def gpu_references(results_dir=None) -> list[dict]:
    """The cached GPU records of 11, 19, 42, AMP and 76 beside the formula, one row per record.

    A record names its strategy (``Record.strategy``): the formula's peak at the record's effective batch
    and sequence, on CUDA, against its ``peak_allocated``; or the reason the formula has none
    (``ledger.unmodelled``, or an arm that is not one of the book's strategies). Raises ``ValueError``
    naming the record when it ran no optimizer update (its peak would lack the AdamW state the formula
    counts)."""
    from bp_mech import RESULTS_DIR
    from bp_mech.instruments.workload import ARCHITECTURES, parse_workload
    from bp_mech.records.cache import cached

    results_dir = RESULTS_DIR if results_dir is None else results_dir
    rows = []
    for sid in GPU_EXPERIMENTS:
        cache = cached(sid, results_dir)
        for label, recs in cache.gpu().items():
            for r in (r for r in recs if r.evidence_level == "gpu-measured"):
                name = f"{sid} record {r.filename} (run label {label}, candidate {r.candidate!r})"
                s = parse(r.strategy) if r.strategy else None
                row = dict(experiment=sid, run_label=label, candidate=r.candidate, strategy=r.strategy,
                           workload=r.workload_id, stale=label in cache.stale, ledger=None,
                           peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved, formula_peak=None,
                           formula_error=None, formula_peak_stage=None, formula_optimizer_states=None, note=None)
                why = "not one of the book's strategies" if s is None else ledger.unmodelled(s)
                if why:
                    rows.append(dict(row, note=f"no formula: {why}"))
                    continue
                if not r.updates:
                    raise ValueError(f"{name}: updates={r.updates!r}, so its step ran no AdamW update and its peak "
                                     "has no optimizer state, which the formula counts; rerun it with a full step")
                w = parse_workload(r.workload_id)
                batch, seq = r.effective_batch or w.batch, (r.input_shape or [None, w.seq])[1]
                f = formula(ARCHITECTURES[w.arch], batch, seq, s, "cuda")
                at = f.peak_stage if f.peak_stage in f.stages else "forward"  # (a peak inside the forward)
                row.update(ledger=f"{s.name}, {StepOptions().for_device('cuda').adamw} AdamW", formula_peak=f.peak,
                           formula_peak_stage=f.peak_stage, formula_optimizer_states=f.stages[at]["optimizer_states"],
                           formula_error=f.peak / r.peak_allocated - 1 if r.peak_allocated else None, note=r.failure)
                rows.append(row)
    return rows
