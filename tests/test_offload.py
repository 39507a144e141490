"""Part 02 · 42, the mechanism: offload leaves loss and every gradient equal; the hooks' D2H/H2D byte
counts agree with an independent count of the saved activations, with real and with fake tensors;
parameters and tiny tensors stay; the pool is reused; the side-stream protocol holds (simulated
streams); and the ex42 checks catch the classic mistakes (mutants). The experiment's tests:
tests/experiments/test_offload.py."""

import contextlib
import weakref

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from bp_mech import checkpointing, offload
from bp_mech.bench import counters
from bp_mech.experiments import harness
from bp_mech.bench.tracking import PeakMemory
from bp_mech.bench.workload import build_model, make_batches, parse_workload, qwen2_config
from bp_mech.checks import ex42
from conftest import ROOT, load_solution

MIN = offload.CPU_MIN_BYTES


@pytest.fixture(scope="module")
def tiny():
    w = parse_workload("tiny-b2s32")
    return build_model(w), make_batches(w, 2)


def _count_saved(model, batch, setup="plain") -> counters.SavedBytesCounter:
    """The independent count: a counting-only hooks pass (nothing moved), under ``setup``'s checkpointing."""
    counter = counters.SavedBytesCounter(model.parameters())
    with checkpointing.configure(model, setup), counter:
        model(**batch).loss
    return counter


def test_offload_leaves_loss_and_every_gradient_bitwise_equal(tiny):
    model, batches = tiny
    ref = harness.probe(model, batches[0], "cpu")
    ours = lambda: offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))  # noqa: E731
    for hooks, setup in ((ours(), "plain"), (offload.CountingSaveOnCpu(), "plain"), (ours(), "checkpoint-all")):
        with checkpointing.configure(model, setup):
            got = harness.probe(model, batches[0], "cpu", hooks)
        c = harness.compare(ref, got)
        assert c["bitwise"] and c["grad_error"] == 0.0, (type(hooks).__name__, setup, c)


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_d2h_bytes_equal_the_independently_counted_saved_activations(tiny, setup):
    model, batches = tiny
    counted = _count_saved(model, batches[0], setup)
    off = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))
    with checkpointing.configure(model, setup):
        harness.train_step(model, batches[0], off)
    assert off.d2h_bytes == counted.bytes_at_least(MIN) > 0
    assert 0 < counted.bytes - off.d2h_bytes <= off.kept_small_bytes  # the rest: tiny ones (kept per saved tensor)
    assert off.h2d_bytes >= off.d2h_bytes  # every moved storage comes back
    assert off.kept_params > 0 and off.shared_views > 0  # the model saves weights and views


def test_save_on_cpu_copies_every_saved_tensor(tiny):
    model, batches = tiny
    counted = _count_saved(model, batches[0])
    soc = offload.CountingSaveOnCpu()
    harness.train_step(model, batches[0], soc)
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
    harness.train_step(model, batches[0], off)
    allocs, allocated = off.pool.allocations, off.pool.allocated
    for i in range(3):
        harness.train_step(model, batches[i % 2], off)
    assert (off.pool.allocations, off.pool.allocated) == (allocs, allocated)
    assert allocated == off.d2h_bytes


def test_cpu_peak_is_the_device_side_and_host_bytes_are_reported(tiny):
    model, batches = tiny
    peaks = {}
    ours = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN))
    for name, hooks in (("resident", None), ("offload", ours)):
        with PeakMemory("cpu", resident=[model.parameters()]) as pm:
            harness.train_step(model, batches[0], hooks)
        peaks[name] = pm.peak_allocated
    assert peaks["offload"] < peaks["resident"]
    assert hooks.pool.high_water == hooks.d2h_bytes > 0


def test_nullcontext_when_off(tiny):
    assert isinstance(offload.offload_activations([], enabled=False), contextlib.nullcontext)
    assert isinstance(offload.offload_activations([]), offload.ActivationOffload)


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


# --- the CUDA stream protocol, simulated on the CPU -------------------------------------


class _Event:
    def __init__(self, fake, pos=0):
        self.fake, self.pos = fake, pos  # pos: copies queued on the side stream before the event

    def record(self, stream=None):
        self.pos = len(self.fake.queue) if (stream or self.fake.current) is self.fake.side else 0


class _Stream:
    def __init__(self, fake):
        self.fake, self.waited_for_compute = fake, 0

    def wait_stream(self, other):  # the compute stream runs eagerly: the side stream only counts the wait
        self.waited_for_compute += other is self.fake.compute

    def record_event(self):
        ev = _Event(self.fake)
        ev.record(self)
        return ev

    def wait_event(self, ev):
        if self is self.fake.compute:
            self.fake.run_until(ev.pos)


