"""Part 02 · 09 — TRAIN-LOCAL-BACKWARD: hand-written local backward passes.

Each operation of a Qwen2 MLP half-block has a forward and, beside it, a backward that maps
the upstream gradient ``dy`` to the gradients of its inputs and parameters. The backward
functions take the forward's inputs (what autograd would save) and ``dy``; nothing else.
``mlp_block_backward`` composes them: the chain rule written as code. Exact GELU's pair lives in
``bp_mech.local_backward_gelu``.

The experiment that checks every op against autograd, finite differences and float32 rounding
is ``bp_mech.experiments.local_backward``.
"""

from __future__ import annotations

import torch


# --- forward and backward, side by side --------------------------------------------


def linear_forward(x, W, b=None):
    """A linear layer: y = x W^T + b.

    Args:
        x: input, (..., in).
        W: weight, (out, in).
        b: bias, (out,), or None for no bias.
    Returns:
        y, (..., out).
    Example:
        >>> tuple(linear_forward(torch.ones(2, 5, 3), torch.ones(4, 3), torch.zeros(4)).shape)
        (2, 5, 4)
    """
    y = x @ W.T
    return y if b is None else y + b


def linear_backward(x, W, dy):
    """The local backward of ``linear_forward``: dx = dy W, dW = dy^T x, db = sum dy.

    Args:
        x: the forward's input, (..., in).
        W: weight, (out, in).
        dy: upstream gradient d loss / d y, (..., out).
    Returns:
        (dx, dW, db): dx (..., in); dW (out, in), summed over all leading dims;
        db (out,).
    Example:
        >>> _ = torch.manual_seed(0)
        >>> x, W, dy = (torch.randn(s, dtype=torch.float64, requires_grad=True)
        ...              for s in [(2, 3), (4, 3), (2, 4)])
        >>> dx, dW, db = linear_backward(x, W, dy)
        >>> ref = torch.autograd.grad(linear_forward(x, W), (x, W), dy)
        >>> torch.allclose(dx, ref[0]) and torch.allclose(dW, ref[1])
        True
    """
    dx = dy @ W  # (..., out) @ (out, in)
    # (out, N) @ (N, in)
    dW = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dx, dW, db


def silu_forward(x):
    """SiLU: y = x * sigmoid(x), elementwise.

    Args:
        x: input, any shape.
    Returns:
        y, same shape as ``x``.
    Example:
        >>> x = torch.linspace(-3, 3, 7, dtype=torch.float64)
        >>> torch.allclose(silu_forward(x), torch.nn.functional.silu(x))
        True
    """
    return x * torch.sigmoid(x)


def silu_backward(x, dy):
    """The local backward of SiLU: dy/dx = s (1 + x (1 - s)), s = sigmoid(x).

    Args:
        x: the forward's input, any shape.
        dy: upstream gradient, same shape as ``x``.
    Returns:
        dx, same shape as ``x``.
    Example:
        >>> x = torch.linspace(-3, 3, 7, dtype=torch.float64, requires_grad=True)
        >>> ref, = torch.autograd.grad(silu_forward(x).sum(), x)
        >>> torch.allclose(silu_backward(x, torch.ones_like(x)), ref)
        True
    """
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s))


def rmsnorm_forward(x, w, eps=1e-6):
    """RMSNorm over the last dim: y = w * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019).

    Args:
        x: input, (..., C).
        w: gain, (C,).
        eps: added to the mean square before the square root.
    Returns:
        y, (..., C).
    Example:
        >>> rmsnorm_forward(torch.tensor([[1.0, -1.0]]), torch.tensor([1.0, 2.0]), eps=0.0).tolist()
        [[1.0, -2.0]]
    """
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return w * (x * r)


def rmsnorm_backward(x, w, dy, eps=1e-6):
    """The local backward of RMSNorm.

    With r = (mean(x^2) + eps)^(-1/2), xhat = x r and g = dy * w:
    dx = r (g - xhat * mean(g * xhat));  dw = sum over rows of dy * xhat.
    The second term of dx is the one that flows through r; dropping it is the classic
    bug.

    Args:
        x: the forward's input, (..., C).
        w: gain, (C,).
        dy: upstream gradient, (..., C).
        eps: as in the forward.
    Returns:
        (dx, dw): dx (..., C); dw (C,).
    Example:
        >>> _ = torch.manual_seed(0)
        >>> x, w, dy = (torch.randn(s, dtype=torch.float64, requires_grad=True)
        ...              for s in [(2, 3, 8), (8,), (2, 3, 8)])
        >>> ref = torch.autograd.grad(rmsnorm_forward(x, w), (x, w), dy)
        >>> all(torch.allclose(a, b) for a, b in zip(rmsnorm_backward(x, w, dy), ref))
        True
    """
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * r
    g = dy * w
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def swiglu_mlp_forward(x, Wg, Wu, Wd):
    """Qwen2MLP: y = down(silu(gate(x)) * up(x)); no biases.

    Args:
        x: input, (..., C).
        Wg: gate_proj weight, (I, C).
        Wu: up_proj weight, (I, C).
        Wd: down_proj weight, (C, I).
    Returns:
        y, (..., C).
    Example:
        >>> x, Wg, Wu, Wd = torch.ones(2, 4), torch.ones(6, 4), torch.ones(6, 4), torch.ones(4, 6)
        >>> tuple(swiglu_mlp_forward(x, Wg, Wu, Wd).shape)
        (2, 4)
    """
    return linear_forward(silu_forward(linear_forward(x, Wg)) * linear_forward(x, Wu), Wd)


