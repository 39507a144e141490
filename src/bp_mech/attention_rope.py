"""Part 02 · 10 — the rotary position embedding of Qwen2 (RoPE, Su et al. 2021), forward and
backward, as ``transformers``' ``apply_rotary_pos_emb`` applies it to Q and K.

y = x cos + rotate_half(x) sin; rotate_half is a linear map R with R^T = -R, so the
backward is dx = dy cos - rotate_half(dy sin). Used by the strategies of
``bp_mech.attention_strategies``.
"""

from __future__ import annotations

import torch


def rope_cos_sin(T: int, d: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos, sin (T, d) as in Qwen2RotaryEmbedding: angle t·theta^(−2i/d), each frequency twice.

    Args:
        T, d: positions t = 0 .. T−1; head width (even), frequency i fills columns i and
            i + d/2.
        theta, dtype, device: the RoPE base (``rope_theta``); the tables' dtype, device
            (computed in float64).
    Returns:
        ``(cos, sin)``, each (T, d).
    Example:
        >>> cos, sin = rope_cos_sin(8, 4, 1e4)
        >>> tuple(cos.shape), cos[0].tolist(), torch.allclose(cos**2 + sin**2, torch.ones(8, 4))
        ((8, 4), [1.0, 1.0, 1.0, 1.0], True)
    """
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, d/2)
    emb = torch.cat([ang, ang], -1)  # (T, d)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_half(x):
    """R x = (−x2, x1) for x = (x1, x2) split in halves of the last dim.

    Args:
        x: any tensor (..., d), d even.
    Returns:
        R x (..., d).
    Example:
        >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist()
        [-3.0, -4.0, 1.0, 2.0]
    """
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rope_forward(x, cos, sin):
    """y = x ⊙ cos + (R x) ⊙ sin. x (..., T, d); cos, sin broadcast to it.

    Args:
        x: queries or keys (..., T, d), e.g. (B, H, T, d).
        cos, sin: tables of ``rope_cos_sin``, (T, d) or any shape that broadcasts to
            ``x``.
    Returns:
        y (..., T, d): each pair (x_i, x_{i+d/2}) rotated by its angle.
    Example:
        >>> x = torch.randn(2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> cos, sin = rope_cos_sin(8, 4, 1e4, torch.float64)
        >>> torch.allclose(rope_forward(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation
        True
    """
    return x * cos + rotate_half(x) * sin


def rope_backward(dy, cos, sin):
    """dx = dy ⊙ cos + R^T (dy ⊙ sin) = dy ⊙ cos − R (dy ⊙ sin), because R^T = −R.

    Args:
        dy: dL/dy (..., T, d) for y = ``rope_forward(x, cos, sin)``.
        cos, sin: the forward's tables, broadcasting to ``dy``.
    Returns:
        dL/dx (..., T, d).
    Example:
        >>> x, dy = torch.randn(2, 2, 8, 4, dtype=torch.float64,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> cos, sin = rope_cos_sin(8, 4, 1e4, torch.float64)
        >>> y = rope_forward(x.requires_grad_(), cos, sin)
        >>> ref = torch.autograd.grad(y, x, dy)[0]
        >>> torch.allclose(rope_backward(dy, cos, sin), ref)
        True
    """
    return dy * cos - rotate_half(dy * sin)
