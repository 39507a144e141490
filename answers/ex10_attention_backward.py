"""Answers for Part 02 · 10: the package's own implementation is the reference solution.

Read them in ``src/bp_mech/attention_backward.py``; only ``attention_head_backward`` is
assembled here, from the package's forward (which recomputes P) and its backward; the
variant (a sliding-window head) and the prediction are written here.
"""

import torch

from bp_mech.attention_backward import (  # noqa: F401 (re-exported: the answers to Exercises 10.3 and 10.4)
    attention_backward, attention_forward, blockwise_backward, gqa_reduce, softmax_backward)
from bp_mech.attention_rope import rope_backward  # noqa: F401 (re-exported: the answer to Exercise 10.5)


def attention_head_backward(q, k, v, dO):
    """One causal head: recompute P, then dV = P^T dO,
    dS = softmax_backward(P, dO v^T) * scale, ..."""
    _, P, _ = attention_forward(q, k, v)  # (T, T)
    return attention_backward(q, k, v, P, dO)


def sliding_window_head_backward(q, k, v, dO, window):
    """The causal head's backward with a banded mask: only the mask is new."""
    T, scale = q.shape[-2], q.shape[-1] ** -0.5
    i = torch.arange(T, device=q.device)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # (T, T)
    S = (q @ k.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
    P = torch.softmax(S, dim=-1)  # stable: the row maximum is subtracted
    dv = P.transpose(-2, -1) @ dO
    dS = softmax_backward(P, dO @ v.transpose(-2, -1)) * scale  # 0 where masked
    return dS @ k, dS.transpose(-2, -1) @ q, dv


def predict_eager_saved_bytes(batch, heads, seq, head_dim, dtype):
    """q and k (the product), v and P (the second product; softmax saves the same P),
    and the (T, T) bool mask once, broadcast over batch and heads; S is not kept."""
    per_head = 3 * seq * head_dim + seq * seq  # q, k, v and P, elements
    return batch * heads * per_head * dtype.itemsize + seq * seq  # + the mask, 1 B each
