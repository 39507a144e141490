"""Exercises for Part 02 · 42 — offloading saved activations with saved-tensor hooks.

Write the pack and unpack hooks of ``CountingOffload``: they move the tensors autograd saves for
backward to host memory, bring them back when backward needs them, and count the bytes copied
each way. Then ``BudgetOffload`` (variant): offload only what does not fit in a device budget;
and ``predict_d2h_bytes`` (predict, then measure): the bytes an offload moves per step, by the
chapter's count.

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

    Contract (checked): ``pack`` leaves ``t`` as it was (its values are still used by
    the forward); ``d2h_bytes`` and ``h2d_bytes`` are Python ``int``; two instances
    share nothing (no counter or host copy kept on the class); the ``with`` block
    removes the hooks on exit, also when its body raises, and the exception
    propagates (``__exit__`` does not swallow it); the instance may be entered
    again for the next forward: the counters then keep accumulating.

    Args (constructor):
        params: the model's parameters, any iterable of tensors: a list, or a generator
            such as ``model.parameters()`` that can be iterated only once.
        min_bytes: storages smaller than this are not moved.

    Attributes:
        d2h_bytes: bytes copied to the host (each storage once per forward), summed
            over every ``with`` block of this instance.
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


class BudgetOffload(torch.autograd.graph.saved_tensors_hooks):
    """Offload only what does not fit: keep saved activations on the device up to
    ``budget`` bytes, move the rest to the host.

    ``CountingOffload`` moves every storage of at least ``min_bytes``. Here the rule is
    a budget of device memory for saved activations, filled first come, first served,
    storage by storage in the order autograd saves them:

    * parameters (and views of them, same storage) stay and do not use the budget;
    * a storage seen before in this forward (another view of it) gets the same fate:
      resident again without using more budget, or rebuilt from the same host copy
      without copying or counting it again;
    * a new storage of ``n = t.untyped_storage().nbytes()`` bytes stays when
      ``resident_bytes + n <= budget`` (then ``resident_bytes += n``), else it moves
      (``d2h_bytes += n``). A later, smaller storage may still fit after a larger
      one moved.

    Unpack as in ``CountingOffload``: a resident tensor comes back unchanged, a moved
    one from a fresh copy of its host bytes (``h2d_bytes`` += the storage's bytes at
    each unpack), with its dtype, size, stride and values.

    Contract (checked against plain float64 autograd, and against an independent
    counting pass that replays the rule on the storages the forward saves): the
    gradients are those of the plain step (a retained graph's second backward too);
    ``pack`` does not modify ``t`` and the packed object of a moved tensor does not keep
    its storage alive; the counters are Python ``int``; two instances share nothing;
    the ``with`` block removes the hooks on exit and lets an exception through.
    Entering the instance again starts a new forward: ``resident_bytes`` restarts at 0
    and no storage is "seen before", while ``d2h_bytes`` and ``h2d_bytes`` accumulate.

    Args (constructor):
        params: the model's parameters, any iterable of tensors (a generator too).
        budget: bytes of saved activations that may stay on the device, an int >= 0.

    Attributes:
        resident_bytes: bytes of the storages kept on the device in this forward.
        d2h_bytes: bytes copied to the host; h2d_bytes: bytes copied back.
    """

    def __init__(self, params, budget: int):
        self.params = list(params)
        self.budget = budget
        self.resident_bytes = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        """Keep ``t`` or move its storage, by the budget rule."""
        raise NotImplementedError("ex42: BudgetOffload.pack")

    def unpack(self, packed) -> torch.Tensor:
        """Give back the saved tensor on its device."""
        raise NotImplementedError("ex42: BudgetOffload.unpack")


def predict_d2h_bytes(batch: int, seq: int, width: int, expansion: int, layers: int,
                      min_bytes: int, element_bytes: int) -> int:
    """Predict the bytes an offload moves to the host in one step (no measurement).

    The workload: an input ``x`` of shape ``(batch, seq, width)`` that requires grad,
    then ``layers`` blocks ``Linear(width, expansion * width) -> SiLU ->
    Linear(expansion * width, width)``, ``element_bytes`` bytes per element; the loss
    is ``out.sum()``. The offload is the package's ``ActivationOffload`` on the CPU
    with ``OffloadConfig(min_bytes=min_bytes)``: the chapter's rules (no parameters,
    no storage under ``min_bytes``, each storage once). Work out what the forward
    saves for the backward from what each operation's backward needs (Part 02 · 09).

    Returns:
        ``D``, the bytes copied device -> host in forward, a Python ``int``; the
        check wants it exact (the hooks count bytes, there is no noise).
    """
    raise NotImplementedError("ex42: predict_d2h_bytes")
