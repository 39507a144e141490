import pytest
import torch

from bp_mech.measure import PeakMemory, all_finite, guarded, measure_steps, percentile, summarize, time_steps


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


def test_cpu_peak_tracks_live_and_freed_tensors_exactly():
    n = 1 << 16
    keep = torch.zeros(n)  # resident, 256 KiB
    with PeakMemory("cpu", resident=[[keep]]) as pm:
        a = torch.ones(n)  # +256 KiB
        b = a * 2  # +256 KiB -> live 768 KiB
        pm.mark("three")
        del a, b
        pm.mark("one")
        c = torch.ones(n // 2)  # +128 KiB
        pm.mark("end")
    assert pm.memory_source == "tracked-cpu" and pm.peak_reserved is None
    assert pm.marks == {"three": 3 * 4 * n, "one": 4 * n, "end": 4 * n + 2 * n}
    assert pm.peak_allocated == 3 * 4 * n
    del c


def test_cpu_peak_of_views_counts_the_storage_once():
    with PeakMemory("cpu") as pm:
        x = torch.ones(1000)
        v1, v2 = x[:10], x.view(10, 100)  # noqa: F841 (views share x's storage)
    assert pm.peak_allocated == 4000


def test_cpu_peak_of_a_training_step_is_deterministic():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu", resident=[model.parameters()]) as pm:
            model(x).square().mean().backward()
        peaks.append(pm.peak_allocated)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peaks[0] == peaks[1]
    acts = 2 * 16 * 64 * 4  # the two (16, 64) hidden activations autograd saves
    # at least parameters + all gradients; at most that plus every activation and temporary
    assert 2 * params <= peaks[0] <= 2 * params + acts + 4 * 16 * 8 * 4 + 1024
    assert peaks[0] > params + acts  # the saved activations coexist with the parameters


def test_measure_steps_reports_peak_and_timing():
    t = torch.randn(64, 64)
    stats = measure_steps(lambda i: (t @ t).sum(), steps=4, warmup=1)
    assert stats.memory_source == "tracked-cpu" and stats.peak_allocated >= 64 * 64 * 4
    assert stats.timing.warmup_excluded == 1 and len(stats.timing.samples) == 3


def test_finiteness_and_guarded_oom():
    assert all_finite([torch.ones(3), None]) and not all_finite([torch.tensor([1.0, float("inf")])])

    def boom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    res, failure = guarded(boom)
    assert res is None and failure.startswith("out of memory")
    assert guarded(lambda: 3) == (3, None)


def test_guarded_frees_after_the_failed_call_let_go(monkeypatch):
    """empty_cache inside the except block would run while the traceback still holds the
    failed candidate's tensors; ``free`` must run after they are gone."""
    import weakref

    from bp_mech import measure

    ref, seen = {}, []

    def oom():
        t = torch.empty(1000)
        ref["t"] = weakref.ref(t)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(measure, "free", lambda device: seen.append(ref["t"]() is None))
    assert guarded(oom)[1].startswith("out of memory") and seen == [True]


def test_views_of_storages_that_existed_before_are_not_counted():
    w = torch.ones(256, 256)  # not declared resident
    with PeakMemory("cpu") as pm:
        wt = w.t()  # a view: allocates nothing
        y = wt[:1] * 2  # 1 KiB
    assert pm.peak_allocated == 256 * 4
    del y


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
    from bp_mech.measure import is_allocation_failure

    assert is_allocation_failure(exc)

    def fail():
        raise exc

    res, failure = guarded(fail)
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
    from bp_mech.measure import is_allocation_failure

    assert not is_allocation_failure(exc)

    def fail():
        raise exc

    with pytest.raises(type(exc)):
        guarded(fail)


def test_guarded_frees_after_a_non_oom_allocation_failure_let_go(monkeypatch):
    import weakref

    from bp_mech import measure

    ref, seen = {}, []

    def pinned_alloc_fails():
        t = torch.empty(1000)
        ref["t"] = weakref.ref(t)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(measure, "free", lambda device: seen.append(ref["t"]() is None))
    assert guarded(pinned_alloc_fails)[1].startswith("allocation failed (RuntimeError)") and seen == [True]
