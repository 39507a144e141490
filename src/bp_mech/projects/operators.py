"""The operators of a profiled step by self time, and the profiler's own console noise kept out of notebooks.

* ``operator_table``: the aten operators by self time per step (median over the profiled steps), with the
  input shapes of the costliest variant: CPU self time on the CPU, device (kernel) self time on CUDA;
* ``without_kineto_markers``: Kineto's ``USDT: profiler_start/stop`` lines on fd 2 dropped.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import torch

from bp_mech.bench.step import PHASES  # the profiled step, in order

MARK = "bp_mech::"  # prefix of the phase ranges (record_function) in the trace


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def operator_table(events, device, top_n: int) -> tuple[list[dict], dict]:
    """The aten operators by self time per step, from the events of a profile with one
    ``ProfilerStep`` range per step: per operator the median over the steps (a shared machine may
    preempt the thread inside any operator of any one step; the median leaves such a step out). CPU:
    self CPU time; CUDA: self device (kernel) time. Returns the first ``top_n`` rows (name, calls per
    step, self time per step in us, share of the step's summed self time, the input shapes that took
    the most self time) and the step's medians: ``self_total_us`` (every event's self time), ``step_us``
    (from its first phase's start to its last phase's end: a step's own range may also hold the
    profiler's bookkeeping) and ``phase_us`` (each ``bp_mech::`` phase's duration)."""
    from torch.autograd import DeviceType

    attr = "self_cpu_time_total" if torch.device(device).type == "cpu" else "self_device_time_total"
    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU)

    def step_of(e):
        return next((i for i, (s, t) in enumerate(steps) if s <= e.time_range.start <= t), None)

    per_op: dict[str, list] = {}  # name -> per step [self us, calls]
    totals, phases, shapes = [0.0] * len(steps), {p: [] for p in PHASES}, {}
    spans = [[math.inf, -math.inf] for _ in steps]  # per step: first phase's start, last phase's end
    for e in events:
        # host-side events only: a kernel's time is in its launching operator's self device time (a
        # kernel's own event, and a range's device-side copy, would count it twice)
        i = step_of(e) if e.device_type == DeviceType.CPU else None
        if i is None or e.name.startswith("ProfilerStep"):
            continue
        totals[i] += getattr(e, attr)  # a phase range's own self time: the Python between its operators
        if e.name.startswith(MARK):
            phases[e.name[len(MARK):]].append(e.time_range.end - e.time_range.start)
            spans[i] = [min(spans[i][0], e.time_range.start), max(spans[i][1], e.time_range.end)]
        elif e.name.startswith("aten::"):
            row = per_op.setdefault(e.name, [[0.0, 0] for _ in steps])
            row[i][0] += getattr(e, attr)
            row[i][1] += 1
            key = (e.name, str([list(x) for x in e.input_shapes if x]))
            shapes[key] = shapes.get(key, 0.0) + getattr(e, attr)
    total = _median(totals)
    ops = sorted(((n, _median([x[0] for x in r]), _median([x[1] for x in r])) for n, r in per_op.items()),
                 key=lambda o: -o[1])[:top_n]
    rows = [dict(name=n, calls=calls, self_us=us, share=us / total if total else 0.0,
                 shapes=max((k for k in shapes if k[0] == n), key=shapes.get)[1]) for n, us, calls in ops]
    return rows, dict(self_total_us=total, step_us=_median([t - s for s, t in spans if t > s]),
                      phase_us={p: _median(d) for p, d in phases.items()})


@contextlib.contextmanager
def without_kineto_markers():
    """Kineto prints a ``USDT: ... profiler_start`` / ``profiler_stop`` line to the process's stderr (file
    descriptor 2, past Python) at each profile; a notebook shows them as an error stream. Lines of that
    form are dropped; anything else written to fd 2 meanwhile is passed on to ``sys.stderr``."""
    import os
    import sys
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))
