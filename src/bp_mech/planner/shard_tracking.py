"""The storage tracker of a sharded step (``planner.shard``): ``ShardTracker``, the ``instruments.tracking.StorageTracker``
that sees through FSDP2's DTensors (their local shards), follows the storage resizes with which FSDP frees and
re-gathers unsharded parameters, and names the all-gathered parameters and the collectives' buffers."""

from __future__ import annotations

import torch

from bp_mech.instruments.tracking import StorageTracker, storage_of


def _local(t):  # a DTensor's local shard (what this rank holds), else ``t``
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _on_copies(func):
    """A real collective run on copies, waited for: gloo's worker thread lets go of a collective's tensors
    after the caller has gone on, so FSDP's buffers would die at a moment that varies from run to run; the
    copies (made inside the tracker's dispatch: not counted, as NCCL's own buffers are not) die there instead,
    and FSDP's buffers when FSDP drops them, as in the fake step."""
    def run(output, inputs, *rest, **kwargs):
        out, into = output.clone(), inputs.clone()
        _, work = func(out, into, *rest, **kwargs)
        work.wait()
        output.copy_(out)
        return output, work

    return run


class ShardTracker(StorageTracker):
    """The storage tracker (``instruments.tracking``) on one rank of a sharded step.

    What it sees that the tracker does not: DTensors (sharded parameters, gradients, moments) by their local
    shards (DTensor's op runs first; the local ops it runs come back here); FSDP2's frees and re-allocations
    of its gathered parameters by ``UntypedStorage.resize_``, which no dispatch mode sees (patched while
    tracking, as PyTorch's ``FSDPMemTracker`` does); a storage's role in the collectives: what
    ``split_with_sizes_copy`` fills after an all-gather is a gathered parameter ("parameters", kind
    ``gathered``), the all-gather's output and the reduce-scatter's input are the collectives' buffers
    ("other", kind ``collective``), the reduce-scatter's output is the sharded gradients.

    Example:
        >>> ShardTracker().kinds([])
        {'gathered': 0, 'collective': 0}
    """

    def __init__(self, device="cpu") -> None:
        super().__init__(device)
        self.kind: dict[int, str] = {}  # serial -> "gathered" | "collective"
        self.now = dict(gathered=0, collective=0)  # kind -> bytes alive now
        self.most = dict(gathered=0, collective=0)  # kind -> most bytes alive at once (not only at the snapshots)
        self._entry_mode, self._resize = None, None

    def _grow(self, serial: int, kind: str) -> None:
        self.kind[serial] = kind
        self.now[kind] += self.nbytes[serial]
        self.most[kind] = max(self.most[kind], self.now[kind])

    def _free(self, serial, _ref) -> None:
        if serial in self.live and serial in self.kind:
            self.now[self.kind[serial]] -= self.nbytes[serial]
        super()._free(serial, _ref)

    def add(self, t, label: str = "other") -> None:  # DTensors by their local shards, here and in relabel
        super().add(_local(t), label)

    def relabel(self, t, label: str) -> None:
        super().relabel(_local(t), label)

    def _resized(self, storage) -> None:
        """A storage resized in place: its old size dies (the old serial stays in earlier snapshots), the new
        one is born under a new serial, with the same class and kind."""
        old = self.serial.get(storage)
        if old in self.host:  # (a fake tensor's storage is on "meta": its tensor's device says where it is)
            return
        if old is not None:
            del self.serial[storage]
            self._free(old, None)
        if storage.nbytes():
            serial = self._count(storage, "other" if old is None else self.label[old], host=False)
            if old in self.kind:
                self._grow(serial, self.kind[old])

    def _mark(self, t, label: str, kind: str | None = None) -> None:
        self.add(t, label)
        if (serial := self.serial.get(storage_of(t))) is not None:
            self.label[serial] = label
            if kind and serial not in self.kind and serial in self.live:
                self._grow(serial, kind)

    def __enter__(self):
        from torch._guards import active_fake_mode  # (the session's, or None on real tensors)

        self._entry_mode, self._resize = active_fake_mode(), torch.UntypedStorage.resize_

        def resize_(storage, size, orig=self._resize):
            out = orig(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first; the local ops it runs come back here
        if active_fake_mode() is not self._entry_mode:  # DTensor's sharding propagation: metadata, no memory
            return func(*args, **(kwargs or {}))
        c10d = torch.ops.c10d
        collective = func in (c10d._allgather_base_.default, c10d._reduce_scatter_base_.default)
        out = super().__torch_dispatch__(_on_copies(func) if collective and self._entry_mode is None else func,
                                         types, args, kwargs)
        if func is c10d._allgather_base_.default:
            self._mark(args[0], "other", "collective")
        elif func is c10d._reduce_scatter_base_.default:
            self._mark(args[1], "other", "collective")
            self._mark(args[0], "gradients")
        elif func is torch.ops.fsdp.split_with_sizes_copy.default:
            for t in (kwargs or {})["out"]:
                self._mark(t, "parameters", "gathered")
        return out

    def kinds(self, serials) -> dict[str, int]:
        """Bytes of ``serials`` per kind: gathered parameters, collective buffers."""
        out = dict(gathered=0, collective=0)
        for s in serials:
            if s in self.kind:
                out[self.kind[s]] += self.nbytes[s]
        return out
