"""The timing protocol: step times after warm-up, candidates interleaved, and when a ratio is noise.

These machines are shared: another process may take a core at any moment. So

* CPU steps run with ONE intra-op thread (``timing_threads``): a second thread would compete with the
  neighbour and turn load into time;
* on the CPU a step is timed by the measuring thread's CPU time (``time.thread_time``), with the wall
  time beside it: when other processes oversubscribe the cores, the wall time of a step grows by however
  long the thread waited for a core, while its CPU time does not. On CUDA the wall time around
  ``synchronize`` is the step's time (the host thread mostly waits for the device);
* the candidates of an experiment are timed INTERLEAVED (``time_interleaved``), one step of each in turn,
  so that a burst of load hits every candidate alike instead of the one whose block it fell in;
* a ratio that contradicts the counted work, or whose median and P95 disagree, is noise
  (``timing_noise``) and decides nothing.

Warm-up steps (allocator growth, lazy initialisation) are dropped before the median and P95.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

CPU_TIMING_THREADS = 1  # intra-op threads inside timed CPU regions
SMOKE_SCHEDULE = (3, 1)  # (timed, warm-up) steps of a smoke run (``--smoke``): the code paths, not the numbers
CLOCKS = ("thread_time", "wall")  # what a Timing's samples read: the thread's CPU time (CPU), wall time (CUDA)


def percentile(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of an empty sample")
    k = max(1, math.ceil(q / 100 * len(s)))
    return s[k - 1]


def median_interval(xs: Iterable[float], confidence: float = 0.99) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``xs``: the order statistics
    (x_(k), x_(n+1-k)) with k the largest rank for which P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2.
    It assumes nothing of the noise but that the samples are independent draws.

    Args:
        xs: the samples (at least one).
        confidence: the interval's coverage.

    Returns:
        (low, high); the whole range when n is too small for the coverage.

    Example:
        >>> median_interval(range(1, 21))  # n = 20 at 99 %: ranks 4 and 17
        (4, 17)
    """
    s = sorted(xs)
    if not s:
        raise ValueError("median_interval of an empty sample")
    n, tail, k, cdf = len(s), (1 - confidence) / 2, 0, 0.0
    while True:
        cdf += math.comb(n, k) / 2**n  # P(B <= k) = P(B < k + 1)
        if cdf > tail:
            break
        k += 1
    k = max(k, 1)
    return s[k - 1], s[n - k]


@dataclass
class Timing:
    """Step times after warm-up, by the clock that decides (``clock``) and by the wall clock."""

    samples: list[float]  # seconds per timed step, by ``clock``
    wall_samples: list[float] = field(default_factory=list)  # the same steps by the wall clock ([]: not kept)
    warmup_excluded: int = 0  # leading steps dropped
    clock: str = "wall"  # "thread_time" (CPU: the measuring thread's CPU time) | "wall"
    threads: int | None = None  # CPU intra-op threads inside the timed region (None: CUDA)
    interleaved: bool = False  # timed round-robin with the other candidates of its experiment

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a Timing needs at least one timed step")
        if self.clock not in CLOCKS:
            raise ValueError(f"unknown clock {self.clock!r}; one of {CLOCKS}")

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95_s(self) -> float:
        return percentile(self.samples, 95)

    @property
    def wall_median_s(self) -> float | None:
        return statistics.median(self.wall_samples) if self.wall_samples else None

    @property
    def wall_p95_s(self) -> float | None:
        return percentile(self.wall_samples, 95) if self.wall_samples else None

    def record_fields(self) -> dict:
        """The timing fields of a result record (one place maps a Timing onto the record)."""
        return dict(step_median_s=self.median_s, step_p95_s=self.p95_s, step_clock=self.clock,
                    wall_median_s=self.wall_median_s, wall_p95_s=self.wall_p95_s,
                    warmup_excluded=self.warmup_excluded, threads=self.threads)


def summarize(samples: list[float], warmup: int, clock: str = "wall", wall: list[float] | None = None) -> Timing:
    """The Timing of ``samples`` (and their ``wall`` times) without the first ``warmup``."""
    kept = samples[warmup:]
    if not kept:
        raise ValueError(f"{len(samples)} steps leave nothing after {warmup} warm-up steps")
    return Timing(kept, list(wall[warmup:]) if wall else [], warmup, clock)


def clock_for(device) -> str:
    """The deciding clock on ``device``: the thread's CPU time on the CPU, the wall time on CUDA."""
    return "wall" if torch.device(device).type == "cuda" else "thread_time"


