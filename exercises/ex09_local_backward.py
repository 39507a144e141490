"""Exercises for Part 02 · 09 — local backward passes.

Implement each function below with tensor operations only (no ``torch.autograd``, no
``.backward()``). Every function receives the forward's inputs and the upstream gradient
``dy`` and returns the gradients of the inputs, in the order given under Returns.

Check your solutions with ``bp-mech check 09`` (or
``pytest tests/test_exercises.py -m ch09 --impl exercises``). The checks compare against
float64 autograd on fresh random inputs, with a relative tolerance of 1e-10, at every shape the
docstrings allow ("..." is any number of leading dimensions: 2-D, 3-D and 4-D inputs are tried) and
at inputs large enough that a formula which overflows (exp of a large number) gives NaN.
"""

import torch


def linear_backward(x: torch.Tensor, W: torch.Tensor, dy: torch.Tensor):
    """Backward of ``y = x @ W.T + b`` (``torch.nn.Linear``).

    Math: dx = dy W;  dW = sum over all leading positions of dy^T x;  db = sum of dy.

    Args:
        x: input, shape (..., in).
        W: weight, shape (out, in).
        dy: upstream gradient, shape (..., out).

    Returns:
        (dx, dW, db) with shapes (..., in), (out, in), (out,).
    """
    raise NotImplementedError("ex09: linear_backward")


def silu_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Backward of ``y = x * sigmoid(x)``.

    Math: with s = sigmoid(x), dy/dx = s * (1 + x * (1 - s)).

    Args:
        x: input, any shape.
        dy: upstream gradient, same shape.

    Returns:
        dx, same shape as x.
    """
    raise NotImplementedError("ex09: silu_backward")


def rmsnorm_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                     eps: float = 1e-6):
    """Backward of RMSNorm, ``y = w * x / sqrt(mean(x**2, -1) + eps)``.

    RMSNorm: Zhang & Sennrich, 2019.

    Math: let r = (mean(x^2) + eps)^(-1/2) per row, xhat = x * r and g = dy * w. Then
        dx = r * (g - xhat * mean(g * xhat))      (both terms matter: r depends on x)
        dw = sum over all rows of dy * xhat

    Args:
        x: input, shape (..., C).
        w: gain, shape (C,).
        dy: upstream gradient, shape (..., C).
        eps: the epsilon inside the square root.

    Returns:
        (dx, dw) with shapes (..., C) and (C,).
    """
    raise NotImplementedError("ex09: rmsnorm_backward")


def swiglu_mlp_backward(x: torch.Tensor, Wg: torch.Tensor, Wu: torch.Tensor,
                        Wd: torch.Tensor, dy: torch.Tensor):
    """Backward of the Qwen2 MLP, ``y = (silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T``.

    The MLP has no biases.

    Math: with g = x Wg^T, u = x Wu^T, a = silu(g), h = a * u:
        dh = dy Wd,  dWd = dy^T h,  dg = (dh * u) * silu'(g),  du = dh * a,
        dx = dg Wg + du Wu   (x feeds both branches),  dWg = dg^T x,  dWu = du^T x.
    Reuse ``linear_backward`` and ``silu_backward``.

    Args:
        x: input, shape (..., C).
        Wg, Wu: gate and up projections, shape (I, C).
        Wd: down projection, shape (C, I).
        dy: upstream gradient, shape (..., C).

    Returns:
        (dx, dWg, dWu, dWd) with the shapes of x, Wg, Wu, Wd.
    """
    raise NotImplementedError("ex09: swiglu_mlp_backward")


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    """Gradient of the mean token cross-entropy with respect to the logits.

    The loss is the mean of ``logsumexp(z_i) - z_i[t_i]`` over the rows whose target is
    not ``ignore_index`` (the convention of ``torch.nn.functional.cross_entropy``).

    Math: d loss / d z_i = (softmax(z_i) - onehot(t_i)) / n_valid for a valid row,
    0 for an ignored one; n_valid counts the valid rows only.

    Args:
        logits: shape (N, V).
        targets: shape (N,), integer class ids or ``ignore_index``.
        ignore_index: the target value to skip: any integer (-100, -1, a pad id that
            is also a class id, or one past the vocabulary).

    Returns:
        dlogits, shape (N, V).
    """
    raise NotImplementedError("ex09: cross_entropy_backward")
