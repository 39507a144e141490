"""The experiment harness: how every experiment of the book measures its arms.

An *arm* of a comparison is a ``Run``: a full training step (``bench.step.train_step`` under the arm's
strategy) ready to be called, and the tensors that exist before it. ``measure`` measures every arm the
same way:

1. the peak of one tracked step each (``instruments.peak.PeakMemory``: the CUDA allocator, or the tracked
   storages on the CPU with the parameters and optimizer state as resident);
2. the step time: ``warmup`` untimed and ``rounds`` timed steps, interleaved round-robin with the
   other arms on one intra-op CPU thread (``bench.timing.time_interleaved``) when the arms are alive
   together; one arm after another, alone on the device, when they are not;
3. ``finish(name, run)``: what the experiment reads from the arm while it is alive.

Two kinds of experiment use it:

* **same weights** (Part 02 · 19, 42, project 76): the strategies change where activations live, not
  the arithmetic, so the arms share one model and one AdamW (``same_weights``); afterwards a probe each
  (the step without the update, every one from the same weights) is compared with the plain probe;
* **own weights** (Part 02 · 11, AMP, 55, 56): the arms change the arithmetic (micro-batches, precision,
  learning rate), so each trains its own model copy (``prepare(name, together)``): together and
  interleaved on the CPU, one after another on CUDA.

An arm that runs out of memory is that arm's ``Failed``; the others go on. The memory strategies'
decision rule (``decide``) and their records (``strategy_records``) are in ``bp_mech.experiments.decision``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from bp_mech.bench.compare import Comparison, compare, tolerance
from bp_mech.bench.oom import Failed, attempt, release_memory
from bp_mech.bench.step import Probe, StepResult, optimizer_state, probe, train_step
from bp_mech.bench.strategy import PLAIN, Entered, Strategy, configured
from bp_mech.bench.timing import Timing, time_interleaved, time_steps
from bp_mech.instruments.peak import Peak, PeakMemory
from bp_mech.instruments.adamw import make_adamw

LR = 1e-4  # AdamW learning rate of the same-weights steps (memory and time do not depend on it)


@dataclass
class Run:
    """One arm, ready to train: ``step(i)`` is one full training step of round ``i`` (-1: the tracked step)."""

    step_fn: Callable[[int], StepResult]  # one step; its result says whether the update was applied
    resident: Callable[[], list]  # () -> lists of the tensors alive before a step (parameters, optimizer state)
    setup: Callable = contextlib.nullcontext  # entered around each step: a shared model's configuration
    log: list[StepResult] = field(default_factory=list)  # every step's result, in order

    def step(self, i: int) -> StepResult:
        r = self.step_fn(i)
        self.log.append(r)
        return r

    @classmethod
    def of(cls, model, opt, batches: list[dict], strategy: Strategy = PLAIN, entered: Entered | None = None,
           setup: Callable = contextlib.nullcontext, **step_options) -> "Run":
        """The arm that trains ``model`` with ``opt`` under ``strategy`` (``entered``: it entered on the model),
        step ``i`` on ``batches[(i + 1) % len(batches)]`` (the tracked step on ``batches[0]``);
        ``step_options``: ``train_step``'s ``max_norm`` and ``clock``."""
        def step(i: int) -> StepResult:
            return train_step(model, opt, batches[(i + 1) % len(batches)], strategy, entered=entered, **step_options)
        return cls(step, lambda: [list(model.parameters()), optimizer_state(opt)], setup)

    @property
    def updates(self) -> int:
        """Steps of this run that applied an update."""
        return sum(r.applied for r in self.log)

    @property
    def skipped(self) -> int:
        """Steps of this run whose update the fp16 scaler skipped."""
        return sum(not r.applied for r in self.log)


@dataclass
class Measured:
    """A measured arm."""

    name: str
    timing: Timing  # the timed steps
    peak: Peak  # the tracked step's (CUDA: over the tracked and the timed steps)
    resident_bytes: int  # the storages of ``Run.resident``: what exists before a step
    updates: int  # steps that applied an update (every step the harness ran, the tracked one included)
    skipped: int  # steps whose update the fp16 scaler skipped
    applied: list[bool] = field(default_factory=list)  # per step, in order: was its update applied
    probe: Probe | None = None  # same weights: the step without the update
    comparison: Comparison | None = None  # same weights: the probe against the baseline's
    equal: bool | None = None  # same weights: finite, and within ``tolerance`` of the baseline (the baseline: finite)
    finish: object = None  # what ``finish`` read from the arm
    strategy: Strategy | None = None  # same weights: the arm's strategy
    d2h_bytes: int = 0  # same weights: bytes the arm's offload copied to the host in its probe
    h2d_bytes: int = 0  # and back

    def record_fields(self) -> dict:
        """The measured fields of a result record."""
        return dict(**self.timing.record_fields(), **self.peak.record_fields(), updates=self.updates,
                    skipped_updates=self.skipped)


def resident_bytes(resident) -> int:
    """Bytes of the storages of ``resident`` (an iterable of iterables of tensors)."""
    return sum(t.untyped_storage().nbytes() for group in resident for t in group)


