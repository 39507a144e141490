"""Checks of exercises/ex10_attention_backward.py: one declaration per function (``engine.Contract``).

References: float64 autograd through ``torch.softmax``, ``F.scaled_dot_product_attention`` (causal), a
masked softmax attention (the sliding window) and transformers' ``repeat_kv`` / ``rotate_half``; the
blockwise backward's memory through ``instruments.peak.PeakMemory`` (tracked CPU storages) against ONE
head's (T, T) score matrix; the saved bytes through saved-tensor hooks. Never the answer file. The
domains: head widths d > 1 (a missing 1/sqrt(d) shows), H/Hkv > 1 with several KV groups and H = Hkv (a
wrong GQA reduction shows; n = 1 must not return dx itself), T = 1 and row 0 (an off-by-one causal mask),
"..." as no to two leading dimensions, blocks of 1, short last tiles and blocks past T, windows of 1, T
and past T, and scores near 1e3 where exp(S) overflows (in every row, or in every other: one maximum for all
rows underflows the rest). The engine derives the rest.
"""

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import autograd_grads, randn64
from bp_mech.checks.engine import Contract, checks

F32 = {torch.float32: 1e-4}  # float32 against the float64 reference: rounding of sums of a few tens of terms
AXES = {"seed": st.integers(0, 2**16), "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
        "T": st.integers(1, 9), "d": st.sampled_from((2, 4, 6)), "view": st.sampled_from(("slice", "transpose"))}
DRAW = st.fixed_dictionaries(AXES)
LARGE = {"all": "all scores near 1e3: exp(S) overflows, subtract the row max (or use the saved lse)",
         "alternate": "scores near 1e3 in every other row, near 0 in the rest: one max for all rows underflows "
                      "the rest to 0 / 0, subtract each row's own max (or use the saved lse)"}
# Scores near 1e3 are rounded to about 1e3 eps (eps = 2.2e-16), so P from a saved lse sums to one only within
# that; dq then sums T terms dS k whose keys share a component near 1e3 that cancels (a row of dS sums to
# zero): a correct float64 backward is good to about 1e3 * 1e3 * eps * T (2e-9 at T = 9), more where dq is
# small against its terms. 1e-7 leaves that room and still fails an overflow (inf, NaN) or float32 work (1e-2).
LARGE_TOL = 1e-7


def _case(seed, lead, T, d, **more):
    return {"seed": seed, "lead": lead, "T": T, "d": d, **more}


def _large(seed, lead, T, d, rows="all", **more):
    """A case of scores near 1e3 in ``rows`` ("all" or "alternate": ``_qkv``), float64 only, at ``LARGE_TOL``."""
    return _case(seed, lead, T, d, large=rows, float64_only=True, tol=LARGE_TOL, **more)


def _large_note(c):
    return c.get("large") and LARGE[c["large"]]


def _qkv(c, n=4):
    """``n`` float64 tensors of shape (..., T, d); ``large="all"``: every score near 1e3 (q_0 = sqrt(d), k_0 =
    1e3 + noise): exp(S) overflows, but each softmax row keeps a spread of order one (well conditioned);
    ``large="alternate"``: so in the even rows, the odd rows' scores near 0 (q_0 = 0 there)."""
    g = torch.Generator().manual_seed(c["seed"])
    q, k, *rest = [randn64(g, *c["lead"], c["T"], c["d"]) for _ in range(n)]
    if c.get("large"):
        q[..., 0], k[..., 0] = math.sqrt(c["d"]), k[..., 0] + 1e3
        if c["large"] == "alternate":
            q[..., 1::2, 0] = 0.0
    return [q, k, *rest]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _softmax(c):
    S, dP = _qkv(c, 2)
    if c.get("flat"):  # one row, shape (n,)
        S, dP = S[0], dP[0]
    else:  # causally masked entries: P holds exact zeros, as in attention
        S = (2 * S).masked_fill(torch.ones(c["T"], c["d"], dtype=torch.bool).triu(1), -math.inf)
    return {"P": torch.softmax(S, -1), "dP": dP}


SOFTMAX = Contract(  # softmax(log P) = P: autograd through softmax at the scores log P
    "softmax_backward", _softmax, lambda P, dP: autograd_grads(lambda s: torch.softmax(s, -1), [P.log()], dP),
    ("dS",), dtypes=F32, draw=DRAW, note=lambda c: not c.get("flat") and "causally masked entries",
    examples={"": [_case(10, (3,), 5, 9), _case(11, (), 1, 9, flat=True), _case(12, (), 4, 7), _case(13, (2, 2), 3, 6)]})


