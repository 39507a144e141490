import pytest
import torch

from bp_mech.bench.compare import all_finite
from bp_mech.bench.timing import measure_steps, percentile, summarize, time_steps
from bp_mech.bench.oom import oom_as_failure


def test_percentile_and_warmup_exclusion():
    samples = [10.0] + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 100.0]
    t = summarize(samples, warmup=1)
    assert t.warmup_excluded == 1 and len(t.samples) == 10
    assert t.median_s == 5.5 and t.p95_s == 100.0
    assert percentile([3, 1, 2], 50) == 2
    with pytest.raises(ValueError):
        summarize([1.0], warmup=1)


def test_time_steps_counts_every_call():
    calls = []
    t = time_steps(calls.append, steps=5, warmup=2)
    assert calls == [0, 1, 2, 3, 4] and len(t.samples) == 3 and t.p95_s >= t.median_s > 0


def test_measure_steps_reports_peak_and_timing():
    t = torch.randn(64, 64)
    stats = measure_steps(lambda i: (t @ t).sum(), steps=4, warmup=1)
    assert stats.memory_source == "tracked-cpu" and stats.peak_allocated >= 64 * 64 * 4
    assert stats.timing.warmup_excluded == 1 and len(stats.timing.samples) == 3


def test_finiteness_and_oom_as_failure():
    assert all_finite([torch.ones(3), None]) and not all_finite([torch.tensor([1.0, float("inf")])])

    def boom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    res, failure = oom_as_failure(boom)
    assert res is None and failure.startswith("out of memory")
    assert oom_as_failure(lambda: 3) == (3, None)


def test_oom_as_failure_releases_memory_after_the_failed_call_let_go(monkeypatch):
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
    assert oom_as_failure(oom)[1].startswith("out of memory") and seen == [True]


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

    res, failure = oom_as_failure(fail)
    assert res is None
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):
        assert failure == f"out of memory: {first}"
    else:
        assert failure == f"allocation failed ({type(exc).__name__}): {first}"


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
        oom_as_failure(fail)


def test_oom_as_failure_releases_memory_after_a_non_oom_allocation_failure_let_go(monkeypatch):
    import weakref

    from bp_mech.bench import oom as measure

    ref, seen = {}, []

    def pinned_alloc_fails():
        t = torch.empty(1000)
        ref["t"] = weakref.ref(t)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(measure, "release_memory", lambda device: seen.append(ref["t"]() is None))
    assert oom_as_failure(pinned_alloc_fails)[1].startswith("allocation failed (RuntimeError)") and seen == [True]
