"""What the memory-strategy experiments share beyond the harness (Part 02 · 19 and 42, and the
projects that combine strategies): the decision rule and the records.

* ``decide``: accept / tune / reject, or no decision when the time ratio is noise, from the peak saving
  and the time ratio against the plain run of the same invocation;
* ``more_work``: does a candidate do strictly more work (counted recomputes or transfers)? A faster
  time then is noise (``measure.timing_noise``);
* ``make_records``: one record per candidate from ``harness.measure_candidates``' results.
"""

from __future__ import annotations

import torch

from bp_mech.experiments.harness import EQUAL_TOL, compare
from bp_mech.bench.timing import timing_noise
from bp_mech.records.results import json_safe

# Decision rule, from ratios against the plain (resident) run of the same invocation:
#   reject  if loss or gradients are not finite or differ beyond EQUAL_TOL, or the peak drops by less than MIN_USEFUL_SAVING;
#   tune    if the peak drops by less than MIN_PEAK_SAVING (it saves too little, whatever the time);
#   none    if the time ratio is noise (``measure.timing_noise``): the time decides nothing, the chapter says so;
#   accept  if the peak drops by at least MIN_PEAK_SAVING at a median step time of at most MAX_TIME_RATIO x;
#   tune    otherwise: it saves memory, but at too high a time cost.
MIN_PEAK_SAVING = 0.20
MAX_TIME_RATIO = 1.50
MIN_USEFUL_SAVING = 0.05


def decide(equal: bool, peak_saving: float, time_ratio: float, noise: str | None = None) -> tuple[str | None, str | None]:
    """(decision, next step) by the rule above."""
    if not equal:
        return "reject", "loss or gradients differ from the plain run (or are not finite): find the wrong op or race"
    if peak_saving < MIN_USEFUL_SAVING:
        return "reject", "the peak barely moves: the memory is not in the saved activations"
    if peak_saving < MIN_PEAK_SAVING:
        return "tune", "saves too little: cover more of the saved activations"
    if noise is not None:
        return None, f"the time ratio is noise ({noise}): time it on the target GPU or a quiet machine"
    if time_ratio <= MAX_TIME_RATIO:
        return "accept", None
    return "tune", "saves memory but costs too much time: recompute or move less"


def more_work(r: dict, base: dict) -> bool:
    """Does the candidate do strictly more work than the baseline: counted recomputes or transfers?"""
    return r["recomputes"] > base["recomputes"] or r.get("hooks", {}).get("d2h", 0) > 0


def make_records(ctx, results: dict, baseline: str, experiment_fields=lambda name, r: ({}, {})) -> list:
    """One record per candidate from ``{name: (measurement, failure)}``; ratios against ``baseline``.

    ``experiment_fields(name, r)`` returns (record fields, metrics) that an experiment adds. Non-finite
    numbers are stored as null (records are strict JSON); ``all_finite`` says why.
    """
    base = results[baseline][0]
    tol = EQUAL_TOL[torch.device(ctx.device).type]
    recs = []
    for name, (r, failure) in results.items():
        if failure is not None:
            recs.append(ctx.record(name, failure=failure, memory_source=ctx.memory_source,
                                   next_step="does not fit: see the failure"))
            continue
        t = r["timing"]
        fields, metrics = experiment_fields(name, r)
        metrics = dict(loss=r["loss"], grad_norm=r["grad_norm"], forward_calls=r["calls"],
                       held_after_forward_bytes=r["held_after_forward"], step_samples_s=t.samples,
                       step="zero_grad + forward + backward + AdamW update (moments allocated beforehand)",
                       probe="the same step without the update, every candidate from the same weights",
                       tolerances=dict(loss=tol[0], grad=tol[1]), **metrics)
        for k in ("saved_activation_bytes", "saved_tensors"):
            if k in r:
                metrics[k] = r[k]
        cmp = decision = next_step = noise = None
        if name != baseline and base is not None:
            cmp = compare(base, r)
            equal = r["finite"] and base["finite"] and cmp["loss_error"] <= tol[0] and cmp["grad_error"] <= tol[1]
            bt = base["timing"]
            peak_saving = 1 - r["peak_allocated"] / base["peak_allocated"]
            ratio = t.median_s / bt.median_s
            noise = timing_noise(t, bt, more_work(r, base))
            decision, next_step = decide(equal, peak_saving, ratio, noise)
            metrics.update(equal=equal, bitwise_equal=cmp["bitwise"], grad_norm_error=cmp["grad_norm_error"],
                           peak_saving=peak_saving, time_ratio=ratio, p95_ratio=t.p95_s / bt.p95_s,
                           more_work=more_work(r, base))
        recs.append(ctx.record(
            name, output_error=json_safe(cmp and cmp["loss_error"]), grad_error=json_safe(cmp and cmp["grad_error"]),
            all_finite=r["finite"], peak_allocated=r["peak_allocated"], peak_reserved=r["peak_reserved"],
            step_median_s=t.median_s, step_p95_s=t.p95_s, warmup_excluded=t.warmup_excluded, threads=t.threads,
            timing_noise=noise, updates=r["updates"], skipped_updates=0, recompute_count=r["recomputes"],
            memory_source=r["memory_source"], decision=decision, next_step=next_step, metrics=json_safe(metrics),
            **fields))
    return recs
