"""Checks of exercises/ex43_state_ledger.py: one declaration per function (``engine.Contract``).

References, never the answer file: what PyTorch allocates (``ex43_measure``), exactly: unique parameter storages,
``.grad`` storages after a backward and AdamW's two moments after one step of real ``transformers`` Qwen2 models
cast to the dtype of ``bytes_per_value`` (8 float64, 4 float32, 2 both bfloat16 and float16: the two must agree);
the storages a real float32 ``Qwen2DecoderLayer`` hands to ``saved_tensors_hooks``; those of ``torch.nn``'s
``Linear, GELU, Linear`` (in both GELU approximations, with and without biases: the docstring says they do not
matter, and the measurements must agree); a real steady-state CPU step's "after forward" total, within
``PREDICT_TOL``. The cases: the chapter's shapes (grouped-query, plain multi-head and multi-query attention, tied
and untied, one to three layers) and one query head, then shapes, sizes and widths drawn from ``ex43_measure.POOL``.
The engine derives the rest: exactly an ``int``, ``cfg`` left as it was (field by field), ``bytes_per_value`` left
out at its documented default 4, global state restored.
"""

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import int_as_float
from bp_mech.checks.engine import Contract, checks
from bp_mech.checks.ex43_measure import (POOL, SHAPES, describe_shape, measure_block_saved_bytes, measure_forward_bytes,
                                         measure_gelu_mlp_saved_bytes, measure_state, shape_config, shape_of)

WIDTHS = {8: (torch.float64,), 4: (torch.float32,), 2: (torch.bfloat16, torch.float16)}  # bytes -> model dtypes
PREDICT_TOL = 0.02  # the lines the prediction leaves out are < 1 % at PREDICT_CASES; each line it keeps is > 2 %
PREDICT_CASES = [((24, 2, 2, 48, 320, 1, True), 4, 24), ((40, 5, 1, 96, 200, 3, False), 3, 20),
                 ((80, 4, 1, 8, 24, 1, True), 16, 8)]  # the last: the final norm's saves are 16 % of the total
ONE_HEAD = [POOL[0], POOL[8]]  # one query head: its (n, 1)-sized saves and log-sum-exp are the size of a 1/rms


def _one(measured: list, what: str) -> int:
    """The one count the measurements agree on (the reference's own consistency, not the learner's)."""
    if len(set(measured)) != 1:
        raise RuntimeError(f"ex43's reference: the measurements of {what} disagree ({measured}): PyTorch changed")
    return measured[0]


def _cfg(c):
    return {"cfg": shape_config(c["shape"]), "bytes_per_value": c["nb"]}


def _line(fn: str, index: int, what: str) -> Contract:
    """A ledger line of the whole model: ``measure_state``'s ``index``."""
    def ref(cfg, bytes_per_value):
        return (_one([measure_state(shape_of(cfg), d)[index] for d in WIDTHS[bytes_per_value]], "16-bit models"),)

    return Contract(
        fn, _cfg, ref, ("the byte count",), returns=int, defaults={"bytes_per_value": 4},
        ref_name=f"a real Qwen2ForCausalLM ({what})", note=lambda c: describe_shape(c["shape"]),
        draw=st.fixed_dictionaries({"shape": st.sampled_from(POOL), "nb": st.sampled_from(list(WIDTHS))}),
        examples={"": [{"shape": s, "nb": nb} for s in SHAPES for nb in WIDTHS] +
                      [{"shape": s, "nb": nb} for s, nb in zip(ONE_HEAD, (8, 4))]})


PARAMS = _line("param_bytes", 0, "its unique parameter storages")
GRADS = _line("grad_bytes", 1, "its .grad storages after a backward")
ADAM = _line("adam_state_bytes", 2, "AdamW's exp_avg and exp_avg_sq after one step")

BLOCK = Contract(
    "block_saved_bytes", lambda c: {"cfg": shape_config(c["shape"]), "batch": c["B"], "seq": c["T"]},
    lambda cfg, batch, seq: (measure_block_saved_bytes(cfg, batch, seq),), ("the byte count",), returns=int,
    ref_name="a real float32 Qwen2DecoderLayer (the storages it hands to saved_tensors_hooks, weights and cos/sin "
             "left out)", note=lambda c: describe_shape(c["shape"]),
    draw=st.fixed_dictionaries({"shape": st.sampled_from(POOL), "B": st.integers(1, 3),
                                "T": st.sampled_from([1, 2, 5, 8, 13])}),
    examples={"": [{"shape": s, "B": B, "T": T} for s, (B, T) in zip(SHAPES, [(2, 16), (3, 10), (1, 33)])] +
                  [{"shape": s, "B": 2, "T": 5} for s in ONE_HEAD]})


def _gelu(hidden, intermediate, batch, seq, bytes_per_value):
    return (_one([measure_gelu_mlp_saved_bytes(hidden, intermediate, batch, seq, d, a, b)
                  for d in WIDTHS[bytes_per_value] for a in ("none", "tanh") for b in (True, False)],
                 "GELU approximations, biases and 16-bit dtypes"),)


GELU = Contract(  # (hidden, intermediate, batch, seq, bytes_per_value)
    "gelu_mlp_saved_bytes", lambda c: dict(zip(("hidden", "intermediate", "batch", "seq", "bytes_per_value"),
                                                    c["args"])),
    _gelu, ("the byte count",), returns=int, defaults={"bytes_per_value": 4},
    ref_name="torch.nn's Linear, GELU, Linear (the storages they hand to saved_tensors_hooks, weights and biases left "
             "out)",
    draw=st.tuples(st.integers(1, 24), st.integers(1, 48), st.integers(1, 3), st.integers(1, 6),
                   st.sampled_from(list(WIDTHS))).map(lambda a: {"args": a}),
    examples={"": [{"args": a} for a in ((8, 20, 2, 3, 4), (16, 64, 1, 5, 2), (12, 7, 3, 4, 8), (4, 4, 1, 1, 2),
                                         (1, 1, 1, 1, 8))]})


def _predict_use(f):
    """An int, read as a float for a relative comparison within ``PREDICT_TOL``."""
    def g(cfg, batch, seq):
        return int_as_float("predict_forward_bytes", f(cfg, batch, seq),
                            f" at {describe_shape(shape_of(cfg))}, batch {batch}, seq {seq}")
    return g


PREDICT = Contract(
    "predict_forward_bytes", lambda c: {"cfg": shape_config(c["shape"]), "batch": c["B"], "seq": c["T"]},
    lambda cfg, batch, seq: (float(measure_forward_bytes(shape_of(cfg), batch, seq)),), ("the prediction",),
    use=_predict_use, tol=PREDICT_TOL, note=lambda c: describe_shape(c["shape"]),
    ref_name="a real steady-state float32 step (the chapter's tracker, after forward)",
    examples={"": [{"shape": s, "B": B, "T": T} for s, B, T in PREDICT_CASES]})

CHECKS = checks(PARAMS, GRADS, ADAM, BLOCK, GELU, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex43.check_param_bytes, ...
