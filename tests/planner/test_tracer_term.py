"""``planner.tracer_term``: PyTorch's MemTracker counts the same fake step as the book's tracker (also with
micro-batches, which MemTracker alone refuses), and it cannot see the offload's copies leave the device."""

import dataclasses

from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.planner.lifecycle import Session
from bp_mech.planner.tracer_term import memtracker_can_trace, memtracker_peak


def test_memtracker_traces_micro_batches():
    """Accumulation runs the model once per micro-batch, which MemTracker alone refuses."""
    s = Session(parse_workload("tiny-b2s32"), fake=True, options=StepOptions().for_device("cuda"))
    assert memtracker_peak(s, "micro2") == s.step(parse("micro2")).peak


def test_memtracker_cannot_see_the_offload_leave_the_device():
    """Why offload borrows its tracer term: under fake tensors the host copies are CPU tensors like every
    device tensor, so MemTracker counts them on the device (no saving), while the book's tracker does not."""
    options = dataclasses.replace(StepOptions().for_device("cuda"), offload_min_bytes=1)  # offload every storage
    s = Session(parse_workload("tiny-b2s64"), fake=True, options=options)
    plain, offload = s.step(parse("plain")).peak, s.step(parse("offload")).peak
    assert offload < plain <= memtracker_peak(s, "offload") and memtracker_peak(s, "plain") == plain
    assert not memtracker_can_trace("offload") and memtracker_can_trace("checkpoint-all")
