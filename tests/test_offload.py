"""Part 02 · 42, the mechanism: offload leaves loss and every gradient equal; the hooks' D2H/H2D byte
counts agree with an independent count of the saved activations, with real and with fake tensors;
parameters and tiny tensors stay; the pool is reused. The side-stream protocol: tests/test_offload_streams.py;
the exercise checks against the classic mistakes: tests/test_offload_checks.py; the experiment's tests:
tests/experiments/test_offload.py."""

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from bp_mech import checkpointing, offload
from bp_mech.instruments import counters
from bp_mech.bench.compare import compare
from bp_mech.instruments.tracking import host_side
from bp_mech.instruments.peak import PeakMemory
from bp_mech.instruments.workload import qwen2_config
from conftest import hooked_probe, hooked_step

MIN = offload.CPU_MIN_BYTES


def _count_saved(model, batch, setup="plain") -> counters.SavedBytesCounter:
    """The independent count: a counting-only hooks pass (nothing moved), under ``setup``'s checkpointing."""
    counter = counters.SavedBytesCounter(model.parameters())
    with checkpointing.configure(model, setup), counter:
        model(**batch).loss
    return counter


def test_offload_leaves_loss_and_every_gradient_bitwise_equal(tiny):
    model, batches = tiny
    ref = hooked_probe(model, batches[0])
    ours = lambda: offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))  # noqa: E731
    for hooks, setup in ((ours(), "plain"), (offload.CountingSaveOnCpu(), "plain"), (ours(), "checkpoint-all")):
        with checkpointing.configure(model, setup):
            got = hooked_probe(model, batches[0], hooks)
        c = compare(ref, got)
        assert c.bitwise and c.grad_error == 0.0, (type(hooks).__name__, setup, c)


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_d2h_bytes_equal_the_independently_counted_saved_activations(tiny, setup):
    model, batches = tiny
    counted = _count_saved(model, batches[0], setup)
    off = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))
    with checkpointing.configure(model, setup):
        hooked_step(model, batches[0], off)
    assert off.d2h_bytes == counted.bytes_at_least(MIN) > 0
    assert 0 < counted.bytes - off.d2h_bytes <= off.kept_small_bytes  # the rest: tiny ones (kept per saved tensor)
    assert off.h2d_bytes >= off.d2h_bytes  # every moved storage comes back
    assert off.kept_params > 0 and off.shared_views > 0  # the model saves weights and views


def test_save_on_cpu_copies_every_saved_tensor(tiny):
    model, batches = tiny
    counted = _count_saved(model, batches[0])
    soc = offload.CountingSaveOnCpu()
    hooked_step(model, batches[0], soc)
    assert soc.d2h_bytes == soc.h2d_bytes == counted.tensor_bytes  # parameters and each view included
    assert soc.d2h_bytes > counted.bytes


def test_parameters_views_and_tiny_tensors():
    w = nn.Parameter(torch.randn(64, 64))
    off = offload.ActivationOffload([w], offload.OffloadConfig(min_bytes=1024))
    for t in (w, w.t(), torch.randn(8)):
        assert off._unpack(off._pack(t)) is t
    assert off.d2h_bytes == 0 and off.kept_params == 2 and off.kept_small == 1
    base = torch.randn(32, 64)
    views = [base[:, :32], base.view(-1), base.t()]
    packed = [off._pack(v) for v in views]
    assert off.d2h_bytes == base.untyped_storage().nbytes() and off.shared_views == 2
    for v, p in zip(views, packed):
        out = off._unpack(p)
        assert torch.equal(out, v) and out.stride() == v.stride()
    assert off.h2d_bytes == off.d2h_bytes  # the views of one storage come back with one copy


def test_host_pool_is_reused_across_steps(tiny):
    model, batches = tiny
    off = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))
    hooked_step(model, batches[0], off)
    allocs, allocated = off.pool.allocations, off.pool.allocated
    for i in range(3):
        hooked_step(model, batches[i % 2], off)
    assert (off.pool.allocations, off.pool.allocated) == (allocs, allocated)
    assert allocated == off.d2h_bytes


def test_cpu_peak_is_the_device_side_and_host_bytes_are_reported(tiny):
    model, batches = tiny
    peaks = {}
    # the tracker observes the host side through the region the offload makes its copies in
    ours = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN), host_region=host_side)
    for name, hooks in (("plain", None), ("offload", ours)):
        with PeakMemory("cpu", resident=[model.parameters()]) as pm:
            hooked_step(model, batches[0], hooks)
        peaks[name] = pm.peak.allocated
    assert peaks["offload"] < peaks["plain"]
    assert hooks.pool.high_water == hooks.d2h_bytes > 0


# --- fake tensors: storages told apart by identity (every fake data_ptr() is 0) -------------


def _known_saves_step():
    """One forward + backward whose saves are known: x*2 and the parameter w (matmul), a view of h's
    storage (b), sigmoid's output twice (sigmoid and mul)."""
    x = torch.randn(64, 64, requires_grad=True)
    w = nn.Parameter(torch.randn(64, 64))
    off = offload.ActivationOffload([w], offload.OffloadConfig(min_bytes=1024))
    with off:
        h = (x * 2) @ w  # saves x*2 (16 KiB) and w (a parameter: stays)
        a, b = h.chunk(2, -1)  # two views of h's storage (16 KiB)
        loss = (a.sigmoid() * b).sum()  # sigmoid saves its output (8 KiB); mul saves it again, and b
    loss.backward()
    return off


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake-tensors"])
def test_offload_packs_per_storage_with_real_and_fake_tensors(fake):
    with FakeTensorMode() if fake else contextlib.nullcontext():
        off = _known_saves_step()
    n = 64 * 64 * 4
    assert off.d2h_bytes == off.h2d_bytes == n + n + n // 2  # x*2, h (once, for b), sigmoid's output (once)
    assert off.kept_params == 1 and off.offloaded == 4 and off.shared_views == 1 and len(off._order) == 3


def _qwen2_step(fake: bool, setup: str):
    """The tiny Qwen2 (random init; under ``FakeTensorMode`` nothing is allocated): the offload's and the
    counting pass's view of one forward (+ backward for the offload)."""
    from transformers import Qwen2ForCausalLM

    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(qwen2_config("tiny")).train()
        ids = torch.randint(0, 256, (2, 32))
        batch = dict(input_ids=ids, labels=ids.clone(), attention_mask={"full_attention": None})  # causal, no mask
        counted = _count_saved(model, batch, setup)
        off = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))
        with checkpointing.configure(model, setup):
            with off:
                loss = model(**batch).loss
            loss.backward()
    return off, counted


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_offload_of_a_fake_qwen2_moves_what_the_real_one_moves(setup):
    real, real_counted = _qwen2_step(False, setup)
    fake, fake_counted = _qwen2_step(True, setup)
    assert fake.d2h_bytes == fake_counted.bytes_at_least(MIN) == real.d2h_bytes == real_counted.bytes_at_least(MIN) > 0
    assert fake_counted.storages and sorted(fake_counted.storages.values()) == sorted(real_counted.storages.values())
    def fates(off):  # saved tensors by fate, and the bytes copied back
        return off.offloaded, off.shared_views, off.kept_params, off.kept_small, off.kept_small_bytes, off.h2d_bytes

    assert fates(fake) == fates(real) and real.shared_views > 0 and real.kept_params > 0
