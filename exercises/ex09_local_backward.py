"""Exercises for Part 02 · 09 — local backward passes.

Implement each function below with tensor operations only (no ``torch.autograd``, no
``.backward()``). Every function receives the forward's inputs and the upstream gradient
``dy`` and returns the gradients of the inputs, in the order given under Returns.

Check your solutions with ``bp-mech check 09`` (or
``pytest tests/test_exercises.py -m ch09 --impl exercises``). The checks compare against
float64 autograd on fresh random inputs, with a relative tolerance of 1e-10, at every shape the
docstrings allow ("..." is any number of leading dimensions: 2-D, 3-D and 4-D inputs are tried) and
at inputs large enough that a formula which overflows (exp of a large number) gives NaN.

The contract every function here is held to (explored on drawn shapes, seeds, layouts):

- the inputs are not modified (no in-place update of x, W, dy, logits or targets);
- non-contiguous inputs (a transposed or sliced view of a larger storage) give the same
  result;
- the returned tensors are new: none shares its storage with an input;
- float32 inputs give float32 results (within 1e-4 of the float64 reference).
"""

import torch


def linear_backward(x: torch.Tensor, W: torch.Tensor, dy: torch.Tensor):
    """Backward of ``y = x @ W.T + b`` (``torch.nn.Linear``).

    Return the gradients of the loss with respect to x, W and the bias b, given
    dy = dL/dy; dW and db sum the contributions of every leading position.

    Args:
        x: input, shape (..., in).
        W: weight, shape (out, in).
        dy: upstream gradient, shape (..., out).

    Returns:
        (dx, dW, db) with shapes (..., in), (out, in), (out,), in the dtype of x; new
        tensors (the module docstring's contract: inputs unchanged, any strides).
    """
    raise NotImplementedError("ex09: linear_backward")


def silu_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Backward of ``y = x * sigmoid(x)``.

    Return dx = dL/dx given dy = dL/dy, elementwise.

    Args:
        x: input, any shape.
        dy: upstream gradient, same shape.

    Returns:
        dx, same shape and dtype as x, finite for any finite x (even |x| = 1000); a new
        tensor, x and dy unchanged, any strides.
    """
    raise NotImplementedError("ex09: silu_backward")


def rmsnorm_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                     eps: float = 1e-6):
    """Backward of RMSNorm, ``y = w * x / sqrt(mean(x**2, -1) + eps)``.

    RMSNorm: Zhang & Sennrich, 2019.

    The mean runs over the last dimension (one normaliser per row). Return dx = dL/dx
    and dw = dL/dw given dy = dL/dy; derive them yourself (the chapter's hint: x enters
    both the numerator and the normaliser).

    Args:
        x: input, shape (..., C).
        w: gain, shape (C,).
        dy: upstream gradient, shape (..., C).
        eps: the epsilon inside the square root.

    Returns:
        (dx, dw) with shapes (..., C) and (C,), in the dtype of x; finite for a zero row
        (eps keeps r finite); new tensors, inputs unchanged, any strides.
    """
    raise NotImplementedError("ex09: rmsnorm_backward")


def swiglu_mlp_backward(x: torch.Tensor, Wg: torch.Tensor, Wu: torch.Tensor,
                        Wd: torch.Tensor, dy: torch.Tensor):
    """Backward of the Qwen2 MLP, ``y = (silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T``.

    The MLP has no biases.

    Return the gradients of all four inputs given dy = dL/dy. Reuse
    ``linear_backward`` and ``silu_backward``.

    Args:
        x: input, shape (..., C).
        Wg, Wu: gate and up projections, shape (I, C).
        Wd: down projection, shape (C, I).
        dy: upstream gradient, shape (..., C).

    Returns:
        (dx, dWg, dWu, dWd) with the shapes and dtype of x, Wg, Wu, Wd; new tensors,
        inputs unchanged, any strides.
    """
    raise NotImplementedError("ex09: swiglu_mlp_backward")


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    """Gradient of the mean token cross-entropy with respect to the logits.

    The loss is the mean of ``logsumexp(z_i) - z_i[t_i]`` over the rows whose target is
    not ``ignore_index`` (the convention of ``torch.nn.functional.cross_entropy``).

    The mean divides by the number of valid rows, not by N. Return the gradient of
    that loss with respect to every logit (ignored rows included).

    Args:
        logits: shape (N, V).
        targets: shape (N,), integer class ids or ``ignore_index``.
        ignore_index: the target value to skip: any integer (-100, -1, a pad id that
            is also a class id, or one past the vocabulary).

    Returns:
        dlogits, shape (N, V), dtype of logits; finite for logits of size 1000 (subtract
        the row maximum); a new tensor: logits and targets unchanged (do not mask the
        targets in place), any strides.
    """
    raise NotImplementedError("ex09: cross_entropy_backward")


def layernorm_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                       dy: torch.Tensor, eps: float = 1e-5):
    """Backward of LayerNorm, ``y = w * (x - mean(x)) / sqrt(var(x) + eps) + b``.

    LayerNorm: Ba, Kiros & Hinton, 2016 (``torch.nn.functional.layer_norm``). Unlike
    RMSNorm it subtracts the row mean and has a bias; var is the biased variance
    (divide by C, not C - 1).

    mean and var run over the last dimension (per row). Return dx, dw and db given
    dy = dL/dy; derive dx from your RMSNorm backward (the exercise's question is what
    the mean adds).

    Args:
        x: input, shape (..., C).
        w, b: gain and bias, shape (C,).
        dy: upstream gradient, shape (..., C).
        eps: added to the variance.

    Returns:
        (dx, dw, db) with shapes (..., C), (C,), (C,), in the dtype of x. Accurate for
        rows with a large common offset (x = 10^4 + noise: compute the variance from
        x - mu, not as mean(x^2) - mu^2) and finite for constant rows (eps decides);
        new tensors, inputs unchanged, any strides.
    """
    raise NotImplementedError("ex09: layernorm_backward")


def predict_mlp_saved_bytes(batch: int, seq: int, hidden: int, inter: int,
                            dtype: torch.dtype) -> int:
    """Predict the bytes autograd saves for one forward of the Qwen2 MLP.

    The MLP is ``transformers``' ``Qwen2MLP``, ``down(silu(gate(x)) * up(x))``, with
    hidden size C = ``hidden``, intermediate size I = ``inter``, its weights and the
    input x of shape (batch, seq, C) in ``dtype``, x requiring grad. Count the
    activations only: the distinct storages autograd keeps for the backward, the weights
    excluded (they are kept anyway). Use the chapter's table: what each op's backward
    needs from the forward.

    The check measures it with ``torch.autograd.graph.saved_tensors_hooks``
    (``instruments.counters.SavedBytesCounter``) on the real module, and compares
    exactly: a byte count has no noise.

    Args:
        batch, seq, hidden, inter: B, T, C, I.
        dtype: the dtype of x and the weights (its ``itemsize`` bytes per element).

    Returns:
        the number of bytes, a Python int.
    """
    raise NotImplementedError("ex09: predict_mlp_saved_bytes")
