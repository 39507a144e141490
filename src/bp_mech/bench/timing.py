"""The timing protocol: step times after warm-up, interleaved candidates, and when a ratio is noise.

* ``time_steps`` runs a step function repeatedly, drops the warm-up steps (the first step
  pays for allocator growth and lazy initialisation) and reports the median and P95 of the
  rest, with the count excluded.
* ``time_interleaved`` is the CPU timing protocol; ``timing_noise`` says when a ratio is noise.
* ``measure_steps`` gives the peak (``bp_mech.bench.tracking.PeakMemory``) and the step time of a
  repeated step.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from bp_mech.bench.tracking import PeakMemory

@dataclass
class Timing:
    """Step times after warm-up."""

    median_s: float  # median of the measured steps
    p95_s: float  # 95th percentile (nearest rank) of the measured steps
    warmup_excluded: int  # leading steps dropped
    samples: list[float] = field(default_factory=list)  # the measured steps, seconds
    threads: int | None = None  # CPU intra-op threads inside the timed region (None: CUDA)
    interleaved: bool = False  # timed round-robin with the other candidates of its experiment


def percentile(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of an empty sample")
    k = max(1, math.ceil(q / 100 * len(s)))
    return s[k - 1]


def summarize(samples: list[float], warmup: int) -> Timing:
    kept = samples[warmup:]
    if not kept:
        raise ValueError(f"{len(samples)} steps leave nothing after {warmup} warm-up steps")
    return Timing(statistics.median(kept), percentile(kept, 95), warmup, kept)



def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], object], steps: int, warmup: int = 1, device="cpu") -> Timing:
    """Call ``step(i)`` ``steps`` times; time each call (synchronising CUDA around it)."""
    samples = []
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step(i)
        sync(device)
        samples.append(time.perf_counter() - t0)
    return summarize(samples, warmup)


# --- the CPU timing protocol -----------------------------------------------------------
# These machines are shared: another process may take a core at any moment. So CPU steps run
# with ONE intra-op thread (a second thread would compete with the neighbour and turn load into
# time), and the candidates of an experiment are timed INTERLEAVED, one step of each in turn, so
# that a burst of load hits every candidate alike instead of the one whose block it fell in.

CPU_TIMING_THREADS = 1  # intra-op threads inside timed CPU regions
SMOKE_SCHEDULE = (3, 1)  # (timed, warm-up) steps of a smoke run (``--smoke``): the code paths, not the numbers


@contextlib.contextmanager
def timing_threads(device, threads: int | None = CPU_TIMING_THREADS):
    """Set torch's intra-op threads to ``threads`` on the CPU inside the block, restore them after.
    Yields the thread count in force (None on CUDA, where the host threads do not do the math)."""
    if torch.device(device).type != "cpu" or threads is None:
        yield None if torch.device(device).type != "cpu" else torch.get_num_threads()
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def time_interleaved(steps: dict[str, Callable[[int], object]], rounds: int, warmup: int, device="cpu",
                     threads: int | None = CPU_TIMING_THREADS, around: dict[str, Callable] | None = None,
                     progress=None) -> dict[str, Timing]:
    """Time several candidates' steps round-robin: ``warmup`` untimed rounds, then ``rounds`` rounds
    in which every candidate runs (and is timed) once; the order rotates each round so no candidate
    always follows the same one. ``steps[name](i)`` is called with the round index ``i``, inside
    ``around[name]()`` (a context manager: a candidate's configuration), which is entered before
    and left after the timed region.

    Returns one Timing per candidate over its ``rounds`` timed steps (``warmup_excluded`` =
    ``warmup``, ``threads``, ``interleaved=True``).
    """
    names = list(steps)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds} warmup={warmup}")
    samples: dict[str, list[float]] = {n: [] for n in names}
    it = range(warmup + rounds)
    with timing_threads(device, threads) as n_threads:
        for r in (progress(it, desc="interleaved rounds") if progress else it):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                with (around or {}).get(name, contextlib.nullcontext)():
                    sync(device)
                    t0 = time.perf_counter()
                    steps[name](r)
                    sync(device)
                    elapsed = time.perf_counter() - t0
                if r >= warmup:
                    samples[name].append(elapsed)
    out = {}
    for n in names:
        t = summarize(samples[n], 0)
        out[n] = Timing(t.median_s, t.p95_s, warmup, t.samples, threads=n_threads, interleaved=True)
    return out


# A time ratio decides nothing when it is noise. It is *noisy* when
#  * the candidate does strictly more work than the baseline (counted recomputes, transfers, extra
#    micro-batches) and still measured faster: a contradiction only load can produce; or
#  * its median ratio and its P95 ratio disagree by more than MAX_RATIO_SPREAD x: the tail of one
#    sample was hit by something the other was not.
MAX_RATIO_SPREAD = 1.5


def timing_noise(t: Timing, base: Timing, more_work: bool) -> str | None:
    """Why the ratio ``t / base`` is noise, or None when it can be used for a decision."""
    median_ratio, p95_ratio = t.median_s / base.median_s, t.p95_s / base.p95_s
    why = []
    if more_work and median_ratio < 1.0:
        why.append(f"does strictly more work than the baseline yet measured {median_ratio:.2f}x its median")
    spread = max(median_ratio, p95_ratio) / min(median_ratio, p95_ratio)
    if spread > MAX_RATIO_SPREAD:
        why.append(f"median ratio {median_ratio:.2f} and P95 ratio {p95_ratio:.2f} differ by {spread:.2f}x "
                   f"> {MAX_RATIO_SPREAD}")
    return "; ".join(why) or None


@dataclass
class StepStats:
    """Time and memory of a repeated training step."""

    timing: Timing  # median/P95 after warm-up
    peak_allocated: int  # bytes (allocator on CUDA, tracked storages on CPU)
    peak_reserved: int | None  # bytes, CUDA only
    memory_source: str  # cuda-allocator | tracked-cpu


def measure_steps(step: Callable[[int], object], steps: int, warmup: int = 1, device="cpu",
                  resident: Iterable = ()) -> StepStats:
    """Peak memory and step time of ``step(i)``.

    CUDA: one pass of ``steps`` calls; the allocator's peak covers all of them. CPU: call 0
    runs under the storage tracker (it gives the peak and is itself a warm-up call, not
    timed, because tracking slows every operator), then ``steps`` untracked calls are timed,
    of which the first ``warmup`` are dropped.
    """
    if torch.device(device).type == "cuda":
        with PeakMemory(device) as pm:
            timing = time_steps(step, steps, warmup, device)
    else:
        with PeakMemory(device, resident=resident) as pm:
            step(-1)
        timing = time_steps(step, steps, warmup, device)
    return StepStats(timing, pm.peak_allocated, pm.peak_reserved, pm.memory_source)