def sync(device) -> None:
    """Wait for ``device`` (CUDA) to finish its queued work; nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device) -> tuple[float, float]:
    """(seconds by the thread's CPU time, seconds by the wall clock) of one call of ``fn``."""
    sync(device)
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    sync(device)
    return time.thread_time() - c0, time.perf_counter() - w0


def time_steps(step: Callable[[int], object], steps: int, warmup: int = 1, device="cpu") -> Timing:
    """Call ``step(i)`` ``steps`` times; time each call (synchronising CUDA around it)."""
    cpu, wall = [], []
    for i in range(steps):
        c, w = _timed(lambda: step(i), device)
        cpu.append(c)
        wall.append(w)
    clock = clock_for(device)
    return summarize(cpu if clock == "thread_time" else wall, warmup, clock, wall)


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


def matmul_flops(n: int = 1024, repeats: int = 7, threads: int = 1, clock=time.perf_counter) -> float:
    """The float32 matrix-product rate of this machine (FLOP/s): the fastest of ``repeats`` products of
    two n x n matrices (2 n^3 FLOPs each, after one untimed warm-up) on ``threads`` intra-op threads,
    timed on ``clock`` (``time.thread_time``: the thread's CPU time, as the CPU timing protocol)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    with timing_threads("cpu", threads):
        torch.mm(a, b)
        for _ in range(repeats):
            t0 = clock()
            torch.mm(a, b)
            best = min(best, clock() - t0)
    return 2 * n**3 / best


def time_interleaved(steps: dict[str, Callable[[int], object]], rounds: int, warmup: int, device="cpu",
                     threads: int | None = CPU_TIMING_THREADS, around: dict[str, Callable] | None = None,
                     progress=None) -> dict[str, Timing]:
    """Time several candidates' steps round-robin: ``warmup`` untimed rounds, then ``rounds`` rounds
    in which every candidate runs (and is timed) once; the order rotates each round so no candidate
    always follows the same one. ``steps[name](i)`` is called with the round index ``i``, inside
    ``around[name]()`` (a context manager: a candidate's configuration), which is entered before
    and left after the timed region.

    Returns one Timing per candidate over its ``rounds`` timed steps (``warmup_excluded`` =
    ``warmup``, ``threads``, ``interleaved=True``; the clock of ``clock_for(device)``, wall beside).
    """
    names = list(steps)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds} warmup={warmup}")
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    it = range(warmup + rounds)
    with timing_threads(device, threads) as n_threads:
        for r in (progress(it, desc="interleaved rounds") if progress else it):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                with (around or {}).get(name, contextlib.nullcontext)():
                    c, w = _timed(lambda: steps[name](r), device)
                if r >= warmup:
                    cpu[name].append(c)
                    wall[name].append(w)
    clock = clock_for(device)
    return {n: Timing(cpu[n] if clock == "thread_time" else wall[n], wall[n], warmup, clock, n_threads, True)
            for n in names}


# A time ratio decides nothing when it is noise. It is *noisy* when
#  * the candidate does strictly more work than the baseline (counted recomputes, transfers, extra
#    micro-batches) and still measured faster: a contradiction only load can produce; or
#  * its median ratio and its P95 ratio disagree by more than MAX_RATIO_SPREAD x: the tail of one
#    sample was hit by something the other was not.
MAX_RATIO_SPREAD = 1.5


def timing_noise(t: Timing, base: Timing, more_work: bool, against: str = "plain") -> str | None:
    """Why the ratio ``t / base`` (of the deciding clock) is noise, or None when it can be used for a decision.

    Args:
        t: the candidate's timing (anything with ``median_s`` and ``p95_s``).
        base: the timing it is compared with.
        more_work: whether the candidate does strictly more counted work than ``base``.
        against: the name of what ``base`` timed, for the message.

    Returns:
        None, or the reasons joined by "; ".

    Example:
        >>> from types import SimpleNamespace as T
        >>> timing_noise(T(median_s=0.9, p95_s=1.0), T(median_s=1.0, p95_s=1.0), more_work=True)
        'does strictly more work than plain yet measured 0.90x its median'
        >>> timing_noise(T(median_s=1.2, p95_s=1.3), T(median_s=1.0, p95_s=1.1), more_work=True) is None
        True
    """
    median_ratio, p95_ratio = t.median_s / base.median_s, t.p95_s / base.p95_s
    why = []
    if more_work and median_ratio < 1.0:
        why.append(f"does strictly more work than {against} yet measured {median_ratio:.2f}x its median")
    spread = max(median_ratio, p95_ratio) / min(median_ratio, p95_ratio)
    if spread > MAX_RATIO_SPREAD:
        why.append(f"median ratio {median_ratio:.2f} and P95 ratio {p95_ratio:.2f} differ by {spread:.2f}x "
                   f"> {MAX_RATIO_SPREAD}")
    return "; ".join(why) or None