def swiglu_mlp_backward(x, Wg, Wu, Wd, dy):
    """The backward of the SwiGLU MLP, composed from the local backwards above.

    Args:
        x: the forward's input, (..., C).
        Wg, Wu: gate_proj and up_proj weights, (I, C) each.
        Wd: down_proj weight, (C, I).
        dy: upstream gradient, (..., C).
    Returns:
        (dx, dWg, dWu, dWd), shaped as (x, Wg, Wu, Wd).
    Example:
        >>> _ = torch.manual_seed(0)
        >>> args = [torch.randn(s, dtype=torch.float64, requires_grad=True)
        ...         for s in [(3, 4), (6, 4), (6, 4), (4, 6)]]
        >>> dy = torch.randn(3, 4, dtype=torch.float64)
        >>> ref = torch.autograd.grad(swiglu_mlp_forward(*args), args, dy)
        >>> ours = swiglu_mlp_backward(*args, dy)
        >>> all(torch.allclose(a, b) for a, b in zip(ours, ref))
        True
    """
    g, u = linear_forward(x, Wg), linear_forward(x, Wu)  # (..., I) each, recomputed
    a = silu_forward(g)
    dh, dWd, _ = linear_backward(a * u, Wd, dy)  # through down_proj
    dg = silu_backward(g, dh * u)  # through the gate's SiLU
    du = dh * a
    dx_g, dWg, _ = linear_backward(x, Wg, dg)
    dx_u, dWu, _ = linear_backward(x, Wu, du)
    return dx_g + dx_u, dWg, dWu, dWd  # x feeds two branches: their gradients add


def cross_entropy_forward(logits, targets, ignore_index=-100):
    """Mean token loss over non-ignored targets: mean of logsumexp(z_i) - z_{i, y_i}.

    Args:
        logits: (N, V).
        targets: (N,) int64 class ids; ``ignore_index`` marks a row that is not a target.
        ignore_index: the id of an ignored row (may be any value, even >= V).
    Returns:
        The loss, a 0-dim tensor (NaN when every row is ignored).
    Example:
        >>> logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, -100])
        >>> round(cross_entropy_forward(logits, targets).item(), 4)  # log(1 + e^-2)
        0.1269
    """
    valid = targets != ignore_index
    lse = torch.logsumexp(logits, -1)  # (N,)
    picked = logits.gather(-1, targets.masked_fill(~valid, 0)[:, None])[:, 0]  # any ignore_index, even >= V
    return ((lse - picked) * valid).sum() / valid.sum()


def cross_entropy_backward(logits, targets, ignore_index=-100):
    """d loss / d logits = (softmax(logits) - onehot(target)) / n_valid.

    On valid rows; 0 on ignored ones.

    Args:
        logits: (N, V).
        targets: (N,) int64 class ids.
        ignore_index: as in ``cross_entropy_forward``.
    Returns:
        d loss / d logits, (N, V).
    Example:
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        >>> targets = torch.tensor([1, -100, 4, 0])
        >>> ref, = torch.autograd.grad(cross_entropy_forward(logits, targets), logits)
        >>> torch.allclose(cross_entropy_backward(logits.detach(), targets), ref)
        True
    """
    valid = (targets != ignore_index)
    d = torch.softmax(logits, -1)
    # ignored rows: any id, zeroed below
    d[torch.arange(len(targets)), targets.masked_fill(~valid, 0)] -= 1
    return d * valid[:, None] / valid.sum()


def mlp_block_forward(x, w_norm, Wg, Wu, Wd, eps=1e-6):
    """The MLP half of a Qwen2 decoder layer: y = x + MLP(RMSNorm(x)).

    Args:
        x: input, (..., C).
        w_norm: post_attention_layernorm gain, (C,).
        Wg, Wu: gate_proj and up_proj weights, (I, C) each.
        Wd: down_proj weight, (C, I).
        eps: RMSNorm eps.
    Returns:
        y, (..., C).
    Example:
        >>> x, Wd = torch.ones(2, 3, 4), torch.zeros(4, 6)  # a zero down_proj: y = x
        >>> torch.equal(mlp_block_forward(x, torch.ones(4), torch.ones(6, 4), torch.ones(6, 4), Wd), x)
        True
    """
    return x + swiglu_mlp_forward(rmsnorm_forward(x, w_norm, eps), Wg, Wu, Wd)


def mlp_block_backward(x, w_norm, Wg, Wu, Wd, dy, eps=1e-6):
    """The chain rule as code: residual, then MLP, then RMSNorm.

    Args:
        x, w_norm, Wg, Wu, Wd, eps: as in ``mlp_block_forward``.
        dy: upstream gradient, (..., C).
    Returns:
        (dx, dw_norm, dWg, dWu, dWd), shaped as (x, w_norm, Wg, Wu, Wd).
    Example:
        >>> _ = torch.manual_seed(0)
        >>> args = [torch.randn(s, dtype=torch.float64, requires_grad=True)
        ...         for s in [(3, 4), (4,), (6, 4), (6, 4), (4, 6)]]
        >>> dy = torch.randn(3, 4, dtype=torch.float64)
        >>> ref = torch.autograd.grad(mlp_block_forward(*args), args, dy)
        >>> ours = mlp_block_backward(*args, dy)
        >>> all(torch.allclose(a, b) for a, b in zip(ours, ref))
        True
    """
    h = rmsnorm_forward(x, w_norm, eps)
    dh, dWg, dWu, dWd = swiglu_mlp_backward(h, Wg, Wu, Wd, dy)
    dx_norm, dw_norm = rmsnorm_backward(x, w_norm, dh, eps)
    return dy + dx_norm, dw_norm, dWg, dWu, dWd  # the residual adds dy unchanged
