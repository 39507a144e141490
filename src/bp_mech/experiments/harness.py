"""The shared experiment harness: what every experiment of the book measures the same way.

* ``train_step``: the measured step, a full training step (``zero_grad``, forward, backward, AdamW
  update); ``probe``: the same step without the update, for the equality check; ``compare``: loss and
  gradient errors against a baseline, NaN never equal;
* ``measure_candidates``: the candidates of a memory strategy on one shared model and optimizer
  (warm-up, interleaved timing on one CPU thread, a peak step each, probes from the same weights);
* ``decide``: the accept / tune / reject / no-decision rule from the peak saving and the time ratio;
* ``make_records``: one record per candidate, ratios against the baseline, the noise verdict;
* ``schedule`` / ``estimate_seconds`` / ``plan_modes``: the steps and the planning estimate of
  ``--mode dry_run``.

The strategies come in as ``Candidate(setup, saving)``: a configuration context (checkpointing) and
saved-tensor hooks (offload); this module imports no strategy.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from bp_mech.counters import ForwardCounter, SavedBytesCounter
from bp_mech.measure import CPU_TIMING_THREADS, SMOKE_SCHEDULE, PeakMemory, release_memory, oom_as_failure, time_interleaved, timing_noise
from bp_mech.results import json_safe
from bp_mech.update_dynamics import global_grad_norm
from bp_mech.workload import PLAN_BUILD_S, make_adamw, param_count, plan_seconds

# --- one step, equality -----------------------------------------------------------------

LR = 1e-4  # AdamW learning rate of the measured steps (memory and time do not depend on it)


def train_step(model, batch, saving=None, opt=None) -> torch.Tensor:
    """One training step: ``zero_grad``, forward (under ``saving``: saved-tensor hooks, or none),
    backward, and the optimizer update when ``opt`` is given (the measured step always has one)."""
    model.zero_grad(set_to_none=True)
    with saving if saving is not None else contextlib.nullcontext():
        loss = model(**batch).loss
    loss.backward()
    if opt is not None:
        opt.step()
    return loss.detach()


def probe(model, batch, device, saving=None) -> dict:
    """One step on ``batch`` without the update, for what the timed steps do not show.

    No update: every candidate's probe starts from the same weights, so its loss and every
    gradient can be compared with the baseline's exactly. Returns the loss, the gradients (a copy on
    the device: a host copy of qwen05's costs seconds), their total norm and finiteness (both computed on the device, in float64),
    forward calls per layer, recomputes, and ``held_after_forward``: live bytes (allocator on CUDA,
    tracked storages on the CPU) added between the start and the end of forward, i.e. what waits
    for backward.
    """
    model.zero_grad(set_to_none=True)
    with ForwardCounter(model) as fc, PeakMemory(device, resident=[model.parameters()]) as pm:
        pm.mark("start")
        with saving if saving is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        pm.mark("after_forward")
        loss.backward()
    gs = [p.grad for p in model.parameters()]
    norm = global_grad_norm(gs, dtype=torch.float64).item()
    grads = [None if g is None else g.detach().clone() for g in gs]
    model.zero_grad(set_to_none=True)
    return dict(loss=loss.item(), grads=grads, grad_norm=norm, calls=fc.calls, recomputes=fc.recomputes,
                held_after_forward=pm.marks["after_forward"] - pm.marks["start"],
                finite=math.isfinite(loss.item()) and math.isfinite(norm))  # a NaN/inf anywhere makes the norm one


def compare(ref: dict, got: dict) -> dict:
    """Loss error (relative), gradient error (max over parameters of max|diff| / max|ref|), bitwise.

    A non-finite difference (a NaN or inf gradient, e.g. from a copy read before it finished) is an
    infinite error: it must never pass a tolerance (``max(0.0, nan)`` is 0.0 in Python).
    """
    finite = lambda x: x if math.isfinite(x) else math.inf  # noqa: E731
    loss_err = finite(abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30))
    bitwise, grad_err = loss_err == 0.0, 0.0
    for a, b in zip(got["grads"], ref["grads"]):
        if a is None or b is None:
            grad_err, bitwise = (grad_err, bitwise) if a is b else (math.inf, False)
            continue
        d = (a - b).abs().max().item()
        bitwise = bitwise and d == 0.0
        grad_err = max(grad_err, finite(d / (b.abs().max().item() or 1.0)))
    return dict(loss_error=loss_err, grad_error=grad_err, bitwise=bitwise,
                grad_norm_error=finite(abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)))


# Equality with the plain run: (loss, gradient) relative tolerances by device type.
EQUAL_TOL = {"cpu": (0.0, 0.0),  # CPU kernels are deterministic here: bitwise equality is required
       "cuda": (1e-6, 1e-4)}  # fp32 CUDA: a recompute may pick other kernels, backward may reassociate

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


# --- measuring the candidates, planning ------------------------------------------------

PROBE_BYTES_S = 50e9  # planning: gradient bytes per second the probe copies and compares on the device


def schedule(device, smoke: bool = False) -> tuple[int, int]:
    """(timed rounds, warm-up rounds) of the interleaved timing: every candidate runs once per round.
    CUDA: at least 20 timed steps; CPU: 60 (a tiny step takes ~10 ms on one thread); a smoke run:
    ``measure.SMOKE_SCHEDULE``."""
    if smoke:
        return SMOKE_SCHEDULE
    return (20, 3) if torch.device(device).type == "cuda" else (60, 3)


def estimate_seconds(w, factors, device, smoke: bool = False) -> float:
    """Planning estimate (``bp_mech.workload.plan_seconds``): per candidate, its warm-up and timed steps,
    the probe and the peak step at ``factor`` x a plain pass, plus the probe's gradient copy; one model
    build and the warm-up update that allocates AdamW's moments."""
    dev = torch.device(device).type
    passes, probe_s = sum(schedule(dev, smoke)) + 2, param_count(w.arch) * 4 / PROBE_BYTES_S
    return round(PLAN_BUILD_S[dev] + plan_seconds(w.arch, w.batch * w.seq, 1, dev)
                 + sum(plan_seconds(w.arch, w.batch * w.seq, f * passes, dev) + probe_s for f in factors), 1)


