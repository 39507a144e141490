"""Part 02 · 42: offload leaves loss and every gradient equal; the hooks' D2H/H2D byte counts agree
with an independent count of the saved activations; parameters and tiny tensors stay; the pool is
reused; the records validate; and the ex42 checks catch the classic mistakes (mutants)."""

import contextlib
import weakref

import pytest
import torch
from torch import nn

from bp_mech import checkpointing as ck
from bp_mech import offload as of
from bp_mech import registry
from bp_mech.experiments import harness
from bp_mech.measure import PeakMemory
from bp_mech.results import load_record, save_record
from bp_mech.workload import build_model, make_batches, parse_workload
from checks import ex42

MIN = of.CPU_MIN_BYTES


@pytest.fixture(scope="module")
def tiny():
    w = parse_workload("tiny-b2s32")
    return build_model(w), make_batches(w, 2)


def test_offload_leaves_loss_and_every_gradient_bitwise_equal(tiny):
    model, batches = tiny
    ref = harness.probe(model, batches[0], "cpu")
    for hooks, setup in ((of.ActivationOffload(model.parameters(), of.OffloadConfig(min_bytes=MIN)), "plain"),
                         (of.CountingSaveOnCpu(), "plain"),
                         (of.ActivationOffload(model.parameters(), of.OffloadConfig(min_bytes=MIN)), "checkpoint-all")):
        with ck.configure(model, setup):
            got = harness.probe(model, batches[0], "cpu", hooks)
        c = harness.compare(ref, got)
        assert c["bitwise"] and c["grad_error"] == 0.0, (type(hooks).__name__, setup, c)


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_d2h_bytes_equal_the_independently_counted_saved_activations(tiny, setup):
    model, batches = tiny
    counted = of.count_saved(model, batches[0], setup)
    off = of.ActivationOffload(model.parameters(), of.OffloadConfig(min_bytes=MIN))
    with ck.configure(model, setup):
        harness.train_step(model, batches[0], off)
    assert off.d2h_bytes == counted.bytes_at_least(MIN) > 0
    assert 0 < counted.bytes - off.d2h_bytes <= off.kept_small_bytes  # the rest: tiny ones (kept per saved tensor)
    assert off.h2d_bytes >= off.d2h_bytes  # every moved storage comes back
    assert off.kept_params > 0 and off.shared_views > 0  # the model saves weights and views


def test_save_on_cpu_copies_every_saved_tensor(tiny):
    model, batches = tiny
    counted = of.count_saved(model, batches[0])
    soc = of.CountingSaveOnCpu()
    harness.train_step(model, batches[0], soc)
    assert soc.d2h_bytes == soc.h2d_bytes == counted.tensor_bytes  # parameters and each view included
    assert soc.d2h_bytes > counted.bytes


def test_parameters_views_and_tiny_tensors():
    w = nn.Parameter(torch.randn(64, 64))
    off = of.ActivationOffload([w], of.OffloadConfig(min_bytes=1024))
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
    off = of.ActivationOffload(model.parameters(), of.OffloadConfig(min_bytes=MIN))
    harness.train_step(model, batches[0], off)
    allocs, allocated = off.pool.allocations, off.pool.allocated
    for i in range(3):
        harness.train_step(model, batches[i % 2], off)
    assert (off.pool.allocations, off.pool.allocated) == (allocs, allocated)
    assert allocated == off.d2h_bytes


def test_cpu_peak_is_the_device_side_and_host_bytes_are_reported(tiny):
    model, batches = tiny
    peaks = {}
    for name, hooks in (("resident", None), ("offload", of.ActivationOffload(model.parameters(),
                                                                             of.OffloadConfig(min_bytes=MIN)))):
        with PeakMemory("cpu", resident=[model.parameters()]) as pm:
            harness.train_step(model, batches[0], hooks)
        peaks[name] = pm.peak_allocated
    assert peaks["offload"] < peaks["resident"]
    assert hooks.pool.high_water == hooks.d2h_bytes > 0


def test_nullcontext_when_off(tiny):
    assert isinstance(of.offload_activations([], enabled=False), contextlib.nullcontext)
    assert isinstance(of.offload_activations([]), of.ActivationOffload)