def measure(names, prepare: Callable[[str, bool], Run], device, rounds: int, warmup: int, *,
            together: bool | None = None, finish: Callable[[str, Run], object] | None = None,
            progress=None) -> dict[str, Measured | Failed]:
    """Measure every arm of ``names`` (module docstring): ``prepare(name, together)`` makes its ``Run``;
    ``together`` (default: on the CPU) keeps every arm alive at once and interleaves their steps, else
    they run one after another, each alone on the device. Returns ``{name: Measured | Failed}`` in order."""
    together = torch.device(device).type == "cpu" if together is None else together
    cuda = torch.device(device).type == "cuda"
    out: dict[str, Measured | Failed] = {}

    def tracked(run: Run, timed: bool) -> tuple[Peak, Timing | None, int]:
        """The tracked step's peak (CUDA, timed: over the timed steps too), when timed the timing, and the
        resident bytes."""
        resident = run.resident()
        with run.setup(), PeakMemory(device, resident=resident) as pm:
            run.step(-1)
            timing = time_steps(run.step, warmup + rounds, warmup, device) if timed and cuda else None
        if timed and timing is None:
            with run.setup():
                timing = time_steps(run.step, warmup + rounds, warmup, device)
        return pm.peak, timing, resident_bytes(resident)

    def measured(name, run, tracked_out, timing) -> Measured:
        done = finish(name, run) if finish else None
        peak, _, resident = tracked_out
        return Measured(name, timing, peak, resident, run.updates, run.skipped, [r.applied for r in run.log],
                        finish=done)

    if not together:
        for name in names:
            def alone(name=name):
                run = prepare(name, False)
                release_memory(device)  # the reserved peak is this arm's own
                peak = tracked(run, timed=True)
                return measured(name, run, peak, peak[1])
            r = attempt(alone)
            out[name] = Failed(r.failure, name) if isinstance(r, Failed) else r
            release_memory(device)
        return out
    runs, peaks = {}, {}
    for name in names:
        run = attempt(prepare, name, True)
        r = run if isinstance(run, Failed) else attempt(tracked, run, False)
        if isinstance(r, Failed):
            out[name] = Failed(r.failure, name)
        else:
            runs[name], peaks[name] = run, r
    failures: dict[str, str] = {}

    def step_of(name):
        def step(i):
            if name not in failures:
                r = attempt(runs[name].step, i)
                if isinstance(r, Failed):
                    failures[name] = r.failure
        return step

    timings = time_interleaved({n: step_of(n) for n in runs}, rounds, warmup, device,
                               around={n: r.setup for n, r in runs.items()}, progress=progress)
    for name, run in runs.items():
        r = Failed(failures[name]) if name in failures else attempt(measured, name, run, peaks[name], timings[name])
        out[name] = Failed(r.failure, name) if isinstance(r, Failed) else r
    return {n: out[n] for n in names}


def same_weights(model, batches: list[dict], device, arms: dict[str, Strategy], rounds: int, warmup: int, *,
                 hooks: dict | None = None, baseline: str = PLAIN.name, lr: float = LR,
                 progress=None) -> dict[str, Measured | Failed]:
    """``measure`` of strategies that share ``model`` and one AdamW, then a probe each on ``batches[0]``.

    ``arms``: ``{name: strategy}`` (the name is the strategy's, or an experiment's own arm such as
    ``save_on_cpu``), ``baseline`` first among the probes; ``hooks``: ``{name: saved-tensor hooks}`` that
    stand in for an arm's offload. One update allocates AdamW's moments first, so every measured step is
    a steady-state step; each arm keeps one ``Entered`` (its offload's host pool, its scaler) across its
    steps. The probes run after every timed step, one after another with no update in between: all start
    from the same weights, so loss and gradients compare with the baseline's exactly."""
    model.zero_grad(set_to_none=True)
    opt = make_adamw(model.parameters(), lr, device)
    train_step(model, opt, batches[0], PLAIN)  # AdamW's exp_avg / exp_avg_sq exist from here on
    entered = {n: Entered(model, s, device, hooks=(hooks or {}).get(n)) for n, s in arms.items()}

    def prepare(name, together):
        s = arms[name]
        return Run.of(model, opt, batches, s, entered[name], setup=lambda: configured(model, s))

    out = measure(list(arms), prepare, device, rounds, warmup, together=True, progress=progress)
    base = None
    for name in sorted(arms, key=lambda n: n != baseline):  # the baseline's probe first
        m = out[name]
        if isinstance(m, Failed):
            continue
        with configured(model, arms[name]):
            p = attempt(probe, model, batches[0], arms[name], entered=entered[name], device=device)
        if isinstance(p, Failed):
            out[name] = Failed(p.failure, name)
            continue
        m.probe, m.strategy = p, arms[name]
        m.d2h_bytes, m.h2d_bytes = entered[name].d2h_bytes, entered[name].h2d_bytes
        if name == baseline:
            base, m.equal = p, p.finite
        elif base is not None:
            m.comparison = compare(base, p)
            m.equal = p.finite and base.finite and m.comparison.within(tolerance(arms[name], device))
    for m in out.values():  # the gradient copies have been compared: free them
        if isinstance(m, Measured) and m.probe is not None:
            m.probe.grads = []
    model.zero_grad(set_to_none=True)
    release_memory(device)
    return out
