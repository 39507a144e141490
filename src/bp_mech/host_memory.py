"""Part 02 · 42 — host memory for offload: a reused (pinned) buffer pool, and the host link's bandwidth.

``ActivationOffload`` (``bp_mech.offload``) copies saved activations into host buffers that come
from ``HostPool``: reused from step to step, bucketed by exact byte size, pinned on CUDA (page-locked
memory is what lets a copy run asynchronously, and allocating it is slow). ``measure_bandwidth`` times
the pinned host <-> device link those copies run over. ``bp_mech.offload``'s ``ActivationOffload``
draws its host copies from a ``HostPool``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from typing import Callable, ContextManager

import torch


class HostPool:
    """Host buffers reused across steps, bucketed by exact byte size (pinned on CUDA).

    Counters: ``allocated`` / ``allocations`` (bytes / buffers ever allocated),
    ``in_use`` (bytes handed out now) and ``high_water`` (most bytes handed out at
    once).

    Args:
        pin: allocate page-locked buffers (needed for asynchronous copies; CUDA only).
        host_region: the context each new buffer is allocated in (default: none).
            A memory tracker that must tell host bytes from device bytes on a
            CPU-only machine passes its own (``tracking.host_side``): the pool
            does not know who is watching.

    Example:
        >>> pool = HostPool(pin=False)
        >>> pool.give(pool.take(1024))
        >>> _ = pool.take(1024)  # the second take reuses the buffer
        >>> pool.allocations, pool.allocated, pool.in_use, pool.high_water
        (1, 1024, 1024, 1024)
    """

    def __init__(self, pin: bool,
                 host_region: Callable[[], ContextManager] = contextlib.nullcontext):
        self.pin = pin  # page-locked: needed for asynchronous copies
        # entered around each allocation (a tracker's, or nothing)
        self.host_region = host_region
        # nbytes -> uint8 buffers not handed out
        self.idle: dict[int, list] = defaultdict(list)
        self.allocated = 0  # bytes ever allocated
        self.allocations = 0  # buffers ever allocated
        self.in_use = 0  # bytes handed out now
        self.high_water = 0  # most bytes handed out at once

    def take(self, n: int) -> torch.Tensor:
        """Hand out a buffer of ``n`` bytes: an idle one of that exact size, else a new
        one.

        Args:
            n: the size in bytes.

        Returns:
            A 1-D uint8 tensor of ``n`` elements on the host (its contents undefined).

        Example:
            >>> buf = HostPool(pin=False).take(16)
            >>> buf.dtype, buf.shape
            (torch.uint8, torch.Size([16]))
        """
        if self.idle[n]:
            buf = self.idle[n].pop()
        else:
            with self.host_region():
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated, self.allocations = self.allocated + n, self.allocations + 1
        self.in_use += n
        self.high_water = max(self.high_water, self.in_use)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` to its size's bucket of idle buffers.

        Args:
            buf: the buffer ``take`` handed out.

        Returns:
            None; ``buf`` joins ``idle`` and ``in_use`` drops by its size.

        Example:
            >>> pool = HostPool(pin=False); pool.give(pool.take(16))
            >>> pool.in_use, len(pool.idle[16])
            (0, 1)
        """
        self.idle[buf.numel()].append(buf)
        self.in_use -= buf.numel()


def measure_bandwidth(device, nbytes: int = 256 * 2**20, reps: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth (bytes/s, median of ``reps``), CUDA events.

    Args:
        device: a CUDA device.
        nbytes: bytes per copy.
        reps: timed copies per direction, after one warm-up copy.

    Returns:
        ``{"h2d": bytes/s, "d2h": bytes/s}``.

    Example:
        Skipped by the doctests: it needs a CUDA device.

        >>> sorted(measure_bandwidth("cuda", nbytes=2**20))  # doctest: +SKIP
        ['d2h', 'h2d']
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / statistics.median(times)
    return out
