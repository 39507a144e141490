"""Checks of exercises/ex10_attention_backward.py, part two: the contract around the numbers, the
sliding-window variant and the saved-bytes prediction (never against the answer file).

The contract is chapter 09's ``hold_contract`` (inputs unchanged, the reference values, no output
sharing an input's storage, the same values for sliced or transposed views, float32 in float32 out),
explored by hypothesis over seeds, lengths, head widths, leading dimensions and views; and, where the
function computes scores, scores of size 1e3, where a softmax written as exp(S) / sum exp(S), or
exp(S) / exp(L), overflows to NaN. References: float64 autograd of ``torch.softmax``, of a masked
softmax attention, of ``F.scaled_dot_product_attention`` and of transformers' ``repeat_kv`` and RoPE.
"""

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import assert_all_close, autograd_grads, call, randn64
from bp_mech.checks.ex09_contract import hold_contract, saved_bytes_predicted
from bp_mech.checks.properties import assert_finite, explore, one_thread

REF = "float64 autograd"

CASES = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    "T": st.integers(1, 9),
    "d": st.sampled_from((2, 4, 6)),
    "view": st.sampled_from(("slice", "transpose")),
})


def _qkv(c, n=4, large=False):
    """``n`` float64 tensors of shape (..., T, d); ``large``: every score near 1e3 (q_0 = sqrt(d) and
    k_0 = 1e3 + noise): exp(S) overflows, but each softmax row keeps a spread of order one, so the
    gradients are well conditioned and the comparison stays exact."""
    g = torch.Generator().manual_seed(c["seed"])
    q, k, *rest = [randn64(g, *c["lead"], c["T"], c["d"]) for _ in range(n)]
    if large:
        q[..., 0], k[..., 0] = math.sqrt(c["d"]), k[..., 0] + 1e3
    return [q, k, *rest]


def _at(c, extra=""):
    return f"q shape {c['lead'] + (c['T'], c['d'])}{extra}"


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def check_softmax_backward__contract(m):
    def body(c):
        S, dP = _qkv(c, 2)
        S = (2 * S).masked_fill(torch.ones(c["T"], c["d"], dtype=torch.bool).triu(1), float("-inf"))
        want = autograd_grads(lambda s: torch.softmax(s, -1), [S], dP)
        hold_contract("softmax_backward", m.softmax_backward, (torch.softmax(S, -1), dP), ("P", "dP"), ("dS",), want,
                      at=f"P shape {tuple(S.shape)} with causally masked entries", view=c["view"])
    explore(CASES, body)


def check_attention_head_backward__contract(m):
    def body(c):
        q, k, v, dO = _qkv({**c, "lead": ()})
        want = autograd_grads(lambda q, k, v: _sdpa(q[None], k[None], v[None])[0], [q, k, v], dO)
        hold_contract("attention_head_backward", m.attention_head_backward, (q, k, v, dO), ("q", "k", "v", "dO"),
                      ("dq", "dk", "dv"), want, at=f"T={c['T']}, d={c['d']}", view=c["view"])
    explore(CASES, body)


def _large_scores(fn, f, make_args, leads=((), (2,))):
    """Scores near 1e3 (``_qkv(large=True)``), where exp(S) overflows float64 (past 709)."""
    for seed, lead in enumerate(leads):
        c = {"seed": 90 + seed, "lead": lead, "T": 9 - 3 * seed, "d": 4 + 4 * seed}
        q, k, v, dO = _qkv(c, large=True)
        at = f"q shape {tuple(q.shape)}, scores near {float((q @ k.mT).mean()) / math.sqrt(c['d']):.0f}"
        with one_thread():
            got = call(fn, f, *make_args(q, k, v, dO), at=at)
            assert_finite(fn, "(dq, dk, dv)", got, at)
            want = autograd_grads(_sdpa, [q, k, v], dO)
        assert_all_close(fn, ("dq", "dk", "dv"), got, want, tol=1e-10, ref=REF, at=at)


def check_attention_head_backward__large_scores(m):
    _large_scores("attention_head_backward", m.attention_head_backward, lambda *qkvo: qkvo, leads=((), ()))


def check_gqa_reduce__contract(m):
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    def body(c):
        g, Hkv = torch.Generator().manual_seed(c["seed"]), 1 + len(c["lead"])
        n = c["lead"][0] if c["lead"] else 1  # n = 1: Hkv = H, the answer equals dx (and must not be dx)
        x, dx = randn64(g, 2, Hkv, c["T"], c["d"]), randn64(g, 2, Hkv * n, c["T"], c["d"])
        want = autograd_grads(lambda x: repeat_kv(x, n), [x], dx)
        hold_contract("gqa_reduce", m.gqa_reduce, (dx, Hkv), ("dx", "kv_heads"), ("dkv",), want,
                      at=f"H={Hkv * n}, Hkv={Hkv}, dx shape {tuple(dx.shape)}", view=c["view"],
                      ref="float64 autograd of transformers' repeat_kv")
    explore(CASES, body)


def _lse(q, k):
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.logsumexp(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)