def _head(c):
    return dict(zip(("q", "k", "v", "dO"), _qkv({**c, "lead": ()})))


HEAD = Contract(
    "attention_head_backward", _head,
    lambda q, k, v, dO: autograd_grads(lambda q, k, v: _sdpa(q[None], k[None], v[None])[0], [q, k, v], dO),
    ("dq", "dk", "dv"), dtypes=F32, draw=DRAW, note=_large_note,
    examples={"": [_case(20, (), 9, 16), _case(21, (), 13, 4), _case(22, (), 1, 8), _case(23, (), 2, 3)],
              "large_scores": [_large(90, (), 9, 4), _large(91, (), 6, 8), _large(92, (), 7, 4, "alternate")]})


def _gqa(c):
    g, n = torch.Generator().manual_seed(c["seed"]), c.get("n", 1)
    dx = randn64(g, 2, c["Hkv"] * n, c["T"], c["d"])
    return {"dx": dx, "kv_heads": c["Hkv"]}


def _repeat_kv_grad(dx, kv_heads):
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    x = dx.new_zeros(dx.shape[0], kv_heads, *dx.shape[2:])
    return autograd_grads(lambda x: repeat_kv(x, dx.shape[1] // kv_heads), [x], dx)


GQA = Contract(
    "gqa_reduce", _gqa, _repeat_kv_grad, ("dkv",), dtypes=F32, ref_name="float64 autograd of transformers' repeat_kv",
    draw=st.fixed_dictionaries({**AXES, "Hkv": st.integers(1, 3), "n": st.integers(1, 3)}),
    examples={"": [_case(30 + i, (), 5, 3, Hkv=kv, n=h // kv) for i, (h, kv) in
                   enumerate([(6, 2), (6, 3), (4, 1), (14, 2), (5, 5)])]})  # the last: plain MHA, n = 1


def _lse(q, k):
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.logsumexp(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf), -1)


def _blockwise(c):
    q, k, v, dO = _qkv(c)
    return {"q": q, "k": k, "v": v, "o": _sdpa(q, k, v), "lse": _lse(q, k), "dO": dO,
            "block": c.get("block", 1 + c["seed"] % 4)}


def _one_head(case, call, at):
    """The promise of a blockwise backward: its peak stays below ONE head's (T, T) float64 score matrix."""
    from bp_mech.instruments.peak import PeakMemory

    if case.get("memory"):
        with PeakMemory("cpu") as pm:
            call()
        one_head = case["T"] ** 2 * 8  # the outputs take 3/8 of it here
        assert pm.peak.allocated < one_head, (
            f"blockwise_backward: peak memory {pm.peak.allocated} B reaches one head's full (T, T) score matrix "
            f"({one_head} B; tracked CPU storages) at {at}: recompute P tile by tile, never a whole row of tiles "
            f"per head")


BLOCKWISE = Contract(
    "blockwise_backward", _blockwise, lambda q, k, v, o, lse, dO, block: autograd_grads(_sdpa, [q, k, v], dO),
    ("dq", "dk", "dv"), dtypes=F32, draw=DRAW, promise=_one_head, note=_large_note,
    examples={"": [_case(40 + i, lead, T, d, block=b) for i, (lead, T, d, b) in enumerate(
        [((2, 3), 37, 8, 8), ((2, 3), 32, 8, 8), ((2, 3), 20, 8, 32), ((2, 3), 5, 8, 1), ((), 19, 4, 4),
         ((3,), 23, 16, 8)])],  # a short last tile, exact tiles, block > T, block 1, no / one leading dim
        "memory": [_case(50, (2, 2), 256, 8, block=16, memory=True, float64_only=True)],
        "large_scores": [_large(90, (), 9, 4, block=4), _large(91, (2,), 6, 8, block=4),
                         _large(92, (2,), 7, 4, "alternate", block=3)]})


def _rope(c):
    g, x_shape = torch.Generator().manual_seed(c["seed"]), c.get("x") or (*c["lead"], c["T"], c["d"])
    table, d = c.get("table") or (c["T"], c["d"]), x_shape[-1]
    pos = torch.randint(0, 4096, table[:-1], generator=g).double() if "table" in c else torch.arange(table[0]).double()
    ang = pos[..., None] * 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    randn64(g, *x_shape)  # (x: the forward's input, not an argument)
    return {"dy": randn64(g, *x_shape), "cos": torch.cat([ang, ang], -1).cos(), "sin": torch.cat([ang, ang], -1).sin()}


def _rope_ref(dy, cos, sin):
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    return autograd_grads(lambda x: x * cos + rotate_half(x) * sin, [torch.zeros_like(dy)], dy)  # apply_rotary_pos_emb


ROPE = Contract(
    "rope_backward", _rope, _rope_ref, ("dx",), dtypes=F32, draw=DRAW,
    ref_name="float64 autograd of transformers' RoPE",
    examples={"": [{"seed": 60 + i, "x": x, "table": t} for i, (x, t) in enumerate(
        [((2, 3, 7, 8), (7, 8)), ((7, 8), (7, 8)), ((3, 5, 4), (5, 4)), ((2, 3, 6, 8), (2, 1, 6, 8))])]})  # Qwen2's


def window_attention(q, k, v, window):
    """The reference forward: a causal, banded mask and PyTorch's softmax (differentiated by autograd).

    Args:
        q, k, v: shape (..., T, d).
        window: the keys each query sees, itself included.

    Returns:
        the attention output, shape (..., T, d).

    Example:
        >>> q = torch.ones(3, 2); window_attention(q, q, torch.arange(3.0)[:, None].expand(3, 2), 1)[:, 0]
        tensor([0., 1., 2.])
    """
    T = q.shape[-2]
    band = torch.ones(T, T, dtype=torch.bool).tril() & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    S = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(S.masked_fill(~band, -math.inf), -1) @ v


def _window(c):
    return {**dict(zip(("q", "k", "v", "dO"), _qkv(c))), "window": c.get("window", 1 + c["seed"] % (c["T"] + 1))}


WINDOW = Contract(
    "sliding_window_head_backward", _window,
    lambda q, k, v, dO, window: autograd_grads(lambda q, k, v: window_attention(q, k, v, window), [q, k, v], dO),
    ("dq", "dk", "dv"), dtypes=F32, draw=DRAW, ref_name="float64 autograd of a masked softmax attention",
    note=_large_note,
    examples={"": [_case(100 + i, lead, T, d, window=w) for i, (lead, T, d, w) in enumerate(
        [((), 9, 4, 3), ((), 7, 8, 1), ((2,), 6, 4, 6), ((2,), 5, 4, 9), ((2, 2), 11, 2, 4)])],
        # (band, diagonal, T, past T, 2 dims)
        "large_scores": [_large(110, (2,), 9, 4, window=3), _large(111, (), 8, 4, "alternate", window=8)]})


def measured_eager_saved_bytes(batch, heads, seq, head_dim, dtype) -> int:
    """The stub's forward, run under the saved-tensor hooks: the distinct storages autograd keeps.

    Args:
        batch, heads, seq, head_dim: B, H, T, d.
        dtype: the dtype of q, k, v.

    Returns:
        the bytes the hooks see, an int.

    Example:
        >>> measured_eager_saved_bytes(1, 1, 2, 2, torch.float32) > 0
        True
    """
    from bp_mech.instruments.counters import SavedBytesCounter

    q, k, v = (torch.zeros(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    counter = SavedBytesCounter()
    with counter:
        S = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        torch.softmax(S.masked_fill(mask, float("-inf")), dim=-1) @ v
    return counter.bytes


PREDICT = Contract(
    "predict_eager_saved_bytes", lambda c: dict(zip(("batch", "heads", "seq", "head_dim", "dtype"), c["args"])),
    lambda **a: (measured_eager_saved_bytes(**a),), ("the prediction",), returns=int,
    ref_name="the saved-tensor hooks' measurement", note=lambda c: "exact: a byte count has no noise",
    examples={"": [{"args": (2, 3, 7, 4, torch.float32)}, {"args": (1, 4, 16, 8, torch.bfloat16)},
                   {"args": (3, 2, 5, 2, torch.float64)}]})

CHECKS = checks(SOFTMAX, HEAD, GQA, BLOCKWISE, ROPE, WINDOW, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex10.check_blockwise_backward__memory, ...
