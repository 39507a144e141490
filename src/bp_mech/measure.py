"""Measurement: step time, peak memory, finiteness.

* ``time_steps`` runs a step function repeatedly, drops the warm-up steps (the first step
  pays for allocator growth and lazy initialisation) and reports the median and P95 of the
  rest, with the count excluded.
* ``PeakMemory`` is one context manager for both devices. On CUDA it reads the caching
  allocator (``max_memory_allocated`` / ``max_memory_reserved``). On the CPU there is no
  allocator to ask, so it tracks every tensor storage created inside the block through a
  ``TorchDispatchMode`` and weak storage references: the live bytes are the storages not
  yet freed, the peak is their maximum after any operator. The result is deterministic
  (a function of the program, not of timing) and its ``memory_source`` says which it is.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves


@dataclass
class Timing:
    """Step times after warm-up."""

    median_s: float  # median of the measured steps
    p95_s: float  # 95th percentile (nearest rank) of the measured steps
    warmup_excluded: int  # leading steps dropped
    samples: list[float] = field(default_factory=list)  # the measured steps, seconds


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


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], object], steps: int, warmup: int = 1, device="cpu") -> Timing:
    """Call ``step(i)`` ``steps`` times; time each call (synchronising CUDA around it)."""
    samples = []
    for i in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step(i)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return summarize(samples, warmup)


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when every given tensor (None skipped) holds only finite values."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def grads_finite(model: torch.nn.Module) -> bool:
    return all_finite(p.grad for p in model.parameters())


class _StorageTracker(TorchDispatchMode):
    """Tracks the bytes of every storage an operator outputs while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[int, int], tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.current = 0

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
            return
        st = t.untyped_storage()
        key = _key(t)
        if st.nbytes() == 0 or (key in self.live and not self.live[key][0].expired()):
            return
        self.live[key] = (StorageWeakRef(st), st.nbytes())

    def refresh(self) -> int:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            del self.live[k]
        self.current = sum(n for _, n in self.live.values())
        self.peak = max(self.peak, self.current)
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (a view, an in-place op) allocated nothing:
        # if that storage is untracked it existed before the block and is not counted
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and _key(t) in inputs and _key(t) not in self.live:
                continue
            self.add(t)
        self.refresh()
        return out


def _key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes())


@contextlib.contextmanager
def host_side():
    """Allocations inside are not tracked: host-side copies of an offload on the CPU, which
    the CUDA allocator would not count either."""
    stack = _get_current_dispatch_mode_stack()
    if stack and all(isinstance(m, _StorageTracker) for m in stack):
        with _disable_current_modes():
            yield
    else:
        yield


class PeakMemory:
    """Peak memory of a block of code, on CUDA (allocator) or CPU (tracked storages).

    Usage::

        with PeakMemory(device, resident=[model.parameters()]) as pm:
            loss = model(**batch).loss; loss.backward()
        pm.peak_allocated, pm.peak_reserved, pm.memory_source

    ``resident`` lists tensors that exist before the block and count towards the peak
    (parameters, optimizer state); on the CPU they are tracked like the rest, on CUDA the
    allocator already sees them. ``mark(name)`` records the live bytes at a point, which the
    ledger uses for its lifecycle stages.
    """

    def __init__(self, device="cpu", resident: Iterable = ()) -> None:
        self.device = torch.device(device)
        self.resident = list(resident)
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None
        self.marks: dict[str, int] = {}
        self._mode: _StorageTracker | None = None

    @property
    def memory_source(self) -> str:
        return "cuda-allocator" if self.device.type == "cuda" else "tracked-cpu"

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._mode.refresh() if self._mode else 0

    def mark(self, name: str) -> int:
        self.marks[name] = self.current()
        return self.marks[name]

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _StorageTracker()
            for group in self.resident:
                for t in tree_leaves(list(group) if not isinstance(group, torch.Tensor) else group):
                    self._mode.add(t)
            self._mode.refresh()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_allocated = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak_allocated = self._mode.peak
            self.peak_reserved = None


def mib(n: int | float | None) -> float | None:
    return None if n is None else n / 2**20


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


def free(device) -> None:
    """Collect garbage and, on CUDA, return the allocator's cached blocks (before a new candidate)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def guarded(fn: Callable, *args, **kwargs):
    """Run ``fn``; return ``(result, None)``, or ``(None, failure)`` on a CUDA out-of-memory.

    One candidate running out of memory is that candidate's failure; the run goes on. The
    memory is released after the except block, once the traceback (and every tensor its
    frames hold) is gone; inside it, ``empty_cache`` could return nothing.
    """
    try:
        return fn(*args, **kwargs), None
    except torch.OutOfMemoryError as e:
        failure = f"out of memory: {str(e).splitlines()[0][:200]}"
    free("cuda" if torch.cuda.is_available() else "cpu")
    return None, failure
