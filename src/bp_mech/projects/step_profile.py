"""Part 02 · 74 — the training step under ``torch.profiler``: trace, memory by category, operators.

``profile_step`` runs the baseline full training step of a workload (the one ``bench.step.train_step``:
forward, backward, AdamW update, ``zero_grad``, so the traced window starts and ends without gradients)
under ``torch.profiler.profile`` with a wait/warmup/active schedule, ``profile_memory``,
``record_shapes`` and ``with_stack``. ``record_phases``, an observer of the step, opens a
``record_function`` range per phase, so the trace and the memory timeline can be cut at the ledger's
stages.

What it returns (``StepProfile``):

* the Chrome trace (``export_chrome_trace``; opens in Perfetto or ``chrome://tracing``), written
  where the caller says;
* the profiler's own **memory timeline by category** (torch's memory profiler: parameter,
  optimizer state, input, temporary, activation, gradient, autograd detail, and ``unknown`` for
  allocations it cannot attribute), replayed from its event list (``category_timeline``), and
  its snapshot at each ledger stage (``stage_snapshots``);
* the **operators by self time** (``projects.operators.operator_table``, from a second, lighter
  profile of several steps: medians): CPU self time on the CPU, device (kernel) self time on CUDA, per
  step, with the input shapes of the costliest variant.

The memory profiler is reached through ``prof._memory_profile()``, the object torch's own (now
deprecated) ``export_memory_timeline`` builds its plot from.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bp_mech.projects.operators import MARK, operator_table, without_kineto_markers
# the profiler's categories (torch.profiler._memory_profiler.Category, lower case) + what it cannot attribute
CATEGORIES = ("parameter", "optimizer_state", "gradient", "activation", "autograd_detail", "temporary", "input",
              "unknown")
# ledger stage -> (phase, "end": the live set when the phase ends | "peak": its largest live set)
STAGE_POINTS = {"forward_peak": ("forward", "peak"), "forward": ("forward", "end"),
                "backward_peak": ("backward", "peak"), "backward": ("backward", "end"),
                "optimizer_peak": ("optimizer", "peak"), "zero_grad": ("zero_grad", "end")}


@dataclass(frozen=True)
class ProfileConfig:
    """The two profiles of ``profile_step``: memory and trace on a schedule, then the timing one."""

    wait: int = 1  # steps the profiler skips: the first update allocates AdamW's moments
    warmup: int = 1  # steps traced and discarded (the profiler's own warm-up)
    active: int = 1  # steps recorded with memory and stacks; the memory stages are read from the last one
    timed: int = 5  # steps of the timing profile (shapes only): per operator, the median over them
    top_n: int = 10  # operators in the self-time table

    @property
    def steps(self) -> int:
        return self.wait + self.warmup + self.active


@dataclass
class StepProfile:
    """What one profiled run of the step gives (sizes in bytes, times in microseconds)."""

    device: str  # "cpu" | "cuda"
    times_us: list[float]  # memory timeline: time since the first active step began
    bytes_by_category: dict[str, list[int]]  # category -> live bytes at each time
    phases: list[tuple[str, float, float]]  # (phase, start, end) of every active step, same clock
    stages: dict[str, dict[str, int]]  # ledger stage -> category -> bytes (last active step)
    operators: list[dict]  # the top operators by self time (``operator_table``)
    phase_us: dict[str, float]  # median duration of each phase over the timed steps (under the profiler)
    step_us: float  # median duration of a timed step (under the profiler: its overhead included)
    self_total_us: float  # median over the timed steps of every event's self time (the table's denominator)
    trace_path: str | None = None  # the Chrome trace, if written
    extra: dict = field(default_factory=dict)  # CUDA: device_busy_us, the kernels' time per step

    def timeline_json(self) -> dict:
        return dict(categories=list(CATEGORIES), times_us=self.times_us,
                    bytes=[self.bytes_by_category[c] for c in CATEGORIES],
                    phases=[list(p) for p in self.phases], device=self.device)


def record_phases(device):
    """An observer of ``train_step`` on ``device``: a ``record_function`` range per
    phase (``MARK`` + the phase). On CUDA each phase ends with a synchronize, so a
    phase's range covers its kernels and the live set at its end is settled."""
    cuda = torch.device(device).type == "cuda"

    @contextlib.contextmanager
    def observe(phase: str, state):
        with torch.profiler.record_function(MARK + phase):
            yield
            if cuda:
                torch.cuda.synchronize(device)
    return observe


def live_by_category(events, categories: dict
                     ) -> tuple[list[int], list[dict[str, int]]]:
    """Replay a memory timeline: the live bytes per category after each instant.

    ``events``: ``(time, action, key, version, nbytes)`` in time order, ``action`` one
    of ``"preexisting"`` (alive before the window; time -1), ``"create"``,
    ``"increment_version"`` (an in-place write: the storage's bytes leave version
    ``version`` and join ``version + 1``) and ``"destroy"`` (of version ``version``).
    ``categories``: ``{(key, version): category}``, a version it lacks is ``"unknown"``.
    Returns ``(times, states)``: one state per distinct time, the one after every event
    at that time (``{category: bytes}``, categories seen so far)."""
    live: dict[str, int] = {}
    times, states = [], []

    def add(key, version, nbytes):
        cat = categories.get((key, version), "unknown")
        live[cat] = live.get(cat, 0) + nbytes

    for t, action, key, version, nbytes in events:
        if action in ("preexisting", "create"):
            add(key, version, nbytes)
        elif action == "increment_version":
            add(key, version, -nbytes)
            add(key, version + 1, nbytes)
        elif action == "destroy":
            add(key, version, -nbytes)
        else:
            raise ValueError(f"unknown memory-timeline action {action!r}")
        if times and times[-1] == t:
            states[-1] = dict(live)
        else:
            times.append(t)
            states.append(dict(live))
    return times, states


