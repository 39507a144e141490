"""Out of memory is an arm's failure, not the run's: ``attempt`` gives the result or a ``Failed``.

``release_memory`` returns memory between arms (garbage, and the CUDA allocator's cached blocks).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Failed:
    """What could not run, and why, in words: an allocation that failed (``attempt``: an arm's ``failure``), or
    a step the fake trace could not run (``planner.trace.traced``: the strategy is left out of the plan)."""

    failure: str  # "out of memory: ...", "allocation failed (Class): ..." or the exception in one line
    name: str = ""  # the arm, where there is one


def release_memory(device) -> None:
    """Collect garbage and, on CUDA, return the allocator's cached blocks (before a new candidate)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# Allocation failures that do not arrive as torch.OutOfMemoryError. The caching allocator raises
# OutOfMemoryError, but other allocators report through a plain RuntimeError (torch.AcceleratorError
# on CUDA) whose message names the failed call: a pinned host buffer (cudaHostAlloc in the
# CachingHostAllocator), cuBLAS/cuDNN workspaces, a CUDA call that returned cudaErrorMemoryAllocation,
# the CPU allocator. Matched case-insensitively; "illegal memory access" and the like do not match.
ALLOCATION_FAILURE_MARKERS = (
    "out of memory",  # "CUDA error: out of memory", "CUDA driver error: out of memory"
    "cudaerrormemoryallocation",  # the CUDA runtime's error name
    "cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
    "cudnn_status_alloc_failed",  # cuDNN could not allocate
    "cudnn_status_not_enough_workspace",  # cuDNN's workspace did not fit
    "cudahostalloc", "cudamallochost", "cumemhostalloc",  # a pinned host buffer could not be allocated
    "can't allocate memory",  # DefaultCPUAllocator (host RAM), e.g. an offload's host copies
)


def is_allocation_failure(exc: BaseException) -> bool:
    """True when ``exc`` says memory could not be allocated (device or host), whatever its class:
    ``torch.OutOfMemoryError``, Python's ``MemoryError``, or a ``RuntimeError`` whose message holds
    one of ``ALLOCATION_FAILURE_MARKERS``. Any other exception is a bug and must propagate."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(m in text for m in ALLOCATION_FAILURE_MARKERS)


def attempt(fn: Callable[..., T], *args, **kwargs) -> T | Failed:
    """Run ``fn``; return its result, or a ``Failed`` when an allocation failed.

    One arm running out of memory is that arm's failure; the run goes on. That covers
    ``torch.OutOfMemoryError`` and the allocation failures that come as other errors
    (``is_allocation_failure``: pinned host memory, cuBLAS/cuDNN workspaces, host RAM); the failure
    says which (``out of memory: ...`` or ``allocation failed (Class): ...``). Every other exception
    propagates. The memory is released after the except block, once the traceback (and every tensor
    its frames hold) is gone; inside it, ``empty_cache`` could return nothing.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (re-raised unless it is an allocation failure)
        if not is_allocation_failure(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        failure = (f"out of memory: {first}" if isinstance(e, torch.OutOfMemoryError)
                   else f"allocation failed ({type(e).__name__}): {first}")
    release_memory("cuda" if torch.cuda.is_available() else "cpu")
    return Failed(failure)
