"""What a fake-tensor trace of a Transformers model needs besides ``FakeTensorMode``.

A fake step computes no values, so two things a real step decides from values are told instead
(``patched()``, entered by ``planner.lifecycle.Session.active``):

* the batch holds one sequence per row and no padding: Transformers' packed-sequence check
  (``masking_utils.find_packed_sequence_indices``) would read the position ids, and its padding check
  (``_ignore_causal_mask_sdpa``) the padding mask; under fake tensors either answers by building a
  (B, 1, T, T) mask where the real step lets SDPA mask causally;
* a mixture-of-experts layer's grouped matmul (``transformers.integrations.moe._grouped_mm``): torch's
  fake ``grouped_mm`` takes bfloat16 only, and Transformers' own fallback loops over the groups'
  offsets in backward (a ``.tolist()``, which a fake tensor cannot answer). ``GroupedMatmulShapes``
  stands in for it: the same output, the same saved tensors (the input and the weight, as
  ``grouped_mm``'s autograd saves them) and the same gradients' shapes, so the same bytes, without the
  per-expert loop;
* a scalar draw (``torch.rand([])``, LayerDrop's coin in OPT, BART-style and Whisper decoders): drawn
  for real (a Python number), since Python compares it with the drop rate (under fake tensors it would have no value).

And one shortcut that changes nothing but time (``plain_key``): ``FakeTensorMode``'s dispatch cache builds a key
for every operator, from each tensor argument's metadata (a dataclass of seventeen fields, built and then
flattened field by field, its shape and stride through the key builder's chain of ``isinstance`` tests one
integer at a time). Plain values (integers, dtypes, ...) and a fake tensor's fields are written into the key
as the builder writes them, without the chain or the dataclass: about a fifth of a plan's time saved (the
0.5B's ``bp-mech plan`` in one process, measured); the keys are the same
(``tests/planner/test_fake_ops.py`` compares every key of a traced step).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


class GroupedMatmulShapes(torch.autograd.Function):
    """``grouped_mm(x, w, offs)``'s allocations: out (S, N) from x (S, K) and w (E, K, N); saves x and w;
    backward gives dx (S, K) and dw (E, K, N). Values are not computed (fake tensors carry none)."""

    @staticmethod
    def forward(ctx, x, w):  # x (S, K), w (E, K, N)
        ctx.save_for_backward(x, w)
        return x.new_empty(x.shape[0], w.shape[-1])  # (S, N)

    @staticmethod
    def backward(ctx, grad):  # grad (S, N)
        x, w = ctx.saved_tensors
        # dw in w's own layout (a transposed expert weight gets a transposed gradient, which the
        # parameter's gradient then takes without a copy, as grouped_mm's backward gives it)
        return grad.new_empty(x.shape), grad.new_empty_strided(w.shape, w.stride())


def _grouped_mm(input, weight, offs):
    return GroupedMatmulShapes.apply(input.to(weight.dtype), weight)


_rand = torch.rand


def _rand_scalar_for_real(*size, **kw):
    if size in ((), ([],), ((),)):  # a 0-dim draw that Python will compare: a real one, as a number
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return _rand(*size, **kw).item()
    return _rand(*size, **kw)


def _no_padding(ignore):
    """``masking_utils._ignore_causal_mask_sdpa`` for a batch without padding: the real step finds every
    token real (``fast_all``) and lets SDPA mask causally; a fake one cannot look (``is_tracing``) and would
    build a (B, 1, T, T) mask, which models with a padding mask of ones (OPT) then keep for backward."""
    from transformers import masking_utils

    def ignore_no_padding(*args, **kwargs):
        with mock.patch.object(masking_utils, "is_tracing", lambda *a: False), \
                mock.patch.object(masking_utils, "fast_all", lambda *a: True):
            return ignore(*args, **kwargs)
    return ignore_no_padding


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_SEQUENCES = (tuple, list, torch.Size)
_UNHEADED = (type({}.keys()), type({}.values()))  # a dict's keys and values: written without a type or length


def all_plain(args) -> bool:
    """Whether ``args`` is a tuple or list of plain values only (``plain_key``'s shortcut)."""
    return type(args) in _SEQUENCES and all(type(a) in _PLAIN for a in args)


def _memory_format(t):
    """``extract_tensor_metadata``'s memory format of a strided tensor of plain sizes: the suggested one
    (channels-last only for 4 and 5 dimensions) where ``t`` is contiguous in it, else None."""
    from torch._prims_common import suggest_memory_format

    fmt = suggest_memory_format(t) if t.ndim in (4, 5) else torch.contiguous_format
    return fmt if t.is_contiguous(memory_format=fmt) else None


# the fields ``_write_tensor`` writes, in order: the metadata a PyTorch of another layout keys on goes to ``prep``
FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
          "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
          "dense_dim", "sparse_dim")


