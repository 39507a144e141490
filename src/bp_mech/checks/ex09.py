"""Checks of exercises/ex09_local_backward.py: one declaration per function (``engine.Contract``).

References: float64 autograd (``F.linear``, ``F.silu``, ``F.rms_norm``, the Qwen2 MLP, ``F.cross_entropy``,
``F.layer_norm``) and, for the saved-bytes prediction, a measurement with saved-tensor hooks on
transformers' ``Qwen2MLP``; never the answer file. The domains are the docstrings': every leading shape
("..." as no to three dimensions), square weights (a missing transpose gives wrong numbers, not a
shape error), eps where it decides (a zero row, rows of ~1e-4), ``ignore_index`` negative, a real class
id and one past the vocabulary, inputs of size 1000 (a formula without a stable sigmoid or softmax
overflows), rows offset by 1e4 and constant rows (LayerNorm's variance). The engine derives the rest:
defaults left out, inputs unchanged, strided views, float32 in float32 out, no aliasing, state restored.
"""

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import autograd_grads, randn64
from bp_mech.checks.engine import Contract, checks

F32 = {torch.float32: 1e-4}  # float32 against the float64 reference: rounding of a few sums of ~10 terms
AXES = {"seed": st.integers(0, 2**16), "lead": st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
        "width": st.sampled_from((2, 3, 5, 8)), "view": st.sampled_from(("slice", "transpose"))}


def _draw(**more):
    return st.fixed_dictionaries({**AXES, **{k: v if hasattr(v, "example") else st.just(v) for k, v in more.items()}})


def _g(c):
    return torch.Generator().manual_seed(c["seed"])


def _case(seed, lead, width, **more):
    return {"seed": seed, "lead": lead, "width": width, **more}


def _linear(c):
    g, ci = _g(c), c["width"]
    co = ci + c.get("wider", 0)
    return {"x": randn64(g, *c["lead"], ci), "W": randn64(g, co, ci), "dy": randn64(g, *c["lead"], co)}


LINEAR = Contract(
    "linear_backward", _linear, lambda x, W, dy: autograd_grads(F.linear, [x, W, x.new_zeros(len(W))], dy),
    ("dx", "dW", "db"), dtypes=F32, draw=_draw(wider=1),
    examples={"": [_case(100, (2, 5), 8), _case(101, (3, 4), 6, wider=4), _case(102, (7,), 5),
                   _case(103, (2, 3, 2), 6, wider=-2)]})

BIG = torch.tensor([-1000.0, -750.0, -100.0, -40.0, 0.0, 40.0, 100.0, 750.0, 1000.0], dtype=torch.float64)


def _silu(c):
    if c.get("kind") == "large":
        return {"x": BIG.clone(), "dy": torch.linspace(-1, 1, len(BIG), dtype=torch.float64) + 0.3}
    g, shape = _g(c), (*c["lead"], c["width"])
    return {"x": 4 * randn64(g, *shape), "dy": randn64(g, *shape)}


SILU = Contract(
    "silu_backward", _silu, lambda x, dy: autograd_grads(F.silu, [x], dy), ("dx",), dtypes=F32, draw=_draw(),
    examples={"": [_case(7, (3, 7), 9), _case(8, (), 11), _case(9, (4,), 6), _case(10, (2, 3, 2), 5)],
              "large_inputs": [{"kind": "large"}]},
    note=lambda c: c.get("kind") and "x = ±40, ±100, ±750, ±1000: exp(-x) overflows, use sigmoid, not a quotient "
                                     "of exponentials")


def _rmsnorm(c):
    g, C = _g(c), c["width"]
    x, w, dy = randn64(g, *c["lead"], C), 1 + 0.3 * randn64(g, C), randn64(g, *c["lead"], C)
    if c.get("kind") == "tiny":
        x[0, 1] = 0.0  # a zero row (a padding vector): only eps keeps r finite
        x[1, 2] *= 1e-4  # mean(x^2) ~ 1e-8, far below eps: eps decides r
    return {"x": x, "w": w, "dy": dy, "eps": c.get("eps", 1e-6)}


RMSNORM = Contract(
    "rmsnorm_backward", _rmsnorm,
    lambda x, w, dy, eps: autograd_grads(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps), [x, w], dy),
    ("dx", "dw"), dtypes=F32, defaults={"eps": 1e-6}, draw=_draw(eps=st.sampled_from((1e-6, 1e-2))),
    examples={"": [_case(1, (2, 5), 12), _case(2, (7,), 12, eps=1e-2), _case(3, (2, 2, 3), 12)],
              "tiny_rows": [_case(4, (2, 4), 12, kind="tiny")]},
    note=lambda c: c.get("kind") and "a zero row and a row of ~1e-4: eps decides r")


def _swiglu(c):
    g, C = _g(c), c["width"]
    inter = C + c.get("extra", 2)
    return {"x": randn64(g, *c["lead"], C), "Wg": randn64(g, inter, C) / 3, "Wu": randn64(g, inter, C) / 3,
            "Wd": randn64(g, C, inter) / 3, "dy": randn64(g, *c["lead"], C)}


def _mlp(x, Wg, Wu, Wd):
    return F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)


