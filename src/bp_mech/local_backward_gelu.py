"""Part 02 · 09 — exact GELU, forward and local backward (the sibling of
``bp_mech.local_backward``, whose other ops the chapter shows).

GELU is not in the Qwen2 MLP (SwiGLU uses SiLU); the experiment checks it beside the others
because GPT-style MLPs use it.
"""

from __future__ import annotations

import math

import torch


def gelu_forward(x):
    """Exact GELU: y = x Phi(x), Phi the standard normal CDF (not the tanh approximation).

    Args:
        x: input, any shape.
    Returns:
        y, same shape as ``x``.
    Example:
        >>> x, gelu = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64), torch.nn.functional.gelu
        >>> torch.allclose(gelu_forward(x), gelu(x)), torch.allclose(gelu_forward(x), gelu(x, approximate="tanh"))
        (True, False)
    """
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_backward(x, dy):
    """The local backward of exact GELU: dy/dx = Phi(x) + x phi(x), phi the normal pdf.

    Args:
        x: what ``gelu_forward`` received (any shape); dy: dL/dy, shaped like ``x``.
    Returns:
        dL/dx = dy (Phi(x) + x phi(x)), shaped like ``x``.
    Example:
        >>> x = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
        >>> dy = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> gelu_forward(x).backward(dy)
        >>> torch.allclose(gelu_backward(x.detach(), dy), x.grad)
        True
    """
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return dy * (cdf + x * pdf)
