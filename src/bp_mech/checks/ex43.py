"""Checks of exercises/ex43_state_ledger.py against what PyTorch allocates (never the answer file).

Every check builds real ``transformers`` Qwen2 modules of several shapes (tied and untied
embeddings, grouped-query and multi-head attention) and measures: unique parameter
storages, ``.grad`` storages after a backward, AdamW's two moments after one step, and the
storages a ``Qwen2DecoderLayer`` hands to ``saved_tensors_hooks``. Byte counts must match
exactly: a ledger line is a count, not an estimate. Parameters, gradients and AdamW's moments are
measured in float32 (4 bytes per value) and in bfloat16 and float16 (2 bytes: a model cast with
``.to(dtype)``, whose gradients and moments take its dtype), and with ``bytes_per_value`` left at its default
(4, float32). The measurements live in ``ex43_measure``;
the whole contract on drawn shapes and dtypes (float64 too), the variant and the prediction in
``ex43_contract``.
"""

import torch

from bp_mech.checks import ex43_contract
from bp_mech.checks.common import call
from bp_mech.checks.ex43_measure import (
    shape_config,
    describe_shape,
    describe_dtype,
    measure_block_saved_bytes,
    measure_state,
)

# (hidden, heads, kv heads, intermediate, vocab, layers, tied)
SHAPES = [(48, 6, 2, 100, 97, 2, True), (32, 4, 4, 72, 61, 3, False), (64, 8, 1, 120, 130, 1, True)]
DTYPES = [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)]  # (model dtype, bytes_per_value)


def _equal(fn, got, want, at):
    try:
        value = int(got)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{fn}: returned {got!r:.60}, expected an int number of bytes at {at}") from None
    assert value == want, f"{fn}: {value} bytes, PyTorch allocates {want} ({value - want:+d}) at {at}"


def _state_line(m, fn: str, index: int, dtypes) -> None:
    """``m.<fn>(cfg, bytes_per_value)`` against line ``index`` (parameters, gradients, moments) of a real model's
    ``measure_state``, for every shape and each of ``dtypes``; and ``m.<fn>(cfg)``, the signature's default
    (``bytes_per_value=4``), against the float32 model's."""
    for shape in SHAPES:
        cfg = shape_config(shape)
        for dtype, nb in dtypes:
            at = describe_dtype(shape, dtype, nb)
            _equal(fn, call(fn, getattr(m, fn), cfg, nb, at=at), measure_state(shape, dtype)[index], at)
        at = describe_shape(shape, "; bytes_per_value left at its default (4: a float32 model)")
        _equal(fn, call(fn, getattr(m, fn), cfg, at=at), measure_state(shape, torch.float32)[index], at)


def check_param_bytes(m):
    _state_line(m, "param_bytes", 0, DTYPES)


def check_grad_bytes(m):
    _state_line(m, "grad_bytes", 1, DTYPES[:2])


def check_adam_state_bytes(m):
    _state_line(m, "adam_state_bytes", 2, DTYPES[:2])


def check_block_saved_bytes(m):
    for shape, (B, T) in zip(SHAPES, [(2, 16), (3, 10), (1, 33)]):
        cfg = shape_config(shape)
        at = describe_shape(shape, f"; batch {B}, seq {T}")
        got = call("block_saved_bytes", m.block_saved_bytes, cfg, B, T, at=at)
        _equal("block_saved_bytes", got, measure_block_saved_bytes(cfg, B, T), at)


CHECKS = [check_param_bytes, check_grad_bytes, check_adam_state_bytes, check_block_saved_bytes, *ex43_contract.CHECKS]
