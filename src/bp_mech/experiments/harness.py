"""The shared experiment harness: what every experiment of the book measures the same way.

* ``train_step``: the measured step, a full training step (``zero_grad``, forward, backward, AdamW
  update); ``probe``: the same step without the update, for the equality check; ``compare``: loss and
  gradient errors against a baseline, NaN never equal;
* ``measure_candidates``: the candidates of a memory strategy on one shared model and optimizer
  (warm-up, interleaved timing on one CPU thread, a peak step each, probes from the same weights);
* ``schedule`` / ``estimate_seconds`` / ``plan_modes``: the steps and the planning estimate of
  ``--mode dry_run``.
* ``measure_separate`` / ``plan_separate``: the same for experiments whose candidates each train their
  own model (AMP, Part 02 · 11, Part 02 · 55): interleaved on the CPU, one after another on CUDA.

The strategies come in as ``Candidate(setup, saving)``: a configuration context (checkpointing) and
saved-tensor hooks (offload); this module imports no strategy. Their decision rule and records are in
``bp_mech.experiments.strategies``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from bp_mech.bench.counters import ForwardCounter, SavedBytesCounter
from bp_mech.bench.timing import CPU_TIMING_THREADS, SMOKE_SCHEDULE, StepStats, measure_steps, time_interleaved
from bp_mech.bench.oom import oom_as_failure, release_memory
from bp_mech.bench.tracking import PeakMemory
from bp_mech.update_dynamics import global_grad_norm
from bp_mech.bench.workload import PLAN_BUILD_S, make_adamw, param_count, plan_seconds

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


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in float64 (0 when both are 0); NaN when either holds one."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


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
        err = relative_error(a, b)
        bitwise = bitwise and err == 0.0
        grad_err = max(grad_err, finite(err))
    return dict(loss_error=loss_err, grad_error=grad_err, bitwise=bitwise,
                grad_norm_error=finite(abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)))


# Equality with the plain run: (loss, gradient) relative tolerances by device type.
EQUAL_TOL = {"cpu": (0.0, 0.0),  # CPU kernels are deterministic here: bitwise equality is required
       "cuda": (1e-6, 1e-4)}  # fp32 CUDA: a recompute may pick other kernels, backward may reassociate

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
    """Planning estimate (``bp_mech.bench.workload.plan_seconds``): per candidate, its warm-up and timed steps,
    the probe and the peak step at ``factor`` x a plain pass, plus the probe's gradient copy; one model
    build and the warm-up update that allocates AdamW's moments."""
    dev = torch.device(device).type
    passes, probe_s = sum(schedule(dev, smoke)) + 2, param_count(w.arch) * 4 / PROBE_BYTES_S
    return round(PLAN_BUILD_S[dev] + plan_seconds(w.arch, w.batch * w.seq, 1, dev)
                 + sum(plan_seconds(w.arch, w.batch * w.seq, f * passes, dev) + probe_s for f in factors), 1)


PLAN_MODES = (("cpu", "cpu"), ("real_gpu", "cuda"))  # (mode, its device) of every dry-run plan


def plan_per_mode(mode_fields: Callable[[str], dict]) -> dict:
    """The one loop of every ``--mode dry_run`` plan: ``{mode: mode_fields(its device type)}``."""
    return {mode: mode_fields(dev) for mode, dev in PLAN_MODES}


def plan_modes(w, factors, smoke: bool = False, **per_device) -> dict:
    """Steps and estimated seconds of ``--mode cpu`` and ``--mode real_gpu`` for workload ``w``
    (``measure_candidates``: interleaved on both devices)."""
    def fields(dev):
        rounds, warmup = schedule(dev, smoke)
        return dict(timed_rounds=rounds, warmup_rounds=warmup, interleaved=True,
                    threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                    estimated_seconds=estimate_seconds(w, factors, dev, smoke),
                    **{k: v(dev) for k, v in per_device.items()})
    return plan_per_mode(fields)


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


# --- one model copy per candidate: AMP, Part 02 · 11, Part 02 · 55 ---------------------------
# Where the candidates change the arithmetic (precision, micro-batches, learning rate) they cannot
# share one model and one optimizer as in ``measure_candidates``: each candidate trains its own.


def separate_steps(device, rounds: int, warmup: int) -> int:
    """Training steps ``measure_separate`` runs per candidate: warm-up and timed steps, plus on the CPU
    the tracked step that gives the peak."""
    return warmup + rounds + (torch.device(device).type == "cpu")