def _writes_tensors() -> bool:
    """Whether this PyTorch's ``TensorMetadata`` has the ``FIELDS`` (else fake tensors go to ``prep``)."""
    import dataclasses

    from torch._subclasses import fake_tensor

    meta = getattr(fake_tensor, "TensorMetadata", None)
    return meta is not None and tuple(f.name for f in dataclasses.fields(meta)) == FIELDS


def _write_tensor(result: list, t) -> None:
    """``extract_tensor_metadata(t)._flatten_into(result, ...)`` for a strided fake tensor of plain sizes: its
    fields in order, the shape and stride as ``plain_key`` writes a tuple of integers."""
    shape, stride = t.shape, t.stride()
    result.append(t.dtype)
    for dims, kind in ((shape, torch.Size), (stride, tuple)):
        result.append(kind)
        result.append(f"length_{len(dims)}")
        for v in dims:
            result.append(int)
            result.append(v)
    result += (t.device, t.layout, _memory_format(t), t.storage_offset(), t.untyped_storage().nbytes(),
               t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), t.is_sparse,
               None, None, None)


def plain_key(prep):
    """``FakeTensorMode._prep_args_for_hash`` (``prep``) with a shortcut for what a training step passes: plain
    values (``_PLAIN``: none of the types the builder treats apart), written as ``prep`` writes them (the
    sequence's type and length, then each value's type and the value), and strided fake tensors of this mode
    with plain sizes and no constant, written as their metadata (``_write_tensor``) without building it.
    Anything else goes to ``prep`` one argument at a time, with whatever other arguments this version of
    PyTorch passes (the state, the objects hashed by identity); a dict whole."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake = FakeTensor if _writes_tensors() else None  # (no tensor's type is None: each goes to prep)

    def prep_args_for_hash(mode, result, args, *rest):
        kind = type(args)
        if kind in _SEQUENCES:
            result.append(kind)
            result.append(f"length_{len(args)}")
        elif kind not in _UNHEADED:
            return prep(mode, result, args, *rest)
        for a in args:
            k = type(a)
            if k in _PLAIN:
                result.append(k)
                result.append(a)
            elif (k is fake and a.fake_mode is mode and a.constant is None and a.layout == torch.strided
                  and not a._has_symbolic_sizes_strides):
                _write_tensor(result, a)
            elif k in _SEQUENCES:
                prep_args_for_hash(mode, result, a, *rest)
            else:  # (as prep writes one argument: an iterator is written without a header)
                prep(mode, result, iter((a,)), *rest)
        return None
    return prep_args_for_hash


def patched():
    """The stand-ins above, as a context manager (for fake tensors only: they compute no values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils
    from transformers.integrations import moe

    stack = contextlib.ExitStack()
    prep = getattr(FakeTensorMode, "_prep_args_for_hash", None)  # (a PyTorch without it: no shortcut)
    if prep is not None and not hasattr(prep, "__wrapped_prep__"):  # (not inside another patched())
        fast = plain_key(prep)
        fast.__wrapped_prep__ = prep
        stack.enter_context(mock.patch.object(FakeTensorMode, "_prep_args_for_hash", fast))
    stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None))
    stack.enter_context(mock.patch.object(moe, "_grouped_mm", _grouped_mm))
    stack.enter_context(mock.patch.object(torch, "rand", _rand_scalar_for_real))
    stack.enter_context(mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa",
                                          _no_padding(masking_utils._ignore_causal_mask_sdpa)))
    return stack