def timeline_events(mp, device) -> tuple[list[tuple], dict]:
    """The memory profiler's timeline on ``device`` as ``live_by_category``'s input:
    events with the action's name in lower case, and the category (lower case,
    ``unknown`` where it has none) of every (storage, version) they touch. A destroyed
    storage's size is positive here."""
    from torch.profiler._memory_profiler import TensorKey

    dev = torch.device(device).type
    events, categories = [], {}
    for t, action, (key, version), nbytes in mp.timeline:
        if key.device.type != dev:
            continue
        events.append((t, action.name.lower(), key, version, abs(nbytes)))
        for v in (version, version + 1):
            cat = mp._categories.get(key, v) if isinstance(key, TensorKey) else None
            categories[(key, v)] = cat.name.lower() if cat is not None else "unknown"
    return events, categories


def category_timeline(mp, device) -> tuple[list[int], list[dict[str, int]]]:
    """(times in ns, live bytes per category in ``CATEGORIES`` order) of the profiler's timeline on ``device``."""
    times, states = live_by_category(*timeline_events(mp, device))
    return times, [{c: s.get(c, 0) for c in CATEGORIES} for s in states]


def stage_snapshots(times, states, ranges: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    """The live bytes per category at each ledger stage (``STAGE_POINTS``), from one step's phase
    ``ranges`` (name -> (start, end), the clock of ``times``)."""
    out = {}
    for stage, (ph, how) in STAGE_POINTS.items():
        start, end = ranges[ph]
        before = [s for t, s in zip(times, states) if t <= end]
        if how == "end":
            out[stage] = before[-1]
        else:  # the largest live set inside the phase (or the one it starts from)
            inside = [s for t, s in zip(times, states) if start <= t <= end]
            entering = [s for t, s in zip(times, states) if t < start][-1:]
            out[stage] = max(entering + inside, key=lambda s: sum(s.values()))
    return out


def profile_step(w, device="cpu", cfg: ProfileConfig = ProfileConfig(), trace_path=None) -> StepProfile:
    """Profile steady-state training steps of workload ``w`` on ``device`` (CPU: one intra-op thread, the
    book's timing protocol), twice: ``cfg.active`` step(s) with memory, shapes and stacks on the
    wait/warmup/active schedule (the trace, the memory timeline, the stages), then ``cfg.timed`` steps
    with shapes only (the operator table, the step's and the phases' times: medians over those steps;
    stacks and memory tracking would slow every operator). ``trace_path``: write the Chrome trace of
    the first there."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from bp_mech.bench.step import train_step
    from bp_mech.bench.timing import timing_threads
    from bp_mech.instruments.workload import build_model, make_batches
    from bp_mech.instruments.adamw import make_adamw
    from bp_mech.experiments.harness import LR

    cuda = torch.device(device).type == "cuda"
    model, batch = build_model(w, device), make_batches(w, 1, device=device)[0]
    opt = make_adamw(model.parameters(), LR, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def run(steps, **options):
        with profile(activities=activities, record_shapes=True, **options) as prof:
            for _ in range(steps):
                train_step(model, opt, batch, observers=[record_phases(device)])
                prof.step()
        return prof

    with timing_threads(device), without_kineto_markers():
        prof = run(cfg.steps, profile_memory=True, with_stack=True,
                   schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1))
        timed = run(cfg.timed + 1, schedule=schedule(wait=0, warmup=1, active=cfg.timed, repeat=1))
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    mp = prof._memory_profile()
    marks = sorted((e.start_time_ns, e.end_time_ns, e.name[len(MARK):]) for e in mp._op_tree.sorted_nodes
                   if e.name.startswith(MARK))
    times, states = category_timeline(mp, device)
    t0 = marks[0][0]
    last = {name: (s, e) for s, e, name in marks}  # the last active step's range of each phase
    operators, medians = operator_table(timed.events(), device, cfg.top_n)
    # CUDA: the GPU is busy for the kernels' time, the median step's summed self device time
    extra = dict(device_busy_us=medians["self_total_us"]) if cuda else {}
    return StepProfile(
        device=torch.device(device).type, times_us=[max(t - t0, 0) / 1e3 for t in times],
        bytes_by_category={c: [s[c] for s in states] for c in CATEGORIES},
        phases=[(n, (s - t0) / 1e3, (e - t0) / 1e3) for s, e, n in marks],
        stages=stage_snapshots(times, states, last), operators=operators, phase_us=medians["phase_us"],
        step_us=medians["step_us"], self_total_us=medians["self_total_us"],
        trace_path=None if trace_path is None else str(trace_path), extra=extra)


def write_timeline(p: StepProfile, path) -> Path:
    """The memory timeline by category as JSON (``StepProfile.timeline_json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(p.timeline_json()))
    return path