class FakeStreams:
    """CUDA streams simulated on the CPU so that a missing synchronisation shows as wrong numbers.

    The compute stream runs eagerly. A copy issued on the side stream is queued and runs only when
    the compute stream waits for an event recorded after it; until then its destination holds 0xFF
    bytes (NaN in float32). A source tensor dropped before its copy ran is an error: on a GPU its
    block could already hold the next kernel's output.
    """

    def __init__(self, monkeypatch):
        self.compute, self.side = _Stream(self), _Stream(self)
        self.current, self.queue, self.ran, self.record_streams = self.compute, [], 0, []
        copy = self._copy = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            if self.current is not self.side:
                return copy(dst, src, non_blocking=non_blocking)
            assert dst.dtype == torch.uint8
            dst.fill_(255)  # undefined until the copy runs
            self.queue.append((dst, weakref.ref(src)))
            return dst

        @contextlib.contextmanager
        def stream(s):
            prev, self.current = self.current, s
            try:
                yield
            finally:
                self.current = prev

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: self.record_streams.append(s))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(self))

    def run_until(self, pos):
        while self.ran < pos:
            dst, src = self.queue[self.ran]
            assert src() is not None, "a copy's source was dropped before the copy ran"
            self._copy(dst, src())
            self.queue[self.ran], self.ran = None, self.ran + 1


class _Watched(offload.ActivationOffload):
    def _reset(self):
        super()._reset()
        self.most_in_flight = 0

    def _offload(self, storage, version):
        slot = super()._offload(storage, version)
        self.most_in_flight = max(self.most_in_flight, len(self._stash))
        return slot


def _on_fake_streams(cls, model, monkeypatch, **cfg):
    fake = FakeStreams(monkeypatch)
    off = cls(model.parameters(), offload.OffloadConfig(min_bytes=MIN, **cfg))
    off.stream = fake.side  # the CUDA branch of every hook, on the CPU
    return fake, off


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_stream_protocol_leaves_every_gradient_bitwise_equal(tiny, monkeypatch, setup):
    model, batches = tiny
    ref = harness.probe(model, batches[0], "cpu")
    fake, off = _on_fake_streams(_Watched, model, monkeypatch, inflight=2, prefetch=2)
    with checkpointing.configure(model, setup):
        for i in range(2):  # the host pool is reused from the second step on
            harness.train_step(model, batches[(i + 1) % 2], off)
            assert fake.ran == len(fake.queue) and not off._stash  # no copy left behind after a step
        fake.side.waited_for_compute, fake.record_streams = 0, []  # count the probe's step only
        got = harness.probe(model, batches[0], "cpu", off)
    c = harness.compare(ref, got)
    assert c["bitwise"] and got["finite"], c
    d2h = len(off._order)
    assert fake.side.waited_for_compute == d2h  # every D2H copy starts after its producer
    assert 0 < off.most_in_flight <= 2  # the compute stream runs at most `inflight` copies ahead
    assert off.pool.allocations == d2h  # one step's buffers, reused afterwards
    assert len(fake.record_streams) == off.offloaded and set(map(id, fake.record_streams)) == {id(fake.compute)}


def test_stream_protocol_catches_a_buffer_used_before_its_copy(tiny, monkeypatch):
    """Mutant: the compute stream waits on an event that does not cover the H2D copy."""
    model, batches = tiny
    ref = harness.probe(model, batches[0], "cpu")

    class NoWaitBeforeUse(offload.ActivationOffload):
        def _fetch(self, slot):
            super()._fetch(slot)
            slot.event = _Event(fake, pos=0)  # already complete: covers nothing

    fake, off = _on_fake_streams(NoWaitBeforeUse, model, monkeypatch)
    got = harness.probe(model, batches[0], "cpu", off)
    c = harness.compare(ref, got)
    assert not got["finite"] and not c["bitwise"] and c["grad_error"] == float("inf")


def test_stream_protocol_catches_a_source_dropped_before_its_copy(tiny, monkeypatch):
    """Mutant: the D2H sources are dropped without the compute stream waiting for their copies."""
    model, batches = tiny

    class DropsSources(offload.ActivationOffload):
        def _drain(self, keep):
            self._stash.clear()

    fake, off = _on_fake_streams(DropsSources, model, monkeypatch)
    with pytest.raises(AssertionError, match="dropped before the copy ran"):
        harness.train_step(model, batches[0], off)


# --- the package's offload passes the exercise checks; the checks catch the mistakes ------


class _PackageOffload(offload.ActivationOffload):
    def __init__(self, params, min_bytes=1024):
        super().__init__(params, offload.OffloadConfig(min_bytes=min_bytes))
        self.pack, self.unpack = self._pack, self._unpack


@pytest.mark.parametrize("check", ex42.CHECKS, ids=lambda c: c.__name__)
def test_package_offload_passes_the_ex42_checks(check):
    check(type("Sol", (), {"CountingOffload": _PackageOffload}))