def check_blockwise_backward__contract(m):
    def body(c):
        q, k, v, dO = _qkv(c)
        block = 1 + c["seed"] % 4
        want = autograd_grads(_sdpa, [q, k, v], dO)
        hold_contract("blockwise_backward", m.blockwise_backward, (q, k, v, _sdpa(q, k, v), _lse(q, k), dO, block),
                      ("q", "k", "v", "o", "lse", "dO", "block"), ("dq", "dk", "dv"), want,
                      at=_at(c, f", block={block}"), view=c["view"])
    explore(CASES, body)


def check_blockwise_backward__large_scores(m):
    _large_scores("blockwise_backward", m.blockwise_backward,
                  lambda q, k, v, dO: (q, k, v, _sdpa(q, k, v), _lse(q, k), dO, 4))


def check_rope_backward__contract(m):
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    def body(c):
        g, T, d = torch.Generator().manual_seed(c["seed"]), c["T"], c["d"]
        ang = torch.arange(T, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x, dy = randn64(g, *c["lead"], T, d), randn64(g, *c["lead"], T, d)
        want = autograd_grads(lambda x: x * cos + rotate_half(x) * sin, [x], dy)
        hold_contract("rope_backward", m.rope_backward, (dy, cos, sin), ("dy", "cos", "sin"), ("dx",), want,
                      at=f"dy shape {tuple(dy.shape)}, cos/sin shape {(T, d)}", view=c["view"],
                      ref="float64 autograd of transformers' RoPE")
    explore(CASES, body)


# --- the variant: a sliding-window head --------------------------------------------------------


def window_attention(q, k, v, window):
    """The reference forward: a causal, banded mask and PyTorch's softmax (differentiated by autograd)."""
    T = q.shape[-2]
    band = torch.ones(T, T, dtype=torch.bool).tril() & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    S = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(S.masked_fill(~band, float("-inf")), -1) @ v


def _window_case(m, q, k, v, dO, window, at, view=None):
    with one_thread():
        want = autograd_grads(lambda q, k, v: window_attention(q, k, v, window), [q, k, v], dO)
    f = m.sliding_window_head_backward
    if view is None:
        with one_thread():
            got = call("sliding_window_head_backward", f, q, k, v, dO, window, at=at)
        assert_finite("sliding_window_head_backward", "(dq, dk, dv)", got, at)
        assert_all_close("sliding_window_head_backward", ("dq", "dk", "dv"), got, want, tol=1e-10,
                         ref="float64 autograd of a masked softmax attention", at=at)
    else:
        hold_contract("sliding_window_head_backward", f, (q, k, v, dO, window), ("q", "k", "v", "dO", "window"),
                      ("dq", "dk", "dv"), want, at=at, view=view, ref="float64 autograd of a masked softmax attention")


def check_sliding_window_head_backward(m):
    # (leading dims, T, d, window): a band, the diagonal alone, a window of T and past T, two leading dims
    for seed, (lead, T, d, w) in enumerate((((), 9, 4, 3), ((), 7, 8, 1), ((2,), 6, 4, 6), ((2,), 5, 4, 9),
                                            ((2, 2), 11, 2, 4))):
        c = {"seed": 100 + seed, "lead": lead, "T": T, "d": d}
        _window_case(m, *_qkv(c), w, _at(c, f", window={w}"))


def check_sliding_window_head_backward__large_scores(m):
    c = {"seed": 110, "lead": (2,), "T": 9, "d": 4}
    _window_case(m, *_qkv(c, large=True), 3, _at(c, ", window=3, scores near 1e3"))


def check_sliding_window_head_backward__contract(m):
    def body(c):
        w = 1 + c["seed"] % (c["T"] + 1)
        _window_case(m, *_qkv(c), w, _at(c, f", window={w}"), view=c["view"])
    explore(CASES, body)


# --- predict, then measure: what eager attention keeps ------------------------------------------


def measured_eager_saved_bytes(batch, heads, seq, head_dim, dtype) -> int:
    """The stub's forward, run under the saved-tensor hooks: the distinct storages autograd keeps."""
    from bp_mech.instruments.counters import SavedBytesCounter

    q, k, v = (torch.zeros(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    counter = SavedBytesCounter()
    with counter:
        S = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        torch.softmax(S.masked_fill(mask, float("-inf")), dim=-1) @ v
    return counter.bytes


PREDICTIONS = [(2, 3, 7, 4, torch.float32), (1, 4, 16, 8, torch.bfloat16), (3, 2, 5, 2, torch.float64)]


def check_predict_eager_saved_bytes(m):
    saved_bytes_predicted("predict_eager_saved_bytes", m.predict_eager_saved_bytes, PREDICTIONS, "(B, H, T, d)",
                          measured_eager_saved_bytes)


CHECKS = [check_softmax_backward__contract, check_attention_head_backward__contract,
          check_attention_head_backward__large_scores, check_gqa_reduce__contract, check_blockwise_backward__contract,
          check_blockwise_backward__large_scores, check_rope_backward__contract, check_sliding_window_head_backward,
          check_sliding_window_head_backward__large_scores, check_sliding_window_head_backward__contract,
          check_predict_eager_saved_bytes]
