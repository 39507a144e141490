"""The memory strategies' decision and records (Part 02 · 19, 42 and project 76), from measured arms.

Decision rule, from ratios against the plain arm of the same invocation:

* reject  if loss or gradients are not finite or differ beyond the strategy's tolerance
          (``bench.compare.tolerance``), or the peak drops by less than MIN_USEFUL_SAVING;
* tune    if the peak drops by less than MIN_PEAK_SAVING (it saves too little, whatever the time);
* none    if the time ratio is noise (``bench.timing.timing_noise``): the time decides nothing;
* accept  if the peak drops by at least MIN_PEAK_SAVING at a median step time of at most MAX_TIME_RATIO x;
* tune    otherwise: it saves memory, but at too high a time cost.

Why each threshold has its value (the bound from checkpointing's counted work, the floors from the ledger's
large-line share and the allocator slack) is stated beside its name in ``bp_mech.book.rules``, whose table
the appendix "How this book measures" shows.
"""

from __future__ import annotations

from bp_mech.bench.compare import tolerance
from bp_mech.bench.strategy import PLAIN, Strategy
from bp_mech.bench.timing import timing_noise
from bp_mech.bench.oom import Failed
from bp_mech.experiments.harness import Measured
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

MIN_PEAK_SAVING = 0.10  # one floor for every memory strategy (accumulation and AMP too): the allocator slack
# bp-mech plan adds to every peak (planner.plan.ALLOCATOR_SLACK); a smaller saving may vanish in the allocator
MAX_TIME_RATIO = 1.50
MIN_USEFUL_SAVING = 0.05
STEP = "zero_grad + forward + backward + AdamW update (moments allocated beforehand)"
PROBE = "the same step without the update, every arm from the same weights"


def decide(equal: bool, peak_saving: float, time_ratio: float, noise: str | None = None) -> Decision:
    """A memory strategy's decision against the plain arm, by the rule above.

    Args:
        equal: loss and gradients finite and within the strategy's tolerance of plain's.
        peak_saving: 1 - peak / plain's peak (allocated bytes).
        time_ratio: median step time / plain's.
        noise: why the time ratio is noise (``bench.timing.timing_noise``), or None.

    Returns:
        The ``Decision``; its reason names the numbers that fired the rule.

    Example:
        >>> decide(True, 0.30, 1.2).verdict, decide(True, 0.30, 1.2, noise="spread").verdict
        ('accept', None)
        >>> decide(True, 0.08, 1.2).reason
        'peak saving 8.0% < MIN_PEAK_SAVING 10%: saves too little'
    """
    saving = f"peak saving {peak_saving:.1%}"
    if not equal:
        return Decision("reject", "loss or gradients differ from the plain run beyond the strategy's tolerance, or "
                        "are not finite", "find the wrong op or race")
    if peak_saving < MIN_USEFUL_SAVING:
        return Decision("reject", f"{saving} < MIN_USEFUL_SAVING {MIN_USEFUL_SAVING:.0%}: the peak barely moves",
                        "the memory is not in the saved activations: pick a strategy that removes the large line")
    if peak_saving < MIN_PEAK_SAVING:
        return Decision("tune", f"{saving} < MIN_PEAK_SAVING {MIN_PEAK_SAVING:.0%}: saves too little",
                        "cover more of the saved activations")
    if noise is not None:
        return Decision(None, f"{saving}, but the time ratio {time_ratio:.2f}x is noise ({noise})",
                        "time it on the target GPU or a quiet machine")
    if time_ratio <= MAX_TIME_RATIO:
        return Decision("accept", f"{saving} >= MIN_PEAK_SAVING {MIN_PEAK_SAVING:.0%} at a median step of "
                        f"{time_ratio:.2f}x plain's (<= MAX_TIME_RATIO {MAX_TIME_RATIO:g}x)")
    return Decision("tune", f"{saving}, but a median step of {time_ratio:.2f}x plain's > MAX_TIME_RATIO "
                    f"{MAX_TIME_RATIO:g}x: saves memory but costs too much time", "recompute or move less")


def work(m: Measured) -> tuple[int, int, int]:
    """Counted work of an arm's step: sublayer recomputes, offload D2H bytes, chunked-loss recomputes."""
    return m.probe.recomputes, m.d2h_bytes, int(m.strategy.chunked_loss is not None)


def more_work(m: Measured, base: Measured) -> bool:
    """Strictly more counted work than ``base``: no less of each kind, more of one. A faster time is then
    noise (``timing_noise``)."""
    a, b = work(m), work(base)
    return all(x >= y for x, y in zip(a, b)) and a != b


def strategy_records(ctx, results: dict[str, Measured | Failed], arms: dict[str, Strategy],
                     baseline: str = PLAIN.name, extra=lambda name, m: ({}, {})) -> list:
    """One record per arm of ``same_weights``' results; ratios and decision against ``baseline``.

    ``extra(name, measured)`` returns (record fields, metrics) that an experiment adds. A record's
    ``strategy`` is the arm's strategy name when the arm is one of the book's strategies (its name is the
    strategy's), else None (an experiment's own arm, such as PyTorch's ``save_on_cpu``). Non-finite
    numbers are stored as null (records are strict JSON); ``all_finite`` says why."""
    base = results.get(baseline)
    base = base if isinstance(base, Measured) else None
    recs = []
    for name, m in results.items():
        s = arms[name]
        strategy = s.name if s.name == name else None
        if isinstance(m, Failed):
            recs.append(ctx.record(name, strategy=strategy, failure=m.failure, memory_source=ctx.memory_source,
                                   next_step="does not fit: see the failure"))
            continue
        fields, metrics = extra(name, m)
        t, p, tol = m.timing, m.probe, tolerance(s, ctx.device)
        metrics = dict(strategy_fields=s.fields(), loss=p.loss, grad_norm=p.grad_norm, forward_calls=p.calls,
                       held_after_forward_bytes=p.held_after_forward, saved_activation_bytes=p.saved_bytes,
                       saved_tensors=p.saved_tensors, step_samples_s=t.samples, wall_samples_s=t.wall_samples,
                       step=STEP, probe=PROBE, tolerances=dict(loss=tol[0], grad=tol[1]), equal=m.equal) | metrics
        cmp = m.comparison
        decided, noise = dict(decision=None, next_step=None), None
        if name != baseline and base is not None and cmp is not None:
            bt = base.timing
            peak_saving = 1 - m.peak.allocated / base.peak.allocated
            ratio = t.median_s / bt.median_s
            noise = timing_noise(t, bt, more_work(m, base))
            decided = decide(m.equal, peak_saving, ratio, noise).record_fields()
            metrics.update(bitwise_equal=cmp.bitwise, grad_norm_error=cmp.grad_norm_error, peak_saving=peak_saving,
                           time_ratio=ratio, p95_ratio=t.p95_s / bt.p95_s, more_work=more_work(m, base))
        fields = dict(decided, **fields)
        recs.append(ctx.record(
            name, strategy=strategy, **m.record_fields(), output_error=json_safe(cmp and cmp.loss_error),
            grad_error=json_safe(cmp and cmp.grad_error), all_finite=p.finite, timing_noise=noise,
            recompute_count=p.recomputes,
            transfer_bytes=dict(d2h=m.d2h_bytes, h2d=m.h2d_bytes) if s.offload else None,
            metrics=json_safe(metrics), **fields))
    return recs
