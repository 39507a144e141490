"""Part 02 · 10 — TRAIN-ATTENTION-BACKWARD: Qwen2 attention backward by hand, two ways.

The attention of a Qwen2 layer: rotary position embedding (RoPE, Su et al. 2021) on Q
and K, grouped-query attention (GQA, Ainslie et al. 2023: H query heads share Hkv KV
heads), a causal mask and a softmax with scale 1/sqrt(d) (Vaswani et al. 2017). Its
backward, with S = scale Q K^T (masked), P = softmax(S), O = P V and upstream dO:

    dV = P^T dO,   dP = dO V^T,   dS = P ⊙ (dP − rowsum(dP ⊙ P)),
    dQ = scale dS K,   dK = scale dS^T Q,

then dK, dV summed over the query heads of each KV group and RoPE's backward on dQ, dK.
Here: those pieces, the backward from saved P, and the tiled one that rebuilds P from
the row log-sum-exp (FlashAttention, Dao et al. 2022); the strategies:
``attention_strategies``, ``attention_framework``. RoPE's forward and backward live in
``bp_mech.attention_rope``.
"""

from __future__ import annotations

import math

import torch



# --- the pieces: mask, softmax, GQA (RoPE: bp_mech.attention_rope) ------------------------
def causal_mask(n_q: int, n_k: int, q0: int = 0, k0: int = 0, device="cpu"):
    """(n_q, n_k) bool, True where key position k0+j <= query position q0+i (visible).

    Args:
        n_q, n_k: number of query rows and key columns (a whole score matrix or one tile
            of it).
        q0, k0, device: positions of the first query and key (a tile's offsets); the
            mask's device.
    Returns:
        The mask (n_q, n_k), bool: True where the query may attend to the key.
    Example:
        >>> causal_mask(2, 4, q0=2).int().tolist()  # queries 2, 3 against keys 0 .. 3
        [[1, 1, 1, 0], [1, 1, 1, 1]]
    """
    return torch.arange(k0, k0 + n_k, device=device)[None, :] <= torch.arange(q0, q0 + n_q, device=device)[:, None]


def softmax_backward(P, dP):
    """dS = P ⊙ (dP − rowsum(dP ⊙ P)): the softmax Jacobian diag(p) − p p^T, per row.

    Args:
        P: probabilities (..., n), P = softmax(S) over the last dim.
        dP: dL/dP (..., n).
    Returns:
        dS = dL/dS (..., n).
    Example:
        >>> S, dP = torch.randn(2, 3, 5, dtype=torch.float64,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> P = torch.softmax(S.requires_grad_(), -1)
        >>> torch.allclose(softmax_backward(P, dP), torch.autograd.grad(P, S, dP)[0])
        True
    """
    return P * (dP - (dP * P).sum(-1, keepdim=True))


def gqa_expand(x, heads: int):
    """(B, Hkv, T, d) -> (B, H, T, d): each KV head repeated for its H/Hkv query heads.

    Args:
        x: keys or values (B, Hkv, T, d).
        heads: H, the number of query heads (a multiple of Hkv).
    Returns:
        (B, H, T, d); query head h reads KV head h // (H // Hkv).
    Example:
        >>> gqa_expand(torch.tensor([0.0, 1.0]).view(1, 2, 1, 1), 4).flatten().tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def gqa_reduce(dx, kv_heads: int):
    """(B, H, T, d) -> (B, Hkv, T, d): gqa_expand's backward sums each group of heads.

    A group is H/Hkv consecutive query heads.

    Args:
        dx: gradient of the expanded keys or values (B, H, T, d).
        kv_heads: Hkv, the number of KV heads.
    Returns:
        (B, Hkv, T, d), the gradient of the KV heads.
    Example:
        >>> dx = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1, 1)
        >>> gqa_reduce(dx, 2).flatten().tolist()
        [3.0, 7.0]
    """
    return dx.unflatten(1, (kv_heads, -1)).sum(2)


# --- from saved P -----------------------------------------------------------------------
def attention_forward(q, k, v, scale=None):
    """Causal attention: q, k, v (..., T, d) -> (O, P, L).

    O (..., T, d), P (..., T, T), L (..., T).

    Args:
        q, k, v: queries, keys, values (..., T, d), one KV head per query head (GQA
            expanded).
        scale: the score scale; None: 1/sqrt(d).
    Returns:
        ``(O, P, L)``: the output (..., T, d), the probabilities P = softmax(S) (..., T,
        T), zero above the diagonal, and L, the log-sum-exp of each masked score row
        (..., T).
    Example:
        >>> q, k, v = torch.randn(3, 2, 5, 4, dtype=torch.float64,
        ...                       generator=torch.Generator().manual_seed(0))
        >>> O, P, L = attention_forward(q, k, v)
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention
        >>> tuple(P.shape), tuple(L.shape), torch.allclose(O, sdpa(q, k, v,
        ...                                                        is_causal=True))
        ((2, 5, 5), (2, 5), True)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale  # (..., T, T)
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (..., T)
    P = torch.exp(s - lse[..., None])
    return P @ v, P, lse


