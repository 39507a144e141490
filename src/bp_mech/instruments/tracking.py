"""The storage tracker: which tensor storages are alive, how many bytes, of which class.

Memory is held by *storages*, not tensors: views share them, and an operator's output may be a
view of its input. ``StorageTracker`` is a ``TorchDispatchMode``: it sees every operator's outputs
and counts each storage once, from the first output that holds it until the storage dies (a weak
reference with a callback). Storages are told apart by identity, not address, so the same tracker
counts fake tensors (``FakeTensorMode``: shapes and bytes, no memory), whose storages have none.

* **device and host**: the bytes of storages on the tracker's device are its *live* bytes; a
  storage of another device, or one created inside ``host_side()`` (an offload's host copies on
  the CPU), is host memory, booked apart and never counted as device memory.
* **what existed before**: an output that shares an input's storage (a view, an in-place op)
  allocated nothing. If that storage is not tracked (it existed before the block and was not
  declared with ``add``), it is not counted.
* **classes** (Part 02 · 43's ledger): a storage gets a class from where it is born -- the
  forward body, the logits/loss part (``region = "loss"``), a backward node of that part
  (``loss_nodes``), a recomputation (grad mode on inside the backward), the optimizer -- and is
  promoted when its role becomes known (``end_forward``: alive at the end of the forward means
  saved for backward; ``relabel``: gradients, optimizer state).
* **phases and marks**: ``start(phase)`` opens a phase (its peak is kept with a snapshot of the
  live set; ``timeline`` holds the phase and the live bytes after every operator), ``mark(stage)``
  snapshots the live set at a point; on CUDA both also read the caching allocator (``allocator``),
  so a real GPU step gives the tracked and the allocator's bytes side by side.

``instruments.peak.PeakMemory`` is the one peak-memory tool of the package: the allocator's counters on
CUDA, this tracker on the CPU. The CPU result is deterministic: a function of the program, not of timing.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack


_DEVICE = torch.ops.prim.device.default  # ``tensor.device``, which a dispatch mode sees as an operator


def storage_of(t):
    """The untyped storage of a strided tensor (None for anything else: sparse tensors have none).

    Args:
        t: anything an operator is given or returns.

    Returns:
        ``t.untyped_storage()``, or None.
    """
    return t.untyped_storage() if isinstance(t, torch.Tensor) and t.layout == torch.strided else None


def _strided(tree, out: list) -> list:
    """``out`` with the strided tensors of an operator's arguments or outputs appended, in order (nested
    tuples, lists and dicts: what a dispatch is given; ``tree_leaves`` without its generality, as this runs
    on every operator)."""
    if isinstance(tree, torch.Tensor):
        if tree.layout == torch.strided:
            out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _strided(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _strided(x, out)
    return out


class _ByIdentity:
    """Storage -> serial number, by the storage's identity: ``WeakIdKeyDictionary`` without a weak reference
    made per lookup (this runs on every operator); the tracker's own weak reference drops an entry when its
    storage dies (``StorageTracker._free``), before its ``id`` can be reused."""

    def __init__(self) -> None:
        self._by_id: dict[int, int] = {}

    def __contains__(self, storage) -> bool:
        return id(storage) in self._by_id

    def get(self, storage, default=None):
        return self._by_id.get(id(storage), default)

    def __getitem__(self, storage) -> int:
        return self._by_id[id(storage)]

    def __setitem__(self, storage, serial: int) -> None:
        self._by_id[id(storage)] = serial

    def __delitem__(self, storage) -> None:
        del self._by_id[id(storage)]

    def drop(self, key: int | None, serial: int) -> None:
        """Forget the storage of ``id`` ``key`` if it still maps to ``serial``."""
        if key is not None and self._by_id.get(key) == serial:
            del self._by_id[key]


class StorageTracker(TorchDispatchMode):
    """Live storage bytes by class; the peak; a snapshot of the live set at each phase's peak."""

    def __init__(self, device="cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.serial = _ByIdentity()  # storage -> serial number (while the storage is alive)
        self.refs, self.nbytes, self.label = {}, {}, {}  # serial -> weakref / bytes / class
        self.ident: dict[int, int] = {}  # serial -> id of its storage (while alive)
        self.live, self.host = {}, {}  # serial -> bytes (device, host) of storages alive now
        self.current = 0  # device bytes alive now
        self.peak = 0  # most device bytes alive at once
        self.phase, self.region = "idle", "body"
        self.host_depth = 0  # > 0 inside ``host_side()``: what is allocated there is host memory
        self.born: list[int] = []  # serials created in the current forward
        self.peaks: dict[str, tuple[int, list]] = {}  # phase -> (bytes, serials alive)
        self.marks: dict[str, tuple[int, list, int]] = {}  # stage -> (bytes, serials, host bytes in use)
        self.loss_nodes: set = set()  # autograd nodes of lm_head + loss (kept alive: identity)
        self.allocator: dict[str, int] = {}  # CUDA only: stage, "<phase>_peak", "<phase>_reserved" -> bytes
        self.timeline: list[tuple[str, int]] = []  # (phase, live device bytes) after each operator

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no ``torch.compile`` runs under the tracker, so its dispatch (every operator goes through it)
        is left without ``TorchDispatchMode``'s Dynamo-disabling wrapper."""
        return False

    def _free(self, serial, _ref) -> None:
        self.refs.pop(serial, None)
        self.serial.drop(self.ident.pop(serial, None), serial)
        self.host.pop(serial, None)
        if self.live.pop(serial, None) is not None:
            self.current -= self.nbytes[serial]

    def add(self, t, label: str = "other") -> None:
        """Count ``t``'s storage from now on (once: a storage already tracked is left as it is)."""
        storage = storage_of(t)
        if storage is None or storage.nbytes() == 0 or storage in self.serial:
            return
        host = bool(self.host_depth) or t.device.type != self.device.type  # an offload's host buffer, a host tensor
        serial = self._count(storage, label, host)
        if not host and self.phase == "forward":
            self.born.append(serial)

    def _count(self, storage, label: str, host: bool) -> int:
        """Track ``storage`` from now on under a new serial (its bytes, class and weak reference), alive on the
        device or held on the host; returns the serial."""
        serial, nbytes = len(self.nbytes), storage.nbytes()
        self.serial[storage], self.nbytes[serial], self.label[serial] = serial, nbytes, label
        self.refs[serial], self.ident[serial] = weakref.ref(storage, partial(self._free, serial)), id(storage)
        if host:
            self.host[serial] = nbytes
        else:
            self.live[serial] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return serial

    def relabel(self, t, label: str) -> None:
        storage = storage_of(t)
        serial = self.serial.get(storage) if storage is not None else None
        if serial is not None:
            self.label[serial] = label

    def _label(self, func, args) -> str:
        """The class of a storage born from ``func`` now: where in the step it is born."""
        if self.phase == "forward":
            src = storage_of(args[0]) if args else None
            if func is torch.ops.aten._to_copy.default and src is not None and \
                    self.label.get(self.serial.get(src)) == "parameters":
                return "parameters"  # autocast's low-precision weight copy
            return "logits_loss" if self.region == "loss" else "other"
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None and torch.is_grad_enabled():  # checkpointing re-runs a layer's forward
                return "saved_activations"
            return "logits_loss" if node in self.loss_nodes else "other"
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a device query (two in three calls under fake tensors): nothing to count
            return getattr(args[0], "fake_device", None) or func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        tensors = _strided(out, [])
        if tensors:
            # an output sharing an input's storage allocated nothing: untracked, it existed before the block
            # and is not counted on the device; on the host it is booked all the same (an offload's pool
            # reuses its buffers: the host column holds what the step keeps there, new or not)
            inputs = (t.untyped_storage() for t in _strided((args, kwargs), []))
            before = {id(storage) for storage in inputs if storage not in self.serial}
            label = self._label(func, args)
            for t in tensors:
                if self.host_depth or t.device.type != self.device.type or id(t.untyped_storage()) not in before:
                    self.add(t, label)
            peak = self.peaks.get(self.phase)
            if peak is None or self.current > peak[0]:
                self.peaks[self.phase] = (self.current, list(self.live))
        if self.phase != "idle":
            self.timeline.append((self.phase, self.current))
        return out

    # phases and stages
    def start(self, phase: str) -> None:
        """Open ``phase`` (forward, backward, optimizer, zero_grad, idle): its peak starts from the live
        bytes now; on CUDA the last phase's allocator peak is read and the allocator's peak reset."""
        self._sync_peak()
        self.phase, self.region = phase, "body"
        self.peaks[phase] = max(self.peaks.get(phase, (0, [])), (self.current, list(self.live)), key=lambda p: p[0])
        if phase == "forward":
            self.born = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sync_peak(self) -> None:
        if self.device.type == "cuda" and self.phase != "idle":
            torch.cuda.synchronize(self.device)
            for key, val in ((f"{self.phase}_peak", torch.cuda.max_memory_allocated(self.device)),
                             (f"{self.phase}_reserved", torch.cuda.max_memory_reserved(self.device))):
                self.allocator[key] = max(self.allocator.get(key, 0), val)

    def end_forward(self) -> None:
        """Promote what the forward created and left alive ("other") to saved activations."""
        for serial in self.born:  # what survives the forward is what autograd saved
            if serial in self.live and self.label[serial] == "other":
                self.label[serial] = "saved_activations"

    def mark(self, stage: str, host: int = 0) -> None:
        """Snapshot the live device storages; ``host``: host bytes holding this step's state now."""
        self.marks[stage] = (self.current, list(self.live), host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocator[stage] = torch.cuda.memory_allocated(self.device)

    def classify(self, serials, classes: Iterable[str]) -> dict[str, int]:
        """Bytes of the storages ``serials`` per class, in the order of ``classes`` (which must hold every label)."""
        out = dict.fromkeys(classes, 0)
        for serial in serials:
            out[self.label[serial]] += self.nbytes[serial]
        return out


@contextlib.contextmanager
def host_side():
    """Allocations inside are host memory: host-side copies of an offload on the CPU, which the CUDA
    allocator would not count either. Every tracker on the dispatch stack books them as host bytes,
    never as device bytes (it stays on, so that it works under ``FakeTensorMode`` too)."""
    trackers = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, StorageTracker)]
    for m in trackers:
        m.host_depth += 1
    try:
        yield
    finally:
        for m in trackers:
            m.host_depth -= 1
