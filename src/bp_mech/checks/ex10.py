"""Checks of exercises/ex10_attention_backward.py (never against the answer file).

References: float64 autograd through ``torch.softmax``, ``F.scaled_dot_product_attention`` (causal)
and transformers' ``repeat_kv`` / ``rotate_half`` / ``apply_rotary_pos_emb``; the blockwise
backward's memory through ``bp_mech.instruments.peak.PeakMemory`` (tracked CPU storages), against ONE head's
(T, T) score matrix. Head widths d > 1 make a missing 1/sqrt(d) visible; H/Hkv > 1 with several KV
groups (and H = Hkv) makes a wrong GQA reduction visible; short sequences and row 0 make an
off-by-one causal mask visible; "..." is tried as no, one and two leading dimensions. The contract
around the numbers, scores of size 1e3, the sliding-window variant and the saved-bytes prediction:
``ex10_contract``.
"""

import math

import torch
import torch.nn.functional as F

from bp_mech.checks import ex10_contract
from bp_mech.checks.common import (
    assert_all_close,
    assert_close,
    autograd_grads,
    call,
    randn64,
)

TOL = 1e-10  # float64: hand-written and autograd agree to rounding
REF = "float64 autograd"


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def check_softmax_backward(m):
    for seed, shape in enumerate([(3, 5, 9), (9,), (4, 7), (2, 2, 3, 6)]):
        g = torch.Generator().manual_seed(10 + seed)
        S, dP = 2 * randn64(g, *shape), randn64(g, *shape)
        if len(shape) >= 2:  # causally masked rows: P holds exact zeros, as in attention
            n = shape[-1]
            S = S.masked_fill(torch.ones(shape[-2], n, dtype=torch.bool).triu(1), float("-inf"))
        at = f"shape {shape}" + (" with causally masked entries" if len(shape) >= 2 else "")
        want = autograd_grads(lambda s: torch.softmax(s, -1), [S], dP)[0]
        got = call("softmax_backward", m.softmax_backward, torch.softmax(S, -1), dP.clone(), at=at)
        assert_close("softmax_backward", "dS", got, want, tol=TOL, ref=REF, at=at)


def check_attention_head_backward(m):
    for seed, (T, d) in enumerate([(9, 16), (13, 4), (1, 8), (2, 3)]):
        g = torch.Generator().manual_seed(20 + seed)
        q, k, v, dO = (randn64(g, T, d) for _ in range(4))
        want = autograd_grads(lambda q, k, v: _sdpa(q[None], k[None], v[None])[0], [q, k, v], dO)
        at = f"T={T}, d={d}"
        got = call("attention_head_backward", m.attention_head_backward, q, k, v, dO, at=at)
        assert_all_close("attention_head_backward", ("dq", "dk", "dv"), got, want, tol=TOL, ref=REF, at=at)


def check_gqa_reduce(m):
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    for seed, (H, Hkv) in enumerate([(6, 2), (6, 3), (4, 1), (14, 2), (5, 5)]):  # the last: plain MHA, n = 1
        g = torch.Generator().manual_seed(30 + seed)
        x, dx = randn64(g, 2, Hkv, 5, 3), randn64(g, 2, H, 5, 3)
        want = autograd_grads(lambda x, n=H // Hkv: repeat_kv(x, n), [x], dx)[0]
        at = f"H={H}, Hkv={Hkv}, dx shape {tuple(dx.shape)}"
        got = call("gqa_reduce", m.gqa_reduce, dx.clone(), Hkv, at=at)
        assert_close("gqa_reduce", "dkv", got, want, tol=TOL, ref="float64 autograd of transformers' repeat_kv", at=at)


def _lse(q, k):
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.logsumexp(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)


def check_blockwise_backward(m):
    # (leading dims, T, d, block): short last tile, exact tiles, block > T, block 1, no / one leading dim
    for seed, (lead, T, d, block) in enumerate([((2, 3), 37, 8, 8), ((2, 3), 32, 8, 8), ((2, 3), 20, 8, 32),
                                                 ((2, 3), 5, 8, 1), ((), 19, 4, 4), ((3,), 23, 16, 8)]):
        g = torch.Generator().manual_seed(40 + seed)
        q, k, v, dO = (randn64(g, *lead, T, d) for _ in range(4))
        want = autograd_grads(_sdpa, [q, k, v], dO)
        at = f"q shape {tuple(q.shape)}, block={block}"
        got = call("blockwise_backward", m.blockwise_backward, q, k, v, _sdpa(q, k, v), _lse(q, k), dO, block, at=at)
        assert_all_close("blockwise_backward", ("dq", "dk", "dv"), got, want, tol=TOL, ref=REF, at=at)


def check_blockwise_backward__memory(m):
    from bp_mech.instruments.peak import PeakMemory

    lead, T, d, block = (2, 2), 256, 8, 16
    g = torch.Generator().manual_seed(50)
    q, k, v, dO = (randn64(g, *lead, T, d) for _ in range(4))
    o, lse = _sdpa(q, k, v), _lse(q, k)
    at = f"q shape {tuple(q.shape)}, block={block}"
    with PeakMemory("cpu") as pm:
        call("blockwise_backward", m.blockwise_backward, q, k, v, o, lse, dO, block, at=at)
    one_head = T * T * 8  # bytes of ONE head's (T, T) float64 score matrix; the outputs take 3/8 of it here
    assert pm.peak.allocated < one_head, (
        f"blockwise_backward: peak memory {pm.peak.allocated} B reaches one head's full (T, T) score matrix "
        f"({one_head} B; tracked CPU storages) at {at}: recompute P tile by tile, never a whole row of tiles "
        f"per head")


def check_rope_backward(m):
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    for seed, (x_shape, table_shape) in enumerate([((2, 3, 7, 8), (7, 8)), ((7, 8), (7, 8)), ((3, 5, 4), (5, 4)),
                                                   ((2, 3, 6, 8), (2, 1, 6, 8))]):  # the last: Qwen2's (B, 1, T, d)
        g = torch.Generator().manual_seed(60 + seed)
        d = x_shape[-1]
        pos = torch.randint(0, 4096, table_shape[:-1], generator=g).double()
        ang = pos[..., None] * 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x, dy = randn64(g, *x_shape), randn64(g, *x_shape)
        want = autograd_grads(lambda x, c=cos, s=sin: x * c + rotate_half(x) * s, [x], dy)[0]  # apply_rotary_pos_emb's
        at = f"dy shape {x_shape}, cos/sin shape {tuple(cos.shape)}"
        got = call("rope_backward", m.rope_backward, dy.clone(), cos, sin, at=at)
        assert_close("rope_backward", "dx", got, want, tol=TOL, ref="float64 autograd of transformers' RoPE", at=at)


CHECKS = [check_softmax_backward, check_attention_head_backward, check_gqa_reduce, check_blockwise_backward,
          check_blockwise_backward__memory, check_rope_backward,
          *ex10_contract.CHECKS]  # the contract, the sliding-window variant and the saved-bytes prediction