def test_run_writes_valid_records(tmp_path, cpu_only):
    ctx = registry.make_context("TRAIN-OFFLOAD", "cpu", "tiny-b2s32")
    bw = {"h2d": 2.0e10, "d2h": 1.5e10}  # stands for measure_bandwidth: the GPU-only metrics, on the CPU
    recs = of.run(ctx, bandwidth=bw)
    assert [r.candidate for r in recs] == list(of.CANDIDATES)
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    assert by["resident"].transfer_bytes is None and by["resident"].decision is None
    for name in of.CANDIDATES[1:]:
        r = by[name]
        assert r.output_error == 0.0 and r.grad_error == 0.0 and r.metrics["bitwise_equal"] and r.all_finite
        assert r.metrics["d2h_matches_count"] and r.transfer_bytes["d2h"] == r.metrics["expected_d2h_bytes"]
        assert r.peak_allocated < by["resident"].peak_allocated
        assert r.metrics["held_after_forward_bytes"] < by["resident"].metrics["held_after_forward_bytes"]
        t = r.transfer_bytes
        assert r.metrics["transfer_bound_s"] == pytest.approx(t["d2h"] / bw["d2h"] + t["h2d"] / bw["h2d"])
    assert by["offload"].transfer_bytes["d2h"] < by["save_on_cpu"].transfer_bytes["d2h"]
    assert by["offload-checkpoint"].transfer_bytes["d2h"] < by["offload"].transfer_bytes["d2h"]


def test_link_metrics():
    m = of.link_metrics(3 * 10**9, 2 * 10**9, {"d2h": 1e9, "h2d": 2e9}, median_s=5.0, base_median_s=1.0)
    assert m["transfer_bound_s"] == 4.0 and m["overhead_s"] == 4.0 and m["overhead_over_bound"] == 1.0
    assert m["implementation_s"] == 0.0
    hidden = of.link_metrics(10**9, 10**9, {"d2h": 1e9, "h2d": 1e9}, median_s=1.5, base_median_s=1.0)
    assert hidden["overhead_over_bound"] == 0.25 and hidden["implementation_s"] == 0.0  # copies hidden
    slow = of.link_metrics(10**9, 0, {"d2h": 1e9, "h2d": 1e9}, median_s=4.0, base_median_s=1.0)
    assert slow["implementation_s"] == 2.0
    assert of.link_metrics(0, 0, {"d2h": 1e9, "h2d": 1e9}, 1.0, 1.0)["overhead_over_bound"] is None


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


class _Watched(of.ActivationOffload):
    def _reset(self):
        super()._reset()
        self.most_in_flight = 0

    def _offload(self, st, version):
        slot = super()._offload(st, version)
        self.most_in_flight = max(self.most_in_flight, len(self._stash))
        return slot


def _on_fake_streams(cls, model, monkeypatch, **cfg):
    fake = FakeStreams(monkeypatch)
    off = cls(model.parameters(), of.OffloadConfig(min_bytes=MIN, **cfg))
    off.stream = fake.side  # the CUDA branch of every hook, on the CPU
    return fake, off


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_stream_protocol_leaves_every_gradient_bitwise_equal(tiny, monkeypatch, setup):
    model, batches = tiny
    ref = harness.probe(model, batches[0], "cpu")
    fake, off = _on_fake_streams(_Watched, model, monkeypatch, inflight=2, prefetch=2)
    with ck.configure(model, setup):
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

    class NoWaitBeforeUse(of.ActivationOffload):
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

    class DropsSources(of.ActivationOffload):
        def _drain(self, keep):
            self._stash.clear()

    fake, off = _on_fake_streams(DropsSources, model, monkeypatch)
    with pytest.raises(AssertionError, match="dropped before the copy ran"):
        harness.train_step(model, batches[0], off)


def test_seed_reference_gives_the_seed_decision():
    s = of.SEED_REFERENCE
    assert harness.decide(True, s["peak_saving"], s["median_ratio"])[0] == s["decision"] == "tune"


def test_conformance_passes():
    row = of.conformance()
    assert row.passed, row.detail


# --- the package's offload passes the exercise checks; the checks catch the mistakes ------


class _PackageOffload(of.ActivationOffload):
    def __init__(self, params, min_bytes=1024):
        super().__init__(params, of.OffloadConfig(min_bytes=min_bytes))
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


@pytest.mark.parametrize("cls,check", [
    (_OffloadsParameters, ex42.check_parameters_stay),
    (_OffloadsParameters, ex42.check_bytes_counted_once),
    (_CountsViewsTwice, ex42.check_views_share_one_copy),
    (_CountsViewsTwice, ex42.check_bytes_counted_once),
    (_KeepsTheOriginal, ex42.check_storage_freed),
])
def test_ex42_checks_catch_offload_mistakes(cls, check):
    with pytest.raises(AssertionError):
        check(type("Sol", (), {"CountingOffload": cls}))
