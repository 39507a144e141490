"""The storage tracker (``bp_mech.instruments.tracking``): exact live bytes of the storages a block creates,
views once, what existed before not counted, host-side allocations booked apart, fake tensors,
classes, phases and marks; ``PeakMemory`` on the tracker (CPU) and on the allocator (CUDA)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bp_mech.instruments.tracking import StorageTracker, host_side
from bp_mech.instruments.peak import PeakMemory

N = 1 << 16  # float32 elements: 256 KiB


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
    assert pm.memory_source == "tracked-cpu" and pm.peak.reserved is None
    assert pm.marks == {"three": 3 * 4 * n, "one": 4 * n, "end": 4 * n + 2 * n}
    assert pm.peak.allocated == 3 * 4 * n
    del c


def test_cpu_peak_of_views_counts_the_storage_once():
    with PeakMemory("cpu") as pm:
        x = torch.ones(1000)
        v1, v2 = x[:10], x.view(10, 100)  # noqa: F841 (views share x's storage)
    assert pm.peak.allocated == 4000


def test_cpu_peak_of_a_training_step_is_deterministic():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu", resident=[model.parameters()]) as pm:
            model(x).square().mean().backward()
        peaks.append(pm.peak.allocated)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peaks[0] == peaks[1]
    acts = 2 * 16 * 64 * 4  # the two (16, 64) hidden activations autograd saves
    # at least parameters + all gradients; at most that plus every activation and temporary
    assert 2 * params <= peaks[0] <= 2 * params + acts + 4 * 16 * 8 * 4 + 1024
    assert peaks[0] > params + acts  # the saved activations coexist with the parameters


def test_views_of_storages_that_existed_before_are_not_counted():
    w = torch.ones(256, 256)  # not declared resident
    with PeakMemory("cpu") as pm:
        wt = w.t()  # a view: allocates nothing
        y = wt[:1] * 2  # 1 KiB
    assert pm.peak.allocated == 256 * 4
    del y


def test_in_place_writes_count_what_the_block_allocated_or_declared():
    before, declared = torch.zeros(N), torch.zeros(N)
    with PeakMemory("cpu", resident=[[declared]]) as pm:
        before.add_(1)  # existed before, undeclared: no allocation
        declared.add_(1)  # declared: counted from the start, once
        fresh = torch.zeros(N)
        fresh.mul_(2)  # written in place: still one storage
    assert pm.peak.allocated == 2 * 4 * N
    del fresh


def test_host_side_allocations_are_host_bytes_not_device_bytes():
    """What an offload allocates or writes on the host (inside ``host_side()``) is never device memory,
    as the CUDA allocator does not see pinned host buffers; the tracker books it as host bytes, a
    fresh buffer as well as a reused one (a pool's buffer that existed before the block)."""
    pool_buffer = torch.empty(N)
    with PeakMemory("cpu") as pm:
        a = torch.ones(N)
        with host_side():
            fresh = torch.empty(2 * N)
            fresh[:N].copy_(a)
            pool_buffer.copy_(a)
        b = a + 1
        host = dict(pm.tracker.host)
    assert pm.peak.allocated == 2 * 4 * N  # a and b
    assert sorted(host.values()) == [4 * N, 2 * 4 * N]  # the pool's buffer, the fresh one
    assert pm.tracker.host_depth == 0
    del fresh, b


def test_host_side_tells_every_tracker_on_the_stack():
    with PeakMemory("cpu") as outer, PeakMemory("cpu") as inner:
        a = torch.ones(N)
        with host_side():
            assert outer.tracker.host_depth == inner.tracker.host_depth == 1
            h = torch.ones(4 * N)
    assert outer.peak.allocated == inner.peak.allocated == 4 * N
    assert outer.tracker.host_depth == inner.tracker.host_depth == 0
    del a, h


def test_fake_tensors_are_counted_by_storage_identity():
    """Fake tensors have shapes and bytes but no memory (every ``data_ptr`` is 0): storages are told
    apart by identity, so views count once and distinct storages count apart; host_side works too."""
    with FakeTensorMode():
        tr = StorageTracker("cpu")
        with tr:
            a = torch.ones(1000)
            v = a.view(10, 100)  # noqa: F841 (a view: nothing new)
            b = a * 2  # a second 4000-byte storage at the same (fake) address
            peak_with_b = tr.current
            del b
            with host_side():
                h = torch.empty(500)  # host memory
            c = torch.ones(10)
    assert peak_with_b == 8000 and tr.peak == 8000 and tr.current == 4040
    assert list(tr.host.values()) == [2000]
    del a, c, h


def test_classes_follow_where_a_storage_is_born_and_its_role():
    tr = StorageTracker("cpu")
    weight = torch.ones(N)
    tr.add(weight, "parameters")
    with tr:
        tr.start("forward")
        half = weight.to(torch.float16)  # autocast's low-precision copy of a parameter
        saved = weight * 2  # alive at the end of the forward: saved for backward
        tmp = saved + 1
        del tmp  # a temporary of the forward
        tr.region = "loss"
        logits = saved * 3
        tr.end_forward()
        tr.mark("forward")
        tr.start("backward")
        grad = torch.ones(N)
        tr.relabel(grad, "gradients")
        tr.start("idle")
    classes = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")
    assert tr.classify(tr.marks["forward"][1], classes) == dict(
        parameters=4 * N + 2 * N, gradients=0, optimizer_states=0, saved_activations=4 * N, logits_loss=4 * N, other=0)
    assert tr.classify(list(tr.live), classes)["gradients"] == 4 * N
    with pytest.raises(KeyError):  # a class the caller does not list is an error, not a silent drop
        tr.classify(list(tr.live), ("parameters",))
    del half, saved, logits, grad


def test_a_storage_born_where_a_dead_one_was_is_counted_anew():
    """Storages are told apart by identity, and a dead storage's ``id`` is free for the next one: each new
    storage counts, whatever ``id`` it gets (the tracker forgets a storage when it dies)."""
    tr = StorageTracker("cpu")
    with tr:
        for _ in range(20):
            x = torch.ones(N)
            del x
        y = torch.ones(N)
        assert tr.current == 4 * N and tr.peak == 4 * N and len(tr.nbytes) == 21
        assert tr.serial[y.untyped_storage()] == 20
    del y
    assert tr.current == 0 and not tr.live


def test_phase_peaks_and_marks_snapshot_the_live_set():
    tr = StorageTracker("cpu")
    with tr:
        tr.start("forward")
        a, b = torch.ones(N), torch.ones(N)
        del b
        tr.mark("forward", host=123)
        tr.start("idle")
    serial_a = tr.serial[a.untyped_storage()]
    assert tr.peaks["forward"][0] == 2 * 4 * N and len(tr.peaks["forward"][1]) == 2
    assert tr.marks["forward"] == (4 * N, [serial_a], 123) and tr.peak == 2 * 4 * N
    del a


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_and_empty_outputs_are_not_storages():
    """A sparse tensor has no storage to ask for (``untyped_storage()`` raises): the tracker passes it
    by; its indices and values, made before the block, are not counted."""
    idx, val = torch.tensor([[0, 1], [1, 0]]), torch.ones(2)
    with PeakMemory("cpu") as pm:
        s = torch.sparse_coo_tensor(idx, val, (2, 2))
        e = torch.empty(0)
    assert pm.peak.allocated == 0
    del s, e


CUDA_CALLS = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
              "max_memory_reserved")


