"""``bench.oom``: an allocation failure is an arm's ``Failed``; every other error propagates."""

import pytest
import torch

from bp_mech.bench.oom import Failed, attempt


def test_attempt_gives_the_result_or_a_failed():
    def boom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    r = attempt(boom)
    assert isinstance(r, Failed) and r.failure.startswith("out of memory") and r.name == ""
    assert attempt(lambda: 3) == 3
    assert attempt(lambda x, y=0: x + y, 1, y=2) == 3


def test_attempt_releases_memory_after_the_failed_call_let_go(monkeypatch):
    """empty_cache inside the except block would run while the traceback still holds the
    failed candidate's tensors; ``release_memory`` must run after they are gone."""
    import weakref

    from bp_mech.bench import oom as measure

    ref, seen = {}, []

    def oom():
        t = torch.empty(1000)
        ref["t"] = weakref.ref(t)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(measure, "release_memory", lambda device: seen.append(ref["t"]() is None))
    assert attempt(oom).failure.startswith("out of memory") and seen == [True]


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA driver error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
    RuntimeError("CUDA error: cudaErrorMemoryAllocation"),
    RuntimeError("Error in cudaHostAlloc: out of memory (pinned host buffer)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 4294967296 bytes"),
    torch.AcceleratorError("CUDA error: out of memory"),
    MemoryError(),
])
def test_allocation_failures_are_recognised_whatever_their_class(exc):
    from bp_mech.bench.oom import is_allocation_failure

    assert is_allocation_failure(exc)

    def fail():
        raise exc

    r = attempt(fail)
    assert isinstance(r, Failed)
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):
        assert r.failure == f"out of memory: {first}"
    else:
        assert r.failure == f"allocation failed ({type(exc).__name__}): {first}"


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"),
    RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned"),
    ValueError("out of memory"),  # not an error a torch allocator raises: a bug, and it propagates
    KeyError("cudaHostAlloc"),
])
def test_other_errors_are_not_allocation_failures_and_propagate(exc):
    from bp_mech.bench.oom import is_allocation_failure

    assert not is_allocation_failure(exc)

    def fail():
        raise exc

    with pytest.raises(type(exc)):
        attempt(fail)


def test_attempt_releases_memory_after_a_non_oom_allocation_failure_let_go(monkeypatch):
    import weakref

    from bp_mech.bench import oom as measure

    ref, seen = {}, []

    def pinned_alloc_fails():
        t = torch.empty(1000)
        ref["t"] = weakref.ref(t)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(measure, "release_memory", lambda device: seen.append(ref["t"]() is None))
    assert attempt(pinned_alloc_fails).failure.startswith("allocation failed (RuntimeError)") and seen == [True]
