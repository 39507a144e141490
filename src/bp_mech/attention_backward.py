"""Part 02 · 10 — TRAIN-ATTENTION-BACKWARD: Qwen2 attention backward by hand, two ways.

The attention of a Qwen2 layer: rotary position embedding (RoPE, Su et al. 2021) on Q and K,
grouped-query attention (GQA, Ainslie et al. 2023: H query heads share Hkv KV heads), a
causal mask and a softmax with scale 1/sqrt(d) (Vaswani et al. 2017). Its backward, with
S = scale Q K^T (masked), P = softmax(S), O = P V and upstream dO:

    dV = P^T dO,   dP = dO V^T,   dS = P ⊙ (dP − rowsum(dP ⊙ P)),
    dQ = scale dS K,   dK = scale dS^T Q,

then dK, dV summed over the query heads of each KV group and RoPE's backward on dQ, dK.
Two hand-written strategies differ only in what the forward keeps for the backward:

* ``saved_probs``: P itself, B·H·T·T numbers;
* ``recompute``: Q, K, V, O and the row log-sum-exp L (B·H·T); the backward rebuilds P one
  tile at a time as exp(S − L) and uses rowsum(dP ⊙ P) = rowsum(dO ⊙ O) (FlashAttention,
  Dao et al. 2022), so no T×T matrix ever exists.

Both run inside one ``torch.autograd.Function`` whose forward calls ``ctx.save_for_backward``
on exactly what the strategy keeps, so ``saved_bytes`` can count it with saved-tensor hooks.
The experiment that checks and measures them is ``bp_mech.experiments.attention_backward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bp_mech.bench.counters import SavedBytesCounter
from bp_mech.local_backward import linear_backward, linear_forward


@dataclass(frozen=True)
class AttnConfig:
    batch: int  # B, sequences
    heads: int  # H, query heads
    kv_heads: int  # Hkv, key/value heads; query head h reads KV head h // (H // Hkv)
    head_dim: int  # d, width of one head
    rope_theta: float  # RoPE base
    block: int = 64  # tile edge of the recompute strategy

    @classmethod
    def from_arch(cls, arch: str, batch: int, block: int = 64) -> "AttnConfig":
        from bp_mech.bench.workload import ARCHITECTURES

        a = ARCHITECTURES[arch]
        return cls(batch, a["num_attention_heads"], a["num_key_value_heads"],
                   a["hidden_size"] // a["num_attention_heads"], a["rope_theta"], block)


# --- the pieces: RoPE, mask, softmax, GQA ---------------------------------------------

def rope_cos_sin(T: int, d: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos, sin (T, d) as in Qwen2RotaryEmbedding: angle t·theta^(−2i/d), each frequency twice."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, d/2)
    emb = torch.cat([ang, ang], -1)  # (T, d)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_half(x):
    """R x = (−x2, x1) for x = (x1, x2) split in halves of the last dim."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rope_forward(x, cos, sin):
    """y = x ⊙ cos + (R x) ⊙ sin. x (..., T, d); cos, sin broadcast to it."""
    return x * cos + rotate_half(x) * sin


def rope_backward(dy, cos, sin):
    """dx = dy ⊙ cos + R^T (dy ⊙ sin) = dy ⊙ cos − R (dy ⊙ sin), because R^T = −R."""
    return dy * cos - rotate_half(dy * sin)


def causal_mask(n_q: int, n_k: int, q0: int = 0, k0: int = 0, device="cpu"):
    """(n_q, n_k) bool, True where key position k0+j <= query position q0+i (visible)."""
    return torch.arange(k0, k0 + n_k, device=device)[None, :] <= torch.arange(q0, q0 + n_q, device=device)[:, None]


def softmax_backward(P, dP):
    """dS = P ⊙ (dP − rowsum(dP ⊙ P)): the softmax Jacobian diag(p) − p p^T applied per row."""
    return P * (dP - (dP * P).sum(-1, keepdim=True))


def gqa_expand(x, heads: int):
    """(B, Hkv, T, d) -> (B, H, T, d): each KV head repeated for its H/Hkv query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def gqa_reduce(dx, kv_heads: int):
    """(B, H, T, d) -> (B, Hkv, T, d): the backward of gqa_expand sums each group of H/Hkv heads."""
    return dx.unflatten(1, (kv_heads, -1)).sum(2)


# --- strategy 1: save P ---------------------------------------------------------------

def attention_forward(q, k, v, scale=None):
    """Causal attention, q, k, v (..., T, d) -> (O (..., T, d), P (..., T, T), L (..., T))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale  # (..., T, T)
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (..., T)
    P = torch.exp(s - lse[..., None])
    return P @ v, P, lse