class _Base(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, params, min_bytes=1024):
        self.params, self.min_bytes, self.d2h_bytes, self.h2d_bytes = list(params), min_bytes, 0, 0
        super().__init__(self.pack, self.unpack)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, meta = packed
        self.h2d_bytes += host.untyped_storage().nbytes()
        dev = host.clone()
        return torch.empty(0, dtype=meta[0]).set_(dev.untyped_storage(), *meta[1:])

    def _move(self, t):
        self.d2h_bytes += t.untyped_storage().nbytes()
        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()
        return raw, (t.dtype, t.storage_offset(), t.size(), t.stride())


class _OffloadsParameters(_Base):  # no parameter rule
    def pack(self, t):
        return t if t.untyped_storage().nbytes() < self.min_bytes else self._move(t)


class _CountsViewsTwice(_Base):  # one copy per saved tensor, views of one storage included
    def pack(self, t):
        ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        if t.untyped_storage().data_ptr() in ptrs or t.untyped_storage().nbytes() < self.min_bytes:
            return t
        return self._move(t)


class _KeepsTheOriginal(_Base):  # counts and copies, but the packed object holds t too
    def pack(self, t):
        ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        if t.untyped_storage().data_ptr() in ptrs or t.untyped_storage().nbytes() < self.min_bytes:
            return t
        self.d2h_bytes += t.untyped_storage().nbytes()
        return t

    def unpack(self, packed):
        self.h2d_bytes += 0 if packed.untyped_storage().nbytes() < self.min_bytes else packed.untyped_storage().nbytes()
        return packed


_ANSWER = load_solution(ROOT / "answers", "ex42_offload").CountingOffload  # right; each mutant breaks one rule


class _LazyParams(_ANSWER):  # keeps the iterable it was given: a generator is empty from the second pack on
    def __init__(self, params, min_bytes=1024):
        super().__init__([], min_bytes)
        self.params = params

    def pack(self, t):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        return super().pack(t)


class _KeepsAtTheLimit(_ANSWER):  # <= instead of <: a storage of exactly min_bytes stays
    def pack(self, t):
        return t if t.untyped_storage().nbytes() <= self.min_bytes else super().pack(t)


class _SizeOfTheView(_ANSWER):  # the view's bytes decide, not its storage's: a small view of a big storage stays
    def pack(self, t):
        return t if t.numel() * t.element_size() < self.min_bytes else super().pack(t)


class _EightBytesPerElement(_ANSWER):  # elements times 8 for the size and the count: right for float64 only
    def pack(self, t):
        n = t.untyped_storage().nbytes()
        if n // t.element_size() * 8 < self.min_bytes:
            return t
        before = self.d2h_bytes
        out = super().pack(t)
        if self.d2h_bytes > before:
            self.d2h_bytes += n // t.element_size() * 8 - n
        return out


class _RebuildsAsFloat64(_ANSWER):  # the dtype of the development run, typed into unpack
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, _, offset, size, stride, device = packed
        return super().unpack((host, torch.float64, offset, size, stride, device))


class _FreesHostOnUnpack(_ANSWER):  # drops the host copy at the first unpack: a second one has nothing
    def pack(self, t):
        out = super().pack(t)
        return out if isinstance(out, torch.Tensor) else [out]

    def unpack(self, packed):
        return packed if isinstance(packed, torch.Tensor) else super().unpack(packed.pop())


class _HandsOutTheHostCopy(_ANSWER):  # no copy back: backward writes into the host copy itself
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, offset, size, stride, device = packed
        self.h2d_bytes += host.numel()
        return torch.empty(0, dtype=dtype).set_(host.untyped_storage(), offset, size, stride)


@pytest.mark.parametrize("cls,check", [
    (_OffloadsParameters, ex42.check_CountingOffload__parameters),
    (_OffloadsParameters, ex42.check_CountingOffload__bytes),
    (_CountsViewsTwice, ex42.check_CountingOffload__views),
    (_CountsViewsTwice, ex42.check_CountingOffload__bytes),
    (_KeepsTheOriginal, ex42.check_CountingOffload__storage_freed),
    (_LazyParams, ex42.check_CountingOffload__parameters),
    (_KeepsAtTheLimit, ex42.check_CountingOffload__min_bytes),
    (_SizeOfTheView, ex42.check_CountingOffload__min_bytes),
    (_EightBytesPerElement, ex42.check_CountingOffload__min_bytes),
    (_RebuildsAsFloat64, ex42.check_CountingOffload__views),
    (_FreesHostOnUnpack, ex42.check_CountingOffload__unpacked_twice),
    (_FreesHostOnUnpack, ex42.check_CountingOffload),
    (_HandsOutTheHostCopy, ex42.check_CountingOffload__unpacked_twice),
])
def test_ex42_checks_catch_offload_mistakes(cls, check):
    with pytest.raises(AssertionError, match="^CountingOffload: "):
        check(type("Sol", (), {"CountingOffload": cls}))
