"""Answers for Part 02 · 09: the package's own implementation is the reference solution.

Read them in ``src/bp_mech/local_backward.py`` (each backward sits beside its forward);
the chapter shows them in its collapsed "answer" blocks. The variant (LayerNorm) and the
prediction are written here.
"""

import torch

from bp_mech.local_backward import (  # noqa: F401
    cross_entropy_backward,
    linear_backward,
    rmsnorm_backward,
    silu_backward,
    swiglu_mlp_backward,
)


def layernorm_backward(x, w, b, dy, eps=1e-5):
    """LayerNorm's backward: RMSNorm's, with the row mean's term and a bias."""
    xc = x - x.mean(-1, keepdim=True)  # centred first: no mean(x^2) - mu^2 cancellation
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # biased variance
    xhat = xc * r
    g = dy * w
    dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    db = dy.reshape(-1, x.shape[-1]).sum(0)
    return dx, dw, db


def predict_mlp_saved_bytes(batch, seq, hidden, inter, dtype):
    """x for gate and up; g (SiLU's input), u and a (the product's factors), and
    h = a * u (down's input): N C + 4 N I elements, the weights not counted."""
    n = batch * seq
    return (n * hidden + 4 * n * inter) * dtype.itemsize
