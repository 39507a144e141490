"""Part 02 · 10 — the framework's attention, which the hand-written strategies are checked against.

* ``autograd_attention``: the eager Qwen2 attention written with ``transformers``' own
  ``apply_rotary_pos_emb`` and ``repeat_kv``, a masked ``torch.softmax``, and autograd for the
  backward (compared in float64);
* ``sdpa_attention``: RoPE, then ``torch.nn.functional.scaled_dot_product_attention`` (causal,
  GQA), what a real run would call (compared in float32);
* ``qwen2_attention_backward``: a whole ``transformers`` ``Qwen2Attention`` written by hand, to
  compare with the module under autograd.

``attention_fn`` names all four candidates of the experiment (``bp_mech.experiments.
attention_backward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bp_mech.attention_backward import causal_mask
from bp_mech.attention_rope import rope_forward
from bp_mech.attention_strategies import STRATEGIES, HandAttention
from bp_mech.local_backward import linear_backward, linear_forward


def autograd_attention(q, k, v, cos, sin):
    """The eager Qwen2 attention from transformers' own functions; autograd does the backward.

    Args:
        q: queries (B, H, T, d); k, v: keys, values (B, Hkv, T, d); all before RoPE.
        cos, sin: RoPE tables (T, d) (or (1, T, d)), expanded to (B, T, d) for ``apply_rotary_pos_emb``.

    Returns:
        O (B, H, T, d) = softmax(q̃ k̃^T / sqrt(d), causally masked) v, GQA by ``repeat_kv``.

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> kw = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> q, k, v = (torch.randn(1, h, 5, 4, **kw) for h in (4, 2, 2))
        >>> cos, sin = rope_cos_sin(5, 4, 1e4, torch.float64)
        >>> torch.allclose(autograd_attention(q, k, v, cos, sin), sdpa_attention(q, k, v, cos, sin))
        True
    """
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    H, T = q.shape[1], q.shape[2]
    qr, kr = apply_rotary_pos_emb(q, k, cos.expand(q.shape[0], T, -1), sin.expand(q.shape[0], T, -1))
    s = qr @ repeat_kv(kr, H // k.shape[1]).transpose(2, 3) * q.shape[-1] ** -0.5
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    return torch.softmax(s, -1) @ repeat_kv(v, H // k.shape[1])


def sdpa_attention(q, k, v, cos, sin):
    """RoPE, then ``F.scaled_dot_product_attention`` (causal, GQA); the CPU uses its flash kernel.

    Args:
        q: queries (B, H, T, d); k, v: keys, values (B, Hkv, T, d); all before RoPE.
        cos, sin: RoPE tables broadcasting to (B, H, T, d).

    Returns:
        O (B, H, T, d).

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> from bp_mech.attention_strategies import saved_probs_forward
        >>> kw = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> q, k, v = (torch.randn(1, h, 5, 4, **kw) for h in (4, 2, 2))
        >>> cos, sin = rope_cos_sin(5, 4, 1e4, torch.float64)
        >>> torch.allclose(sdpa_attention(q, k, v, cos, sin), saved_probs_forward(q, k, v, cos, sin)[0])
        True
    """
    return F.scaled_dot_product_attention(rope_forward(q, cos, sin), rope_forward(k, cos, sin), v,
                                          is_causal=True, enable_gqa=True)


FRAMEWORK = {"autograd": autograd_attention, "sdpa": sdpa_attention}


def attention_fn(name: str, block: int = 64):
    """The attention ``(q, k, v, cos, sin) -> O`` called ``name``: a hand-written strategy under autograd
    (``HandAttention``, tiles of ``block``) or one of the framework's versions.

    Args:
        name: a key of ``STRATEGIES`` (``"saved_probs"``, ``"recompute"``) or of ``FRAMEWORK``
            (``"autograd"``, ``"sdpa"``).
        block: tile edge of ``recompute``.

    Returns:
        A function ``(q, k, v, cos, sin) -> O``: q (B, H, T, d), k, v (B, Hkv, T, d), O (B, H, T, d).

    Example:
        >>> q, k, v = (torch.ones(1, h, 5, 4) for h in (4, 2, 2))
        >>> fn = attention_fn("recompute", block=2)
        >>> attention_fn("sdpa") is sdpa_attention, tuple(fn(q, k, v, torch.ones(5, 4), torch.zeros(5, 4)).shape)
        (True, (1, 4, 5, 4))
    """
    if name in STRATEGIES:
        return lambda q, k, v, cos, sin: HandAttention.apply(q, k, v, cos, sin, name, block)
    return FRAMEWORK[name]


# --- a whole Qwen2 attention layer by hand ----------------------------------------------

def qwen2_attention_backward(x, attn, cos, sin, dy, strategy: str, block: int = 64):
    """A whole ``Qwen2Attention`` by hand: projections (chapter 09's linear pair), RoPE, GQA, softmax.

    x feeds the three projections q, k, v: their input gradients add up to dx.

    Args:
        x: the layer's input (B, T, C).
        attn: a ``transformers`` ``Qwen2Attention`` (``q/k/v_proj`` with bias, ``o_proj`` without,
            ``head_dim``); only its weights are read.
        cos, sin: RoPE tables (B, T, d), as ``Qwen2RotaryEmbedding`` returns them.
        dy: dL/dy (B, T, C).
        strategy: a key of ``STRATEGIES``.
        block: tile edge of ``recompute``.

    Returns:
        ``(y, dx, grads)``: the output (B, T, C), dL/dx (B, T, C) and ``{name: gradient}`` for
        ``q_proj.weight``, ``q_proj.bias``, ..., ``o_proj.weight``, each of its parameter's shape.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> attn = build_model(parse_workload("tiny-b1s8")).model.layers[0].self_attn  # C = 64, d = 16
        >>> x, dy = torch.randn(2, 1, 8, 64, generator=torch.Generator().manual_seed(0))
        >>> cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)  # position 0 everywhere: no rotation
        >>> y, dx, grads = qwen2_attention_backward(x, attn, cos, sin, dy, "recompute", block=4)
        >>> tuple(y.shape), tuple(dx.shape), sorted(grads) == sorted(n for n, _ in attn.named_parameters())
        ((1, 8, 64), (1, 8, 64), True)
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
