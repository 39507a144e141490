"""Exercises for Part 02 · 10 — the attention backward, by hand.

Implement each function below with tensor operations only (no ``torch.autograd``, no
``.backward()``, no ``scaled_dot_product_attention``). Shapes use T for the sequence
length and d for the head width; "..." means any leading dimensions (batch, heads).

The attention is causal: query position i sees key positions j <= i (itself included).
Scores are scaled by ``scale = 1 / sqrt(d)``.

Check your solutions with ``bp-mech check 10`` (or ``pytest tests/test_exercises.py -m
ch10 --impl exercises``). The checks compare against float64 autograd through PyTorch's
and transformers' own functions on fresh random inputs (relative tolerance 1e-10), with
no, one and two leading dimensions where "..." allows them, and measure the memory of
your blockwise backward.

The contract every function here is held to (explored on drawn shapes, seeds, layouts):

- the inputs are not modified (no in-place scaling of q, no reuse of dO or dP as a
  buffer);
- non-contiguous inputs (a transposed or sliced view of a larger storage, as k is after
  a transpose) give the same result;
- the returned tensors are new: none shares its storage with an input, even when the
  answer equals an input (``gqa_reduce`` with ``kv_heads`` equal to H);
- float32 inputs give float32 results (within 1e-4 of the float64 reference);
- where scores are computed, they may reach 1e3 in size: the results stay finite and
  exact (never exp of a raw score).
"""

import torch


def softmax_backward(P: torch.Tensor, dP: torch.Tensor) -> torch.Tensor:
    """Backward of the row softmax ``P = softmax(S, dim=-1)``.

    Each row of the last dimension is one softmax: return dS = dL/dS given
    dP = dL/dP, row by row, without forming the Jacobian.

    Args:
        P: softmax probabilities, shape (..., n); every row sums to 1.
        dP: upstream gradient with respect to P, shape (..., n).

    Returns:
        dS, the gradient with respect to the scores S, shape (..., n), dtype of P; a new
        tensor (P and dP unchanged), any strides.
    """
    raise NotImplementedError("ex10: softmax_backward")


def attention_head_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            dO: torch.Tensor):
    """Backward of one causal attention head, recomputing P from q and k.

    Forward (what you must recompute):
        S = scale * q k^T                      (T, T), scale = 1 / sqrt(d)
        S[i, j] = -inf where j > i             (the causal mask; j == i stays visible)
        P = softmax(S, dim=-1),   O = P v
    Return the gradients of q, k and v given dO = dL/dO (your softmax backward is one
    step of it).

    Args:
        q, k, v: query, key, value of one head, shape (T, d) each.
        dO: upstream gradient with respect to O, shape (T, d).

    Returns:
        (dq, dk, dv), each of shape (T, d) and of the dtype of q; finite and exact for
        scores of size 1e3 (a stable softmax); new tensors, inputs unchanged, any
        strides.
    """
    raise NotImplementedError("ex10: attention_head_backward")


