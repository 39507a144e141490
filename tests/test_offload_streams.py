"""Part 02 · 42, the side-stream protocol of ``ActivationOffload``, on CUDA streams simulated on the CPU:
every gradient stays bitwise equal, every D2H copy starts after its producer, at most ``inflight`` copies
run ahead, and the mutants that skip a wait are caught."""

import contextlib
import weakref

import pytest
import torch

from bp_mech import checkpointing, offload
from bp_mech.bench.compare import compare
from conftest import hooked_probe, hooked_step

MIN = offload.CPU_MIN_BYTES


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
    ref = hooked_probe(model, batches[0])
    fake, off = _on_fake_streams(_Watched, model, monkeypatch, inflight=2, prefetch=2)
    with checkpointing.configure(model, setup):
        for i in range(2):  # the host pool is reused from the second step on
            hooked_step(model, batches[(i + 1) % 2], off)
            assert fake.ran == len(fake.queue) and not off._stash  # no copy left behind after a step
        fake.side.waited_for_compute, fake.record_streams = 0, []  # count the probe's step only
        got = hooked_probe(model, batches[0], off)
    c = compare(ref, got)
    assert c.bitwise and got.finite, c
    d2h = len(off._order)
    assert fake.side.waited_for_compute == d2h  # every D2H copy starts after its producer
    assert 0 < off.most_in_flight <= 2  # the compute stream runs at most `inflight` copies ahead
    assert off.pool.allocations == d2h  # one step's buffers, reused afterwards
    assert len(fake.record_streams) == off.offloaded and set(map(id, fake.record_streams)) == {id(fake.compute)}


def test_stream_protocol_catches_a_buffer_used_before_its_copy(tiny, monkeypatch):
    """Mutant: the compute stream waits on an event that does not cover the H2D copy."""
    model, batches = tiny
    ref = hooked_probe(model, batches[0])

    class NoWaitBeforeUse(offload.ActivationOffload):
        def _fetch(self, slot):
            super()._fetch(slot)
            slot.event = _Event(fake, pos=0)  # already complete: covers nothing

    fake, off = _on_fake_streams(NoWaitBeforeUse, model, monkeypatch)
    got = hooked_probe(model, batches[0], off)
    c = compare(ref, got)
    assert not got.finite and not c.bitwise and c.grad_error == float("inf")


def test_stream_protocol_catches_a_source_dropped_before_its_copy(tiny, monkeypatch):
    """Mutant: the D2H sources are dropped without the compute stream waiting for their copies."""
    model, batches = tiny

    class DropsSources(offload.ActivationOffload):
        def _drain(self, keep):
            self._stash.clear()

    fake, off = _on_fake_streams(DropsSources, model, monkeypatch)
    with pytest.raises(AssertionError, match="dropped before the copy ran"):
        hooked_step(model, batches[0], off)
