"""Part 02 · 42 — TRAIN-OFFLOAD: saved activations moved to host memory between forward and backward.

Autograd's ``saved_tensors_hooks`` let a pack hook replace each tensor saved for backward by
anything, and an unpack hook give it back when backward needs it. ``ActivationOffload`` (style
after torchtune's ``training/_activation_offloading.py``) packs a device tensor into a host
buffer and unpacks it to the device again:

* parameters (and views of them) and tensors under ``min_bytes`` stay resident: a parameter lives
  on the device anyway, and a tiny copy costs more in launch latency than it frees;
* copies go per *storage*: views of one storage (``q``/``k`` slices, ``x.view(...)``) are moved and
  counted once, and rebuilt as views with their offset, size and stride;
* host buffers come from a reused pool (``HostPool``, in ``bp_mech.host_memory``; pinned on CUDA), so
  from the second step on no host memory is allocated;
* on CUDA, device-to-host copies run on a side stream; compute runs at most ``inflight`` copies
  ahead before it waits (which bounds the device memory still waiting for its copy), and backward
  prefetches the next ``prefetch`` storages host-to-device on that stream;
* ``d2h_bytes`` / ``h2d_bytes`` count what the hooks really copy.

Storages are told apart by identity, not by address: a ``StorageWeakRef`` is the key, whose
``cdata`` is the address of the storage object itself (its ``StorageImpl``), shared by every view
of it. That works for fake tensors too (``FakeTensorMode``: every ``data_ptr()`` is 0), so the
ledger of Part 02 · 43 estimates offload with the same class. The weak reference keeps the
storage object's memory (not its data) allocated, so no new storage can take that address while
the entry exists.

On the CPU there is no device: the "host" copy is a CPU clone into the pool and the copy back
is another clone, with no stream. Hooks, skip rules and byte counts are real; time says nothing
about a host link. The hooks run their host-side work (the pool's buffers, ``save_on_cpu``'s host
copies) inside ``host_region()``, a context a measuring tool may pass in: the bench passes the storage
tracker's ``host_side``, which books those bytes as host memory, as the CUDA allocator does not see
pinned host memory; so the CPU peak is what a device would hold, and the host bytes are reported beside
it. The mechanism itself knows nothing of trackers.

The experiment of the chapter (candidates, the counting pass, link metrics, records) lives in
``bp_mech.experiments.offload``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.host_memory import HostPool


OFFLOADABLE_TYPES = (torch.Tensor, nn.Parameter, FakeTensor)  # offloaded; subclasses (DTensor, ...) stay as they are


class _Slot:
    """One offloaded storage: its host copy, and its device copy while backward needs it."""

    def __init__(self, host, nbytes, version, forward, index):
        self.host, self.nbytes, self.version = host, nbytes, version
        self.forward, self.index = forward, index  # which forward packed it, at which position
        self.pending = 0  # packed views not unpacked yet
        self.dev = None  # device uint8 buffer (prefetched or in use), dropped when pending hits 0
        self.event = None  # CUDA event: the H2D copy into ``dev`` is done


@dataclass
class OffloadConfig:
    """The offload's tuning knobs (``ActivationOffload``).

    Args:
        min_bytes: storages smaller than this stay resident (``min_bytes(device)`` picks it per device).
        side_stream: CUDA: copy on a side stream instead of the compute stream.
        prefetch: CUDA: storages copied back ahead of backward's use.
        inflight: CUDA: D2H copies the compute stream may run ahead of before it waits.

    Example:
        >>> OffloadConfig(min_bytes=4096)
        OffloadConfig(min_bytes=4096, side_stream=True, prefetch=2, inflight=4)
    """

    min_bytes: int = 2**20  # storages smaller than this stay resident
    side_stream: bool = True  # CUDA: copy on a side stream instead of the compute stream
    prefetch: int = 2  # CUDA: storages copied back ahead of backward's use
    inflight: int = 4  # CUDA: D2H copies the compute stream may run ahead of before it waits


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload activations to a reused host pool (see the module's docstring).

    Enter once per forward; the counters cover the last forward and its backward: ``d2h_bytes`` /
    ``h2d_bytes`` (bytes copied), ``offloaded``, ``shared_views``, ``kept_params``, ``kept_small``
    (saved tensors by fate) and ``kept_small_bytes``.

    Args:
        params: the model's parameters (they, and views of them, stay resident).
        cfg: the thresholds and CUDA stream settings.
        device: where the activations live ("cpu": clones stand for the copies, no stream).
        host_region: the context the host-side copies are made in (default: none; a memory tracker passes
            its own to book them as host memory: ``instruments.tracking.host_side``).

    Example:
        >>> x = torch.ones(1024, 8, requires_grad=True)  # 32 KiB, not a parameter
        >>> hooks = ActivationOffload([], OffloadConfig(min_bytes=4096))
        >>> with hooks:
        ...     y = x.exp().sum()  # exp saves its (1024, 8) float32 output
        >>> y.backward(); hooks.offloaded, hooks.d2h_bytes, hooks.h2d_bytes, torch.allclose(x.grad, x.exp())
        (1, 32768, 32768, True)
    """

    def __init__(self, params, cfg: OffloadConfig = OffloadConfig(), device="cpu",
                 host_region: Callable[[], ContextManager] = contextlib.nullcontext):
        self.params, self.cfg, self.device = list(params), cfg, torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda and cfg.side_stream else None
        self.host_region = host_region
        self.pool = HostPool(pin=cuda, host_region=host_region)
        self._reset()
        super().__init__(self._pack, self._unpack)

    def _reset(self):
        self.d2h_bytes = self.h2d_bytes = 0  # bytes copied device -> host, host -> device
        self.offloaded = self.shared_views = self.kept_params = self.kept_small = 0  # saved tensors, by fate
        self.kept_small_bytes = 0
        self._param_storages = {StorageWeakRef(p.untyped_storage()) for p in self.params}
        self._by_storage: dict[StorageWeakRef, _Slot] = {}  # storage -> its slot (the newest version)
        self._order: list[_Slot] = []  # slots in pack order
        self._forward = getattr(self, "_forward", 0) + 1  # counts forwards: prefetch stays within one
        self._stash = []  # CUDA: (device bytes, event) of D2H copies in flight, oldest first

    def __enter__(self):
        self._reset()
        return super().__enter__()

    def __exit__(self, *exc):
        self._drain(0)  # the end of forward: compute waits for the last copies, then they may be freed
        return super().__exit__(*exc)

    def _drain(self, keep: int) -> None:
        """Let the compute stream wait for all but ``keep`` in-flight D2H copies, then drop their sources.

        Dropped after the wait, a source block returns to the compute stream's pool and is reused only
        after the copy (stream order), with no ``record_stream``: memory stays deterministic and bounded.
        """
        while len(self._stash) > keep:
            _, event = self._stash.pop(0)
            torch.cuda.current_stream(self.device).wait_event(event)

    def _keep(self, t) -> bool:
        if (type(t) not in OFFLOADABLE_TYPES or t.layout != torch.strided or t.is_conj()
                or t.is_neg() or t.device.type != self.device.type):
            return True  # subclasses, sparse, lazy conj/neg views, other devices: kept
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if isinstance(t, nn.Parameter) or key in self._param_storages:
            self.kept_params += 1
            return True
        if storage.nbytes() < self.cfg.min_bytes:
            self.kept_small += 1
            self.kept_small_bytes += storage.nbytes()
            return True
        return False

    def _pack(self, t):
        if self._keep(t):
            return t
        storage = t.untyped_storage()
        # identity: while a key lives, no new storage takes its address
        key = StorageWeakRef(storage)
        slot = self._by_storage.get(key)
        # a new storage, or one written since its copy
        if slot is None or slot.version != t._version:
            with self.host_region():
                slot = self._offload(storage, t._version)
            self._by_storage[key] = slot
        else:
            self.shared_views += 1  # a view of a storage already on the host: no copy
        slot.pending += 1
        self.offloaded += 1
        return slot, t.dtype, t.storage_offset(), t.size(), t.stride()

    def _offload(self, storage, version) -> _Slot:
        nbytes = storage.nbytes()
        host = self.pool.take(nbytes)
        # the storage as bytes
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        if self.stream is not None:
            # the producer has finished
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(src, non_blocking=self.pool.pin)
            # src stays alive until compute waited
            self._stash.append((src, self.stream.record_event()))
            self._drain(self.cfg.inflight)
        else:
            host.copy_(src, non_blocking=self.pool.pin)
        self.d2h_bytes += nbytes
        slot = _Slot(host, nbytes, version, self._forward, len(self._order))
        # back to the pool when autograd drops the slot
        weakref.finalize(slot, self.pool.give, host)
        self._order.append(slot)
        return slot

    def _fetch(self, slot: _Slot) -> None:
        if slot.dev is not None:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):  # after the D2H into slot.host on the same stream
                slot.dev = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
                slot.dev.copy_(slot.host, non_blocking=self.pool.pin)
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
        else:
            slot.dev = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
            slot.dev.copy_(slot.host, non_blocking=self.pool.pin)
        self.h2d_bytes += slot.nbytes

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed  # kept resident
        slot, dtype, offset, size, stride = packed
        self._fetch(slot)
        buf = slot.dev
        if self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(slot.event)
            # allocated on the side stream, used by compute: freed after both
            buf.record_stream(cur)
        same = self.stream is not None and slot.forward == self._forward
        depth = self.cfg.prefetch if same else 0
        for k in range(slot.index - 1, -1, -1)[:depth]:
            if self._order[k].pending:
                # backward runs roughly in reverse pack order
                self._fetch(self._order[k])
        slot.pending -= 1
        if slot.pending <= 0:
            # the returned view keeps the storage alive as long as autograd needs it
            slot.dev = None
        view = torch.empty(0, dtype=dtype, device=buf.device)
        return view.set_(buf.untyped_storage(), offset, size, stride)


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """PyTorch's ``save_on_cpu(pin_memory=True)``, its hooks wrapped to count the bytes
    it copies.

    It copies every saved tensor (parameters and each view separately) on the compute
    stream. On the CPU its ``.to(device)`` returns the host tensor itself; the wrapper
    clones it there, to stand for the copy back a device would make. ``d2h_bytes`` /
    ``h2d_bytes`` cover the last forward and its backward. ``host_region``: as
    ``ActivationOffload``'s, the context its host copies are made in.

    Example:
        >>> x, hooks = torch.ones(1024, 8, requires_grad=True), CountingSaveOnCpu()
        >>> with hooks:
        ...     y = x.exp().sum()
        >>> y.backward(); hooks.d2h_bytes, hooks.h2d_bytes
        (32768, 32768)
    """

    def __init__(self,
                 host_region: Callable[[], ContextManager] = contextlib.nullcontext):
        super().__init__(pin_memory=True, device_type="cuda")
        pack, unpack = self.pack_hook, self.unpack_hook
        self.d2h_bytes = self.h2d_bytes = 0

        def counted_pack(t):
            self.d2h_bytes += t.numel() * t.element_size()
            with host_region():
                return pack(t)

        def counted_unpack(packed):
            self.h2d_bytes += packed[1].numel() * packed[1].element_size()
            out = unpack(packed)
            return out.clone() if out is packed[1] else out

        self.pack_hook, self.unpack_hook = counted_pack, counted_unpack

    def __enter__(self):
        self.d2h_bytes = self.h2d_bytes = 0  # the last forward and its backward
        return super().__enter__()


CPU_MIN_BYTES = 4096  # the tiny workload's activations are KiB-sized: a smaller threshold on the CPU


def min_bytes(device) -> int:
    """The offload threshold on ``device``: ``OffloadConfig.min_bytes`` on CUDA, ``CPU_MIN_BYTES`` on the CPU.

    Args:
        device: a device or its name.

    Returns:
        The ``min_bytes`` to offload with there, in bytes.

    Example:
        >>> min_bytes("cpu"), min_bytes("cuda") == 2**20
        (4096, True)
    """
    return OffloadConfig.min_bytes if torch.device(device).type == "cuda" else CPU_MIN_BYTES
