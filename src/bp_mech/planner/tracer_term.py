"""The tracer's own term in a reference's tolerance (``planner.reference_gap``): the same fake step counted by PyTorch's
MemTracker beside the book's storage tracker.

The tracer's term (``TracerTerm``): the book's storage tracker is one way of counting a step's bytes.
PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` is another (its own dispatch mode, its own
bookkeeping of storages); each case traces the book's own definition (a), the plain step and the case's
strategy, with both, at the reference workload under the same fake tensors, and the difference of the two
savings, in points, is the tracer's term. MemTracker counts bytes per device, and under fake tensors every
tensor is on the CPU, the offload's host copies too: it cannot see what the offload moves off the device,
so a case whose strategy offloads takes the largest term measured on the other cases, labelled as such.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import enter, parse
from bp_mech.offload import OffloadConfig
from bp_mech.planner import lifecycle
from bp_mech.planner.cuda_autocast import cuda_policy


@dataclass(frozen=True)
class TracerTerm:
    """The tracer's own uncertainty at one case: definition (a)'s saving by the book's storage tracker and by
    PyTorch's MemTracker, the same fake step at the reference workload."""

    case: str  # the semantic id this term belongs to
    strategy: str  # the candidate arm both savings are of (the book's best under "up to")
    book_saving: float  # 1 - peak / plain peak, the book's tracker
    memtracker_saving: float | None  # the same by MemTracker; None: MemTracker cannot trace the strategy here
    pp: float  # |book - MemTracker| in points; where MemTracker cannot trace, the largest of ``borrowed_from``
    borrowed_from: tuple[str, ...] = ()  # the cases whose measured terms stood in (empty: measured here)

    @property
    def measured(self) -> bool:
        return self.memtracker_saving is not None


def memtracker():
    """A new PyTorch ``MemTracker`` that lets the root module run once per micro-batch. MemTracker refuses a
    second forward of the root within one tracking (it takes it for the next iteration); accumulation's
    micro-batches run the model once each, so the root's per-module statistics restart with each one. The
    device's peak, the one number read here, is not per module and runs on."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Repeated(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                del self.memory_tracking[module]  # the next micro-batch's forward of the root
            super()._pre_fw_hook(module, inputs)

    return Repeated()


def memtracker_can_trace(strategy: str) -> bool:
    """Whether MemTracker's peak is the device's under fake tensors: not with offload, whose host copies are
    fake CPU tensors like every device tensor, so MemTracker counts them on the device."""
    return not parse(strategy).offload


def memtracker_peak(session: lifecycle.Session, strategy: str) -> int:
    """The peak of one steady-state step (definition (a)) of ``strategy`` on a fake ``session``, counted by
    PyTorch's MemTracker instead of the book's storage tracker: the same step as ``session.step``, whose
    parameters, buffers, AdamW state and batch exist when it starts (``track_external``)."""
    s, model, batch, device = parse(strategy), session.model, session.batch, session.device
    off = OffloadConfig(min_bytes=session.options.offload_min_bytes)
    emulate = s.amp is not None and session.options.autocast == "cuda" and device.type != "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # (fake: no values to scale, as in Session.step)
    opt = session.optimizer(session.options.adamw)
    with session.active(), cuda_policy() if emulate else contextlib.nullcontext(), \
            enter(model, s, device, off, scaler) as ctx:
        if ctx.offload is not None:
            session._uncached_hooks(ctx.offload)
        mt = memtracker()
        mt.track_external(model, opt, *batch.values())
        with mt:
            train_step(model, opt, batch, s, entered=ctx)
    return mt.get_tracker_snapshot("peak")[device]["Total"]