def test_peak_memory_on_cuda_reads_the_allocator_and_tracks_nothing(monkeypatch):
    """On CUDA the allocator is the truth: reset before, read after (synchronized), no tracker."""
    log = []
    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: log.append(_n) or 1000 * len(log))
    with PeakMemory("cuda") as pm:
        x = torch.ones(N)  # (on the CPU here: the allocator readings are what counts)
        assert pm.mark("inside") == 3000
    assert pm.tracker is None and pm.memory_source == "cuda-allocator"
    assert log == ["synchronize", "reset_peak_memory_stats", "memory_allocated", "synchronize",
                   "max_memory_allocated", "max_memory_reserved"]
    assert (pm.peak.allocated, pm.peak.reserved, pm.marks) == (5000, 6000, {"inside": 3000})
    del x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracker_and_allocator_agree_on_cuda():
    """Tensors of whole 512-byte blocks: the tracked live bytes and the allocator's allocated bytes
    move together, and the tracker's peak is the allocator's (a block's worth of rounding aside)."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    tr = StorageTracker(dev)
    with tr:
        a = torch.ones(N, device=dev)
        b = a * 2
        del b
        c = torch.ones(N // 2, device=dev)
    torch.cuda.synchronize()
    assert tr.current == torch.cuda.memory_allocated(dev) - base == 4 * N + 2 * N
    assert tr.peak == torch.cuda.max_memory_allocated(dev) - base == 2 * 4 * N
    del a, c