def resident_bytes(resident) -> int:
    """Bytes of the storages of ``resident`` (an iterable of iterables of tensors)."""
    return sum(t.untyped_storage().nbytes() for group in resident for t in group)


def measure_separate(prepare: Callable, names, device, rounds: int, warmup: int, finish: Callable | None = None,
                     progress=None, interleave: bool | None = None) -> dict[str, tuple[dict | None, str | None]]:
    """Measure full training steps of candidates that each own their model, optimizer (and scaler).

    * ``prepare(name, together) -> (step, resident)``: the candidate's state, ready to train (a warm-up
      update that allocates the optimizer's state is the experiment's choice). ``step(i)`` is one full
      training step of round ``i`` (``-1``: the tracked step); ``resident`` (iterables of tensors) is what
      exists before a step (parameters, optimizer state): the CPU tracker counts it as resident.
      ``together`` is True when every candidate is alive at once, so each needs its own model copy;
      False when it runs alone, so it may reuse the one model.
    * ``finish(name, step, stats) -> dict``, optional: what the experiment reads from the candidate after
      its steps, while its state is alive (an eval loss, a trace); ``step`` is ``prepare``'s, so a step
      object can carry that state.

    CPU (``interleave``, the default there): every candidate prepared and alive together; one tracked step
    each gives its peak (``PeakMemory``), then ``measure.time_interleaved``: ``warmup`` untimed and
    ``rounds`` timed rounds, one step of every candidate per round, one intra-op thread. CUDA: one
    candidate after another, alone on the device (the GPU is not shared): ``measure.measure_steps`` over
    ``warmup + rounds`` steps, the allocator's peak covering them, its memory released before the next.

    Returns ``{name: (dict(stats=StepStats, resident_bytes, steps, **finish(...)), None)}``, ``steps`` being
    ``separate_steps``, or ``(None, failure)`` for a candidate that could not allocate (``oom_as_failure``);
    the others go on.
    """
    together = torch.device(device).type == "cpu" if interleave is None else interleave

    def result(name, step, stats, resident):
        tracked = together or torch.device(device).type == "cpu"  # measure_steps tracks one more step on the CPU
        return dict(stats=stats, resident_bytes=resident_bytes(resident), steps=warmup + rounds + tracked,
                    **(finish(name, step, stats) if finish else {}))

    out: dict[str, tuple[dict | None, str | None]] = {}
    if not together:
        def alone(name):
            step, resident = prepare(name, False)
            resident = [list(group) for group in resident]
            release_memory(device)  # the reserved peak is this candidate's own
            return result(name, step, measure_steps(step, warmup + rounds, warmup, device, resident=resident),
                          resident)

        for name in names:
            out[name] = oom_as_failure(alone, name)
            release_memory(device)
        return out

    def start(name):  # its own state; the peak of one tracked step
        step, resident = prepare(name, True)
        resident = [list(group) for group in resident]
        with PeakMemory(device, resident=resident) as pm:
            step(-1)
        return step, resident, pm

    started = {}
    for name in names:
        r, failure = oom_as_failure(start, name)
        if failure:
            out[name] = (None, failure)
        else:
            started[name] = r
    if started:
        timings, failure = oom_as_failure(time_interleaved, {n: s for n, (s, _, _) in started.items()}, rounds,
                                          warmup, device, progress=progress)
        for name, (step, resident, pm) in started.items():
            stats = None if failure else StepStats(timings[name], pm.peak_allocated, pm.peak_reserved,
                                                   pm.memory_source)
            out[name] = (None, failure) if failure else oom_as_failure(result, name, step, stats, resident)
    return {n: out[n] for n in names}


def plan_separate(mode_plan: Callable[[str], tuple[int, int, dict]]) -> dict:
    """``--mode dry_run`` of an experiment measured with ``measure_separate``, per mode (``cpu``, ``real_gpu``).

    ``mode_plan(device type) -> (timed rounds, warm-up rounds, fields)``: the experiment's schedule on that
    device and its own plan fields, ``estimated_seconds`` among them. Added here: the steps each candidate
    makes in ``measure_separate`` and how they are timed (interleaved on one CPU thread; alone on CUDA).
    """
    def fields(dev):
        rounds, warmup, own = mode_plan(dev)
        return dict(timed_rounds=rounds, warmup_rounds=warmup, measured_steps=separate_steps(dev, rounds, warmup),
                    interleaved=dev == "cpu", threads=CPU_TIMING_THREADS if dev == "cpu" else None, **own)
    return plan_per_mode(fields)