SWIGLU = Contract(
    "swiglu_mlp_backward", _swiglu,
    lambda x, Wg, Wu, Wd, dy: autograd_grads(_mlp, [x, Wg, Wu, Wd], dy), ("dx", "dWg", "dWu", "dWd"), dtypes=F32,
    draw=_draw(), examples={"": [_case(3, (2, 4), 8, extra=0), _case(4, (5,), 6, extra=4), _case(5, (2, 3, 2), 4, extra=3)]})

SHIFT = torch.tensor([1000.0, -1000.0, 0.0, 800.0, -800.0, 0.0], dtype=torch.float64)


def _ce(c):
    g, N, V, ignore = _g(c), c["rows"], c["width"], c.get("ignore", -100)
    logits = 2 * randn64(g, N, V) + (SHIFT[:, None] if c.get("kind") == "large" else 0)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[targets == ignore] = (ignore + 1) % V  # the real targets avoid the ignored id ...
    targets[list(c.get("ignored", ()))] = ignore  # ... and these rows carry it
    return {"logits": logits, "targets": targets, "ignore_index": ignore}


def _ce_ref(logits, targets, ignore_index):
    one = torch.ones((), dtype=torch.float64)
    return autograd_grads(lambda z: F.cross_entropy(z, targets, ignore_index=ignore_index), [logits], one)


def _ce_case(seed, ignore, **more):
    return {"seed": seed, "rows": 12, "width": 17, "ignore": ignore, "ignored": (0, 6, 7, 11), **more}


CROSS_ENTROPY = Contract(
    "cross_entropy_backward", _ce, _ce_ref, ("dlogits",), dtypes=F32, defaults={"ignore_index": -100},
    draw=_draw(rows=st.integers(2, 9), width=st.sampled_from((1, 3, 5, 11)), ignore=st.sampled_from((-100, -1, 3)),
               ignored=(0,)),
    examples={"": [_ce_case(5, -100, ignored=(1, 4, 5))],
              "ignore_index": [_ce_case(50, -1), _ce_case(51, 3), _ce_case(52, 17)],
              "large_logits": [{"seed": 6, "rows": 6, "width": 11, "kind": "large"}]},
    note=lambda c: (f"ignore_index on {len(c.get('ignored', ()))} of {c['rows']} rows" if "kind" not in c
                    else "rows shifted by ±800 and ±1000: exp overflows, subtract the row max"))


def _layernorm(c):
    g, C = _g(c), c["width"]
    x, dy = randn64(g, *c["lead"], C), randn64(g, *c["lead"], C)
    w, b = 1 + 0.3 * randn64(g, C), randn64(g, C)
    if c.get("kind") == "offset":
        x[0] += 1e4  # a large common offset: mean(x^2) - mean(x)^2 loses eight digits to cancellation
        x[1, 2] = 3.0  # a constant row: variance 0, eps decides r
    return {"x": x, "w": w, "b": b, "dy": dy, "eps": c.get("eps", 1e-5)}


LAYERNORM = Contract(
    "layernorm_backward", _layernorm,
    lambda x, w, b, dy, eps: autograd_grads(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), [x, w, b], dy),
    ("dx", "dw", "db"), dtypes=F32, defaults={"eps": 1e-5}, draw=_draw(width=st.sampled_from((3, 5, 8, 11))),
    examples={"": [_case(70, (2, 5), 12), _case(71, (7,), 6, eps=1e-2), _case(72, (2, 2, 3), 9)],
              "offset_and_constant_rows": [_case(80, (3, 4), 10, kind="offset", float64_only=True)]},
    note=lambda c: c.get("kind") and "rows offset by 1e4 and a constant row")  # (C = 2: dx ~ eps, all rounding)


def measured_mlp_saved_bytes(batch, seq, hidden, inter, dtype) -> int:
    """What autograd keeps for one forward of ``transformers``' Qwen2MLP: distinct non-weight storages.

    Args:
        batch, seq, hidden, inter: B, T, C, I.
        dtype: the dtype of x and the weights.

    Returns:
        the bytes the saved-tensor hooks see, an int.

    Example:
        >>> measured_mlp_saved_bytes(1, 1, 2, 2, torch.float32) > 0
        True
    """
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from bp_mech.instruments.counters import SavedBytesCounter

    mlp = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")).to(dtype)
    x = torch.zeros(batch, seq, hidden, dtype=dtype, requires_grad=True)
    counter = SavedBytesCounter(params=mlp.parameters())
    with counter:
        mlp(x)
    return counter.bytes


PREDICT = Contract(
    "predict_mlp_saved_bytes", lambda c: dict(zip(("batch", "seq", "hidden", "inter", "dtype"), c["args"])),
    lambda **a: (measured_mlp_saved_bytes(**a),), ("the prediction",), returns=int,
    ref_name="the saved-tensor hooks' measurement", note=lambda c: "exact: a byte count has no noise",
    examples={"": [{"args": (2, 3, 8, 12, torch.float32)}, {"args": (1, 5, 6, 20, torch.bfloat16)},
                   {"args": (3, 2, 4, 4, torch.float64)}]})

CHECKS = checks(LINEAR, SILU, RMSNORM, SWIGLU, CROSS_ENTROPY, LAYERNORM, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex09.check_silu_backward__large_inputs, ...
