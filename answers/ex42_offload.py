"""Answers for Part 02 · 42: the rules of ``bp_mech.offload.ActivationOffload`` without its pool
and streams. (The package's version adds a reused pinned host pool, a side CUDA stream and prefetch.)
"""

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class CountingOffload(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, params, min_bytes: int = 1024):
        self.params = list(params)
        self.min_bytes = min_bytes
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        # storage data_ptr -> (weak ref to the device storage, its version, host bytes)
        self._host = {}
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        self._host = {}  # a new forward: the last one's host copies belong to its graph
        return super().__enter__()

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() in self._param_ptrs or st.nbytes() < self.min_bytes:
            return t  # parameters and tiny tensors stay
        ref, version, host = self._host.get(st.data_ptr(), (None, None, None))
        # a new storage (or a rewritten one)
        if ref is None or ref.expired() or version != t._version:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            host = raw.to("cpu", copy=True)
            self.d2h_bytes += st.nbytes()
            self._host[st.data_ptr()] = (StorageWeakRef(st), t._version, host)
        return host, t.dtype, t.storage_offset(), t.size(), t.stride(), t.device

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, offset, size, stride, device = packed
        dev = host.to(device, copy=True)
        self.h2d_bytes += host.numel()
        view = torch.empty(0, dtype=dtype, device=device)
        return view.set_(dev.untyped_storage(), offset, size, stride)