def attention_backward(q, k, v, P, dO, scale=None):
    """(dq, dk, dv) from the saved probabilities P (..., T, T)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dv = P.transpose(-2, -1) @ dO  # (..., T, d)
    dS = softmax_backward(P, dO @ v.transpose(-2, -1)) * scale  # (..., T, T), masked entries stay 0
    return dS @ k, dS.transpose(-2, -1) @ q, dv


# --- strategy 2: save L, recompute P tile by tile ---------------------------------------

def _tiles(T: int, block: int):
    return [(i, min(i + block, T)) for i in range(0, T, block)]


def blockwise_forward(q, k, v, block: int, scale=None):
    """O and L = logsumexp of each score row, one (block × block) tile at a time (online softmax)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for i0, i1 in _tiles(T, block):
        qi = q[..., i0:i1, :]
        m = q.new_full(qi.shape[:-1], float("-inf"))  # running row max   (..., b)
        l = q.new_zeros(qi.shape[:-1])  # running sum of exp(s − m)        (..., b)
        acc = torch.zeros_like(qi)  # running (unnormalised) output        (..., b, d)
        for j0, j1 in _tiles(min(T, i1), block):  # key tiles past the query tile are fully masked
            s = (qi @ k[..., j0:j1, :].transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l, acc, m = l * c + p.sum(-1), acc * c[..., None] + p @ v[..., j0:j1, :], m_new
        o[..., i0:i1, :] = acc / l[..., None]
        lse[..., i0:i1] = m + torch.log(l)
    return o, lse


def blockwise_backward(q, k, v, o, lse, dO, block: int, scale=None):
    """(dq, dk, dv) with P recomputed per tile as exp(S − L); rowsum(dP ⊙ P) = rowsum(dO ⊙ O)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    D = (dO * o).sum(-1)  # (..., T)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1 in _tiles(T, block):
        qi, doi = q[..., i0:i1, :], dO[..., i0:i1, :]
        for j0, j1 in _tiles(min(T, i1), block):
            kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
            s = (qi @ kj.transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device), float("-inf"))
            p = torch.exp(s - lse[..., i0:i1, None])  # the tile of P, recomputed
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ doi
            ds = p * (doi @ vj.transpose(-2, -1) - D[..., i0:i1, None]) * scale
            dq[..., i0:i1, :] += ds @ kj
            dk[..., j0:j1, :] += ds.transpose(-2, -1) @ qi
    return dq, dk, dv


def n_recomputed_tiles(T: int, block: int) -> int:
    """Score tiles the recompute backward rebuilds (the causal lower triangle of tiles)."""
    n = math.ceil(T / block)
    return n * (n + 1) // 2


# --- the two strategies with RoPE and GQA: forward -> (O, saved), backward(saved) --------
# q (B, H, T, d) and k, v (B, Hkv, T, d) before RoPE; cos, sin broadcast to (B, H, T, d).

def saved_probs_forward(q, k, v, cos, sin, block=None):
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, P, _ = attention_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]))
    return o, (qr, kr, v, P, cos, sin)


def saved_probs_backward(saved, dO, block=None):
    qr, kr, v, P, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = attention_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), P, dO)
    return rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin), gqa_reduce(dv, Hkv)


def recompute_forward(q, k, v, cos, sin, block=64):
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, lse = blockwise_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]), block)
    return o, (qr, kr, v, o, lse, cos, sin)


def recompute_backward(saved, dO, block=64):
    qr, kr, v, o, lse, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = blockwise_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), o, lse, dO, block)
    return rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin), gqa_reduce(dv, Hkv)


STRATEGIES = {"saved_probs": (saved_probs_forward, saved_probs_backward),
              "recompute": (recompute_forward, recompute_backward)}


class HandAttention(torch.autograd.Function):
    """A hand-written strategy under autograd; it saves exactly the strategy's ``saved`` tuple."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, strategy: str, block: int):
        fwd, ctx.bwd = STRATEGIES[strategy]
        o, saved = fwd(q, k, v, cos, sin, block)
        ctx.block = block
        ctx.save_for_backward(*saved)
        return o

    @staticmethod
    def backward(ctx, dO):
        return *ctx.bwd(ctx.saved_tensors, dO, ctx.block), None, None, None, None


# --- the framework's versions ---------------------------------------------------------

def autograd_attention(q, k, v, cos, sin):
    """The eager Qwen2 attention from transformers' own functions; autograd does the backward."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    H, T = q.shape[1], q.shape[2]
    qr, kr = apply_rotary_pos_emb(q, k, cos.expand(q.shape[0], T, -1), sin.expand(q.shape[0], T, -1))
    s = qr @ repeat_kv(kr, H // k.shape[1]).transpose(2, 3) * q.shape[-1] ** -0.5
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    return torch.softmax(s, -1) @ repeat_kv(v, H // k.shape[1])


def sdpa_attention(q, k, v, cos, sin):
    """RoPE, then ``F.scaled_dot_product_attention`` (causal, GQA); the CPU uses its flash kernel."""
    return F.scaled_dot_product_attention(rope_forward(q, cos, sin), rope_forward(k, cos, sin), v,
                                          is_causal=True, enable_gqa=True)


FRAMEWORK = {"autograd": autograd_attention, "sdpa": sdpa_attention}


def attention_fn(name: str, block: int = 64):
    """The attention ``(q, k, v, cos, sin) -> O`` called ``name``: a hand-written strategy under autograd
    (``HandAttention``, tiles of ``block``) or one of the framework's versions."""
    if name in STRATEGIES:
        return lambda q, k, v, cos, sin: HandAttention.apply(q, k, v, cos, sin, name, block)
    return FRAMEWORK[name]


# --- what a strategy saves: counted and by formula --------------------------------------

def saved_bytes(fn, inputs) -> int:
    """Bytes autograd keeps for the backward of ``fn``: the distinct storages its pack hook sees
    (``bp_mech.bench.counters.SavedBytesCounter``: views of one storage count once)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    counter = SavedBytesCounter()
    with counter:  # the graph keeps every saved storage alive while fn runs
        fn(*leaves, *inputs[3:])
    return counter.bytes


def saved_bytes_formula(cfg: AttnConfig, T: int, strategy: str, itemsize: int = 4) -> int:
    """What each hand-written strategy saves, by formula (the cross-check of ``saved_bytes``)."""
    B, H, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    common = B * H * T * d + 2 * B * Hkv * T * d + 2 * T * d  # RoPE'd q, k; v; cos, sin
    probs_or_output = B * H * T * T if strategy == "saved_probs" else B * H * T * d + B * H * T  # P | O, L
    return (common + probs_or_output) * itemsize


# --- a whole Qwen2 attention layer by hand ----------------------------------------------

def qwen2_attention_backward(x, attn, cos, sin, dy, strategy: str, block: int = 64):
    """A whole ``Qwen2Attention`` by hand: projections (chapter 09's linear pair), RoPE, GQA, softmax.

    x, dy (B, T, C); cos, sin (B, T, d) from ``Qwen2RotaryEmbedding``. Returns (y, dx, {param: grad}).
    """
    d, fwd, bwd = attn.head_dim, *STRATEGIES[strategy]
    heads = lambda t: t.unflatten(-1, (-1, d)).transpose(1, 2)  # noqa: E731  (B, T, n·d) -> (B, n, T, d)
    flat = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731            (B, n, T, d) -> (B, T, n·d)
    names = ("q_proj", "k_proj", "v_proj")
    q, k, v = (heads(linear_forward(x, getattr(attn, n).weight, getattr(attn, n).bias)) for n in names)
    o, saved = fwd(q, k, v, cos[:, None], sin[:, None], block)
    y = linear_forward(flat(o), attn.o_proj.weight)
    do, dWo, _ = linear_backward(flat(o), attn.o_proj.weight, dy)
    dx, out = 0, {"o_proj.weight": dWo}
    for n, g in zip(names, bwd(saved, heads(do), block)):
        dxn, out[f"{n}.weight"], out[f"{n}.bias"] = linear_backward(x, getattr(attn, n).weight, flat(g))
        dx = dx + dxn  # x feeds three projections: their gradients add
    return y, dx, out
