"""Part 02 · 09 — TRAIN-LOCAL-BACKWARD: hand-written local backward passes.

Each operation of a Qwen2 MLP half-block has a forward and, beside it, a backward that maps
the upstream gradient ``dy`` to the gradients of its inputs and parameters. The backward
functions take the forward's inputs (what autograd would save) and ``dy``; nothing else.
``mlp_block_backward`` composes them: the chain rule written as code.

The experiment that checks every op against autograd, finite differences and float32 rounding
is ``bp_mech.experiments.local_backward``.
"""

from __future__ import annotations

import math

import torch

# --- forward and backward, side by side --------------------------------------------


def linear_forward(x, W, b=None):
    """y = x W^T + b. x (..., in), W (out, in), b (out,) -> y (..., out)."""
    y = x @ W.T
    return y if b is None else y + b


def linear_backward(x, W, dy):
    """Returns (dx, dW, db): dx = dy W (..., in); dW = dy^T x (out, in); db = sum dy (out,)."""
    dx = dy @ W  # (..., out) @ (out, in)
    dW = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, N) @ (N, in)
    db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dx, dW, db


def silu_forward(x):
    """y = x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def silu_backward(x, dy):
    """dy/dx = s (1 + x (1 - s)), s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s))


def gelu_forward(x):
    """Exact GELU: y = x Phi(x), Phi the standard normal CDF."""
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_backward(x, dy):
    """dy/dx = Phi(x) + x phi(x)."""
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return dy * (cdf + x * pdf)


def rmsnorm_forward(x, w, eps=1e-6):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim (Zhang & Sennrich 2019)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return w * (x * r)


def rmsnorm_backward(x, w, dy, eps=1e-6):
    """Returns (dx, dw).

    With r = (mean(x^2) + eps)^(-1/2), xhat = x r and g = dy * w:
    dx = r (g - xhat * mean(g * xhat));  dw = sum over rows of dy * xhat.
    The second term of dx is the one that flows through r; dropping it is the classic bug.
    """
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * r
    g = dy * w
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def swiglu_mlp_forward(x, Wg, Wu, Wd):
    """Qwen2MLP: y = down(silu(gate(x)) * up(x)); no biases. Wg, Wu (I, C), Wd (C, I)."""
    return linear_forward(silu_forward(linear_forward(x, Wg)) * linear_forward(x, Wu), Wd)


def swiglu_mlp_backward(x, Wg, Wu, Wd, dy):
    """Returns (dx, dWg, dWu, dWd), composed from the local backwards above."""
    g, u = linear_forward(x, Wg), linear_forward(x, Wu)  # (..., I) each, recomputed
    a = silu_forward(g)
    dh, dWd, _ = linear_backward(a * u, Wd, dy)  # through down_proj
    dg = silu_backward(g, dh * u)  # through the gate's SiLU
    du = dh * a
    dx_g, dWg, _ = linear_backward(x, Wg, dg)
    dx_u, dWu, _ = linear_backward(x, Wu, du)
    return dx_g + dx_u, dWg, dWu, dWd  # x feeds two branches: their gradients add


def cross_entropy_forward(logits, targets, ignore_index=-100):
    """Mean token loss over non-ignored targets. logits (N, V), targets (N,)."""
    valid = targets != ignore_index
    lse = torch.logsumexp(logits, -1)  # (N,)
    picked = logits.gather(-1, targets.masked_fill(~valid, 0)[:, None])[:, 0]  # any ignore_index, even >= V
    return ((lse - picked) * valid).sum() / valid.sum()


def cross_entropy_backward(logits, targets, ignore_index=-100):
    """d loss / d logits = (softmax(logits) - onehot(target)) / n_valid on valid rows, 0 elsewhere."""
    valid = (targets != ignore_index)
    d = torch.softmax(logits, -1)
    d[torch.arange(len(targets)), targets.masked_fill(~valid, 0)] -= 1  # ignored rows: any id, zeroed below
    return d * valid[:, None] / valid.sum()


def mlp_block_forward(x, w_norm, Wg, Wu, Wd, eps=1e-6):
    """The MLP half of a Qwen2 decoder layer: y = x + MLP(RMSNorm(x))."""
    return x + swiglu_mlp_forward(rmsnorm_forward(x, w_norm, eps), Wg, Wu, Wd)


def mlp_block_backward(x, w_norm, Wg, Wu, Wd, dy, eps=1e-6):
    """The chain rule as code: residual, then MLP, then RMSNorm. Returns (dx, dw_norm, dWg, dWu, dWd)."""
    h = rmsnorm_forward(x, w_norm, eps)
    dh, dWg, dWu, dWd = swiglu_mlp_backward(h, Wg, Wu, Wd, dy)
    dx_norm, dw_norm = rmsnorm_backward(x, w_norm, dh, eps)
    return dy + dx_norm, dw_norm, dWg, dWu, dWd  # the residual adds dy unchanged
