"""Checks of exercises/ex10_attention_backward.py (never against the answer file).

References: float64 autograd through ``torch.softmax``, ``F.scaled_dot_product_attention``
(causal) and transformers' ``repeat_kv`` / ``apply_rotary_pos_emb``; the blockwise backward's
memory through ``bp_mech.tracking.PeakMemory`` (tracked CPU storages). Head widths d > 1 make a
missing 1/sqrt(d) visible; H/Hkv > 1 with several KV groups makes a wrong GQA reduction
visible; short sequences and row 0 make an off-by-one causal mask visible.
"""

import math

import torch
import torch.nn.functional as F

TOL = 1e-10  # float64: hand-written and autograd agree to rounding


def _close(name, got, want):
    assert got is not None, f"{name}: returned None"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    hint = " (NaN: a row with every key masked?)" if math.isnan(err) else ""
    assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:g} against float64 autograd{hint}"


def _grads(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, dy)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def check_softmax_backward(m):
    g = torch.Generator().manual_seed(10)
    S, dP = 2 * _rand(g, 3, 5, 9), _rand(g, 3, 5, 9)
    want = _grads(lambda s: torch.softmax(s, -1), [S], dP)[0]
    _close("softmax_backward dS", m.softmax_backward(torch.softmax(S, -1), dP), want)


def check_attention_head_backward(m):
    for seed, (T, d) in enumerate([(9, 16), (13, 4), (1, 8)]):
        g = torch.Generator().manual_seed(20 + seed)
        q, k, v, dO = (_rand(g, T, d) for _ in range(4))
        want = _grads(lambda q, k, v: _sdpa(q[None], k[None], v[None])[0], [q, k, v], dO)
        got = m.attention_head_backward(q, k, v, dO)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            _close(f"attention_head_backward {name} (T={T}, d={d})", a, w)


def check_gqa_reduce(m):
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    for seed, (H, Hkv) in enumerate([(6, 2), (6, 3), (4, 1), (14, 2)]):
        g = torch.Generator().manual_seed(30 + seed)
        x, dx = _rand(g, 2, Hkv, 5, 3), _rand(g, 2, H, 5, 3)
        want = _grads(lambda x: repeat_kv(x, H // Hkv), [x], dx)[0]
        _close(f"gqa_reduce (H={H}, Hkv={Hkv})", m.gqa_reduce(dx, Hkv), want)


def _lse(q, k):
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.logsumexp(s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)


def check_blockwise_backward(m):
    for seed, (T, block) in enumerate([(37, 8), (32, 8), (20, 32), (5, 1)]):
        g = torch.Generator().manual_seed(40 + seed)
        q, k, v, dO = (_rand(g, 2, 3, T, 8) for _ in range(4))
        want = _grads(_sdpa, [q, k, v], dO)
        got = m.blockwise_backward(q, k, v, _sdpa(q, k, v), _lse(q, k), dO, block)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            _close(f"blockwise_backward {name} (T={T}, block={block})", a, w)


def check_blockwise_memory(m):
    from bp_mech.tracking import PeakMemory

    lead, T, d, block = (2, 2), 256, 8, 16
    g = torch.Generator().manual_seed(50)
    q, k, v, dO = (_rand(g, *lead, T, d) for _ in range(4))
    o, lse = _sdpa(q, k, v), _lse(q, k)
    with PeakMemory("cpu") as pm:
        m.blockwise_backward(q, k, v, o, lse, dO, block)
    full = math.prod(lead) * T * T * 8  # bytes of one (..., T, T) float64 score matrix
    assert pm.peak_allocated < full, (
        f"blockwise_backward allocated {pm.peak_allocated} bytes at its peak, as much as a full (T, T) score "
        f"matrix ({full} bytes for T={T}, block={block}): recompute P tile by tile instead")


def check_rope_backward(m):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(60)
    B, H, T, d = 2, 3, 7, 8
    pos = torch.randint(0, 4096, (T,), generator=g).double()
    ang = pos[:, None] * 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (T, d)
    x, dy = _rand(g, B, H, T, d), _rand(g, B, H, T, d)
    want = _grads(lambda x: apply_rotary_pos_emb(x, x, cos[None], sin[None])[0], [x], dy)[0]
    _close("rope_backward dx", m.rope_backward(dy, cos, sin), want)


CHECKS = [check_softmax_backward, check_attention_head_backward, check_gqa_reduce, check_blockwise_backward,
          check_blockwise_memory, check_rope_backward]
