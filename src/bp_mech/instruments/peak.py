"""The peak memory of a block of code: the CUDA allocator's counters, or the storage tracker on the CPU.

``PeakMemory`` is the one peak-memory tool of the package (its ``memory_source`` says which it read);
``fmt_bytes`` writes a size in the unit it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils._pytree import tree_leaves

from bp_mech.instruments.tracking import StorageTracker


@dataclass(frozen=True)
class Peak:
    """The peak of a block of code: what ``PeakMemory`` found."""

    allocated: int  # bytes: the allocator's peak (CUDA) or the tracked storages' (CPU)
    reserved: int | None  # bytes the CUDA caching allocator reserved at most (None on the CPU)
    source: str  # "cuda-allocator" | "tracked-cpu"

    def record_fields(self) -> dict:
        """The memory fields of a result record."""
        return dict(peak_allocated=self.allocated, peak_reserved=self.reserved, memory_source=self.source)


class PeakMemory:
    """Peak memory of a block of code, on CUDA (allocator) or CPU (tracked storages).

    Usage::

        with PeakMemory(device, resident=[model.parameters()]) as pm:
            loss = model(**batch).loss; loss.backward()
        pm.peak  # Peak(allocated, reserved, source)

    ``resident`` lists tensors that exist before the block and count towards the peak
    (parameters, optimizer state); on the CPU they are tracked like the rest, on CUDA the
    allocator already sees them. ``mark(name)`` records the live bytes at a point.
    """

    def __init__(self, device="cpu", resident: Iterable = ()) -> None:
        self.device = torch.device(device)
        self.resident = list(resident)
        self.peak: Peak | None = None  # set when the block ends
        self.marks: dict[str, int] = {}
        self.tracker: StorageTracker | None = None  # CPU only

    @property
    def memory_source(self) -> str:
        return "cuda-allocator" if self.device.type == "cuda" else "tracked-cpu"

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.tracker.current if self.tracker else 0

    def mark(self, name: str) -> int:
        self.marks[name] = self.current()
        return self.marks[name]

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker = StorageTracker(self.device)
            for group in self.resident:
                for t in tree_leaves(list(group) if not isinstance(group, torch.Tensor) else group):
                    self.tracker.add(t)
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = Peak(torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device),
                             self.memory_source)
        else:
            self.tracker.__exit__(*exc)
            self.peak = Peak(self.tracker.peak, None, self.memory_source)


def fmt_bytes(n: int | float | None) -> str:
    """Bytes in the unit the size needs (GiB, MiB, KiB, B); "–" for None.

    Example:
        >>> fmt_bytes(3 * 2**30), fmt_bytes(1536 * 2**10), fmt_bytes(100), fmt_bytes(None)
        ('3.00 GiB', '1.50 MiB', '100 B', '–')
    """
    if n is None:
        return "–"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"
