"""Exercises for Part 02 · 42 — offloading saved activations with saved-tensor hooks.

Write the pack and unpack hooks of ``CountingOffload``: they move the tensors autograd saves for
backward to host memory, bring them back when backward needs them, and count the bytes copied
each way.

Check your solution with ``bp-mech check 42`` (or
``pytest tests/test_exercises.py -m ch42 --impl exercises``). The checks compare the gradients
with plain float64 autograd, the byte counts with an independent counting-only hooks pass, and
look at what your packed objects keep alive.
"""

import torch


class CountingOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload activations and count the bytes they move.

    Use it as ``with CountingOffload(model.parameters()): loss = f(...)``; then
    ``loss.backward()``.

    Rules of ``pack(t)`` (called for each tensor autograd saves during forward):

    * parameters stay where they are: ``t`` is a parameter, or a view of one
      (``W.t()``), when its storage is a parameter's storage (compare
      ``t.untyped_storage().data_ptr()`` with the parameters'). Return ``t`` itself;
      copy and count nothing. A parameter lives on the device anyway: copying it frees
      nothing and costs a transfer.
    * tiny tensors stay too: when ``t.untyped_storage().nbytes() < min_bytes``, return
      ``t``. The storage's bytes decide, in bytes whatever the dtype (a bfloat16 element
      is 2 bytes), not the view's: a two-element view of a large storage moves; a
      storage of exactly ``min_bytes`` moves.
    * everything else moves, per *storage*: views of one storage (``h.chunk(2)``,
      ``x.view(...)``) share one host copy, made and counted once. The whole storage as
      bytes is ``torch.empty(0, dtype=torch.uint8, device=t.device)`` followed by
      ``.set_(t.untyped_storage())``; its host copy is ``that.to("cpu", copy=True)``
      (on a CPU-only machine this is a clone: the mechanism and the byte counts are the
      same). Add the storage's ``nbytes()`` to ``d2h_bytes`` once per
      storage. Return what unpack needs (host bytes, dtype, ``t.storage_offset()``,
      ``t.size()``, ``t.stride()``, ``t.device``), and nothing that keeps ``t``'s
      storage alive: freeing it is the point.

    Rules of ``unpack(packed)`` (called in backward):

    * a tensor that stayed: return it unchanged.
    * a moved one: copy the host bytes back, ``host.to(device, copy=True)`` (a fresh
      storage, since backward may write into what it gets), add their size to
      ``h2d_bytes``, and rebuild the view with ``torch.empty(0, dtype=dtype,
      device=device)`` then ``.set_(dev.untyped_storage(), offset, size, stride)``.

    Unpack may be called more than once for one packed object
    (``backward(retain_graph=True)``, then a second backward): every call copies back,
    and counts, again; keep the host copy.

    Shapes and dtypes: any; the rebuilt tensor has the saved tensor's dtype, size,
    stride and values.

    Args (constructor):
        params: the model's parameters, any iterable of tensors: a list, or a generator
            such as ``model.parameters()`` that can be iterated only once.
        min_bytes: storages smaller than this are not moved.

    Attributes:
        d2h_bytes: bytes copied to the host (each storage once).
        h2d_bytes: bytes copied back (each unpack that copies counts its bytes).
    """

    def __init__(self, params, min_bytes: int = 1024):
        self.params = list(params)
        self.min_bytes = min_bytes
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        """Move ``t`` to the host (or keep it); return what ``unpack`` needs. See the
        class docstring."""
        raise NotImplementedError("ex42: CountingOffload.pack")

    def unpack(self, packed) -> torch.Tensor:
        """Give back the saved tensor on its device. See the class docstring."""
        raise NotImplementedError("ex42: CountingOffload.unpack")
