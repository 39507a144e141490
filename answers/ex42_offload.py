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


class BudgetOffload(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, params, budget: int):
        self.params = list(params)
        self.budget = budget
        self.resident_bytes = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        # storage data_ptr -> (weak ref to the storage, host bytes or None: resident)
        self._fate = {}
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        self._fate, self.resident_bytes = {}, 0  # a new forward, a new budget
        return super().__enter__()

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() in self._param_ptrs:
            return t  # parameters stay, outside the budget
        ref, host = self._fate.get(st.data_ptr(), (None, None))
        if ref is None or ref.expired():  # a storage not seen in this forward
            if self.resident_bytes + st.nbytes() <= self.budget:
                self.resident_bytes += st.nbytes()
            else:
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
                host = raw.to("cpu", copy=True)
                self.d2h_bytes += st.nbytes()
            self._fate[st.data_ptr()] = (StorageWeakRef(st), host)
        if host is None:
            return t
        return host, t.dtype, t.storage_offset(), t.size(), t.stride(), t.device

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, offset, size, stride, device = packed
        dev = host.to(device, copy=True)
        self.h2d_bytes += host.numel()
        view = torch.empty(0, dtype=dtype, device=device)
        return view.set_(dev.untyped_storage(), offset, size, stride)


def predict_d2h_bytes(batch: int, seq: int, width: int, expansion: int, layers: int,
                      min_bytes: int, element_bytes: int) -> int:
    """What each block saves for its backward: the first Linear its input (H bytes),
    SiLU its input and the second Linear its input (e H each). The offload moves a
    storage once, and only if it reaches ``min_bytes``; the weights never move. Sum
    per block, times the number of blocks."""
    H = batch * seq * width * element_bytes  # a block's input
    inner = expansion * H  # SiLU's input, the second Linear's input
    per_layer = (H if H >= min_bytes else 0) + (2 * inner if inner >= min_bytes else 0)
    return layers * per_layer
