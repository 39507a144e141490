"""What a training step does, counted rather than assumed: forward calls and saved tensors.

* ``ForwardCounter`` counts forward calls of each decoder block and of its attention and MLP
  (``instruments.anatomy``) with module pre-hooks, which fire on every call, including the recompute ``torch.utils.checkpoint``
  runs in backward (Part 02 · 19);
* ``SavedBytesCounter`` counts what autograd saves for backward with counting-only
  ``saved_tensors_hooks`` (Part 02 · 19 and 42).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.instruments import anatomy


class ForwardCounter:
    """Forward calls of each decoder layer and of its attention and MLP, via module
    pre-hooks.

    Module hooks fire on every ``__call__``, including the recompute
    ``torch.utils.checkpoint`` runs in backward, so ``calls`` and ``recomputes`` are
    measured, not assumed.
    """

    def __init__(self, model):
        layers = anatomy.decoder_blocks(model)
        # checkpoint_mlp's wrapper keeps the MLP as .inner; a block without attention
        # counts none
        unwrap = lambda m: getattr(m, "inner", m)  # noqa: E731
        # (a block without an MLP child, like OPT's: its calls stand for the rest of the
        # block beside attention)
        self.modules = {"layer": list(layers),
                        "attn": [anatomy.attention(b) for b in layers],
                        "mlp": [unwrap(anatomy.mlp(b) or b) for b in layers]}
        # part -> calls per layer
        self.calls = {part: [0] * len(layers) for part in self.modules}
        self._handles = []

    def __enter__(self):
        for part, mods in self.modules.items():
            for i, m in enumerate(mods):
                if m is not None:
                    hook = m.register_forward_pre_hook(self._hook(part, i))
                    self._handles.append(hook)
        return self

    def _hook(self, part, i):
        def hook(module, args):
            self.calls[part][i] += 1
        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def recomputes(self) -> int:
        """Sublayer (attention, MLP) forward executions beyond the first one."""
        return sum(c - 1 for part in ("attn", "mlp") for c in self.calls[part] if c > 0)


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counting-only saved-tensor hooks: what autograd keeps for backward; nothing is
    moved.

    ``storages`` maps each distinct non-parameter storage to its bytes (views of one
    storage count once: that is the memory they hold); ``tensor_bytes`` is the
    per-tensor sum a naive copier moves (views and parameters included); ``param_saves``
    counts saves of parameters (or views). Storages are keyed by identity
    (``StorageWeakRef``, as in ``bp_mech.offload``), not by ``data_ptr()``, which is 0
    for every fake tensor (``FakeTensorMode``). Nested hooks do not stack: inside a
    checkpointed region ``torch.utils.checkpoint``'s own hooks win, so under
    checkpointing this counts what stays saved *outside* the recomputed regions.
    """

    def __init__(self, params=()):
        self._param_storages = {StorageWeakRef(p.untyped_storage()) for p in params}
        self.storages: dict[StorageWeakRef, int] = {}  # storage -> nbytes
        self.tensors = self.tensor_bytes = self.param_saves = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.tensors += 1
        self.tensor_bytes += t.numel() * t.element_size()
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            # identity: no other storage takes its address while the key lives
            key = StorageWeakRef(storage)
            if key in self._param_storages:
                self.param_saves += 1
            elif storage.nbytes():
                self.storages[key] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def bytes_at_least(self, n: int) -> int:
        """Bytes of the saved storages of at least ``n`` bytes (what an offloader
        skipping tiny ones moves)."""
        return sum(b for b in self.storages.values() if b >= n)