def attention_backward(q, k, v, P, dO, scale=None):
    """(dq, dk, dv) from the saved probabilities P (..., T, T).

    Args:
        q, k, v, P: the forward's inputs (..., T, d) and probabilities P (..., T, T)
            (``attention_forward``).
        dO: dL/dO (..., T, d).
        scale: the forward's score scale; None: 1/sqrt(d).
    Returns:
        ``(dq, dk, dv)``, each (..., T, d).
    Example:
        >>> q, k, v, dO = torch.randn(4, 2, 5, 4, dtype=torch.float64,
        ...                           generator=torch.Generator().manual_seed(0))
        >>> O, P, _ = attention_forward(*(t.requires_grad_() for t in (q, k, v)))
        >>> ref = torch.autograd.grad(O, (q, k, v), dO)
        >>> all(map(torch.allclose, attention_backward(q, k, v, P, dO), ref))
        True
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dv = P.transpose(-2, -1) @ dO  # (..., T, d)
    # (..., T, T), masked entries stay 0
    dS = softmax_backward(P, dO @ v.transpose(-2, -1)) * scale
    return dS @ k, dS.transpose(-2, -1) @ q, dv


# --- from L, P recomputed tile by tile ---------------------------------------------------
def _tiles(T: int, block: int):
    return [(i, min(i + block, T)) for i in range(0, T, block)]


def blockwise_forward(q, k, v, block: int, scale=None):
    """O and L = logsumexp of each score row, one (block × block) tile at a time
    (online softmax).

    Args:
        q, k, v: queries, keys, values (..., T, d), one KV head per query head.
        block: tile edge (the last tile may be shorter); no (T, T) matrix is formed.
        scale: the score scale; None: 1/sqrt(d).
    Returns:
        ``(O, L)``: the output (..., T, d) and the row log-sum-exp (..., T), as
        ``attention_forward``.
    Example:
        >>> q, k, v = torch.randn(3, 2, 5, 4, dtype=torch.float64,
        ...                       generator=torch.Generator().manual_seed(0))
        >>> O, L = blockwise_forward(q, k, v, block=2)
        >>> O_ref, _, L_ref = attention_forward(q, k, v)
        >>> torch.allclose(O, O_ref), torch.allclose(L, L_ref)
        (True, True)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for i0, i1 in _tiles(T, block):
        qi = q[..., i0:i1, :]
        m = q.new_full(qi.shape[:-1], float("-inf"))  # running row max   (..., b)
        l = q.new_zeros(qi.shape[:-1])  # running sum of exp(s − m)        (..., b)
        acc = torch.zeros_like(qi)  # running (unnormalised) output        (..., b, d)
        for j0, j1 in _tiles(min(T, i1), block):  # later key tiles: fully masked
            s = (qi @ k[..., j0:j1, :].transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device),
                              float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l, m = l * c + p.sum(-1), m_new
            acc = acc * c[..., None] + p @ v[..., j0:j1, :]
        o[..., i0:i1, :] = acc / l[..., None]
        lse[..., i0:i1] = m + torch.log(l)
    return o, lse


def blockwise_backward(q, k, v, o, lse, dO, block: int, scale=None):
    """(dq, dk, dv) with P recomputed per tile as exp(S − L).

    It uses rowsum(dP ⊙ P) = rowsum(dO ⊙ O), so P is never needed whole.

    Args:
        q, k, v: the forward's inputs (..., T, d).
        o, lse, dO: the forward's output (..., T, d), row log-sum-exp L (..., T); dL/dO
            (..., T, d).
        block: tile edge; no tensor is larger than a (block × block) tile or a (T, d)
            gradient.
        scale: the forward's score scale; None: 1/sqrt(d).
    Returns:
        ``(dq, dk, dv)``, each (..., T, d): ``attention_backward``'s, without P.
    Example:
        >>> q, k, v, dO = torch.randn(4, 2, 5, 4, dtype=torch.float64,
        ...                           generator=torch.Generator().manual_seed(0))
        >>> O, P, L = attention_forward(q, k, v)
        >>> tiled = blockwise_backward(q, k, v, O, L, dO, 2)
        >>> all(map(torch.allclose, tiled, attention_backward(q, k, v, P, dO)))
        True
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    D = (dO * o).sum(-1)  # (..., T)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1 in _tiles(T, block):
        qi, doi = q[..., i0:i1, :], dO[..., i0:i1, :]
        for j0, j1 in _tiles(min(T, i1), block):
            kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
            s = (qi @ kj.transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device),
                              float("-inf"))
            p = torch.exp(s - lse[..., i0:i1, None])  # the tile of P, recomputed
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ doi
            ds = p * (doi @ vj.transpose(-2, -1) - D[..., i0:i1, None]) * scale
            dq[..., i0:i1, :] += ds @ kj
            dk[..., j0:j1, :] += ds.transpose(-2, -1) @ qi
    return dq, dk, dv


def n_recomputed_tiles(T: int, block: int) -> int:
    """Score tiles the recompute backward rebuilds (the causal lower triangle of tiles).

    Args:
        T, block: sequence length, tile edge.
    Returns:
        n (n + 1) / 2 for n = ceil(T / block) tiles per side.
    Example:
        >>> n_recomputed_tiles(256, 64), n_recomputed_tiles(48, 64)
        (10, 1)
    """
    n = math.ceil(T / block)
    return n * (n + 1) // 2