def gqa_reduce(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Backward of the grouped-query expansion of K or V.

    The expansion is ``repeat_kv`` in transformers.

    In the forward, H query heads share Hkv = ``kv_heads`` KV heads: KV head g is copied
    to the n = H / Hkv consecutive query heads g*n, g*n + 1, ..., g*n + n - 1, i.e.
    x_full[:, h] = x[:, h // n]. Return the gradient of the (B, Hkv, T, d) tensor
    given the gradient of the expanded one.

    Args:
        dx: gradient with respect to the expanded tensor, shape (B, H, T, d).
        kv_heads: Hkv, a divisor of H.

    Returns:
        the gradient with respect to the KV tensor, shape (B, Hkv, T, d), dtype of dx;
        a new tensor even when Hkv = H (then equal to dx, but not dx itself), dx
        unchanged, any strides.
    """
    raise NotImplementedError("ex10: gqa_reduce")


def blockwise_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, dO: torch.Tensor,
                       block: int):
    """The recompute (FlashAttention) backward of causal attention, one tile at a time.

    The forward is ``attention_head_backward``'s (causal, scale = 1 / sqrt(d)); it
    saved only O and the row log-sum-exp L[i] = logsumexp_j S[i, j] (masked entries
    excluded), not P. Work in tiles of query rows I and key columns J, each
    [start, start + block) (the last tile may be shorter): rebuild what a tile needs
    from q, k, v, O, L and dO, and add its contributions to dq, dk and dv.
    Never build a (T, T) matrix, not even one head at a time: the check measures the
    memory your function allocates and fails when it reaches the size of ONE head's full
    (T, T) score matrix (T * T elements, whatever the leading dimensions). T need not be
    a multiple of block.

    Args:
        q, k, v: shape (..., T, d) each (same leading dims: K/V already expanded to all
            heads).
        o: the forward's output, shape (..., T, d).
        lse: the forward's row log-sum-exp of the scaled, masked scores, shape (..., T).
        dO: upstream gradient with respect to o, shape (..., T, d).
        block: tile edge, a positive int.

    Returns:
        (dq, dk, dv), each of shape (..., T, d) and of the dtype of q; finite and exact
        for scores of size 1e3 (use exp(S - L), never exp(S) / exp(L)); new tensors,
        inputs unchanged, any strides.
    """
    raise NotImplementedError("ex10: blockwise_backward")


def rope_backward(dy: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Backward of the rotary position embedding as Qwen2 applies it.

    Qwen2 applies it with ``apply_rotary_pos_emb``.

    Forward: y = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) for
    the halves x1, x2 of the last dimension. Return dx = dL/dx given dy = dL/dy (the
    tables are constants: no gradient for them).

    Args:
        dy: upstream gradient, shape (..., T, d), d even.
        cos, sin: the rotary tables, broadcastable to dy (e.g. (T, d)).

    Returns:
        dx, shape and dtype of dy; a new tensor, dy, cos and sin unchanged, any strides.
    """
    raise NotImplementedError("ex10: rope_backward")


def sliding_window_head_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 dO: torch.Tensor, window: int):
    """Backward of one causal head under a sliding-window mask (as in Mistral).

    Query i sees the ``window`` most recent keys, itself included:
        visible[i, j] = (i - window < j <= i)
    so window = 1 sees only itself and window >= T is the plain causal mask. Otherwise
    the head is ``attention_head_backward``'s:
        S = scale * q k^T, S[i, j] = -inf where not visible, P = softmax(S), O = P v
    and its backward needs no new formula: masked entries have P = 0, hence dS = 0.

    Args:
        q, k, v: query, key, value, shape (..., T, d) each.
        dO: upstream gradient with respect to O, shape (..., T, d).
        window: the number of keys each query sees, a positive int.

    Returns:
        (dq, dk, dv), each of shape (..., T, d) and of the dtype of q; finite and exact
        for scores of size 1e3; new tensors, inputs unchanged, any strides.
    """
    raise NotImplementedError("ex10: sliding_window_head_backward")


def predict_eager_saved_bytes(batch: int, heads: int, seq: int, head_dim: int,
                              dtype: torch.dtype) -> int:
    """Predict the bytes autograd saves for one eager causal attention forward.

    q, k, v of shape (B, H, T, d) in ``dtype``, each requiring grad, and the forward

        S = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)   # True above the diagonal
        P = torch.softmax(S.masked_fill(mask, float("-inf")), dim=-1)
        O = P @ v

    Count the distinct storages autograd keeps for the backward (a storage saved twice
    counts once; a bool takes one byte). The check measures it with
    ``torch.autograd.graph.saved_tensors_hooks`` (``SavedBytesCounter``) and compares
    exactly: a byte count has no noise.

    Args:
        batch, heads, seq, head_dim: B, H, T, d.
        dtype: the dtype of q, k, v (its ``itemsize`` bytes per element).

    Returns:
        the number of bytes, a Python int.
    """
    raise NotImplementedError("ex10: predict_eager_saved_bytes")