def plan_modes(w, factors, smoke: bool = False, **per_device) -> dict:
    """Steps and estimated seconds of ``--mode cpu`` and ``--mode real_gpu`` for workload ``w``."""
    out = {}
    for mode, dev in (("cpu", "cpu"), ("real_gpu", "cuda")):
        rounds, warmup = schedule(dev, smoke)
        out[mode] = dict(timed_rounds=rounds, warmup_rounds=warmup, interleaved=True,
                         threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                         estimated_seconds=estimate_seconds(w, factors, dev, smoke),
                         **{k: v(dev) for k, v in per_device.items()})
    return out


@dataclass
class Candidate:
    """One arm of a memory-strategy comparison, as the harness runs it."""

    setup: Callable = contextlib.nullcontext  # model configuration (checkpointing), entered around each step
    saving: object | None = None  # saved-tensor hooks (offload) for every forward; one object, reused


def measure_candidates(model, batches, device, candidates: dict[str, Candidate], lr: float = LR,
                       progress=None, smoke: bool = False) -> dict[str, tuple[dict | None, str | None]]:
    """Measure full training steps of every candidate on one model and one AdamW.

    The strategies change where activations live, not the arithmetic, so the candidates can share one
    model and one optimizer: whichever candidate runs a step, the weights move the same way.

    1. one update allocates AdamW's moments (every measured step is a steady-state step);
    2. ``schedule(device)``: warm-up rounds, then timed rounds, every candidate one full step per round,
       in turn (``measure.time_interleaved``: one intra-op thread on the CPU);
    3. the peak of one more full step per candidate (the allocator on CUDA; tracked storages on the CPU,
       with the parameters and AdamW's moments as resident state);
    4. a probe per candidate, one after another with no update in between: all start from the same
       weights, so loss and gradients compare exactly. The probes' gradient copies stay on the device;
       they come after the peaks, which therefore never see them.

    Returns ``{name: (measurement, None)}``, or ``(None, failure)`` for a candidate that ran out of memory.
    """
    rounds, warmup = schedule(device, smoke)
    model.zero_grad(set_to_none=True)
    opt = make_adamw(model.parameters(), lr, device)
    train_step(model, batches[0], None, opt)  # AdamW's exp_avg / exp_avg_sq exist from here on
    failures: dict[str, str] = {}

    def step_of(name):
        def step(i):
            if name not in failures:
                _, failure = oom_as_failure(train_step, model, batches[i % len(batches)], candidates[name].saving, opt)
                if failure:
                    failures[name] = failure
        return step

    timings = time_interleaved({n: step_of(n) for n in candidates}, rounds, warmup, device,
                               around={n: c.setup for n, c in candidates.items()}, progress=progress)
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    peaks: dict[str, PeakMemory] = {}
    for name, c in candidates.items():  # peaks: one full step each
        if name in failures:
            continue
        with c.setup():
            pm = PeakMemory(device, resident=[model.parameters(), state])
            with pm:
                _, failure = oom_as_failure(train_step, model, batches[1 % len(batches)], c.saving, opt)
        if failure:
            failures[name] = failure
        else:
            peaks[name] = pm
    out: dict[str, dict] = {}
    for name, pm in peaks.items():  # probes: no update between them
        c = candidates[name]
        counter = SavedBytesCounter(model.parameters()) if c.saving is None else None
        with c.setup():
            r, failure = oom_as_failure(probe, model, batches[0], device, counter or c.saving)
        if failure:
            failures[name] = failure
            continue
        if counter is not None:
            r.update(saved_activation_bytes=counter.bytes, saved_tensors=counter.tensors)
        r.update(timing=timings[name], peak_allocated=pm.peak_allocated, peak_reserved=pm.peak_reserved,
                 memory_source=pm.memory_source, updates=warmup + rounds + 1)
        out[name] = r
    model.zero_grad(set_to_none=True)
    del opt, state
    release_memory(device)
    return {n: (None, failures[n]) if n in failures else (out[n], None) for n in candidates}


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
