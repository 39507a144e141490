"""Answers for Part 02 · 10: the package's own implementation is the reference solution.

Read them in ``src/bp_mech/attention_backward.py``; only ``attention_head_backward`` is
assembled here, from the package's forward (which recomputes P) and its backward.
"""

from bp_mech.attention_backward import (  # noqa: F401
    attention_backward,
    attention_forward,
    blockwise_backward,
    gqa_reduce,
    rope_backward,
    softmax_backward,
)


def attention_head_backward(q, k, v, dO):
    """One causal head: recompute P, then dV = P^T dO,
    dS = softmax_backward(P, dO v^T) * scale, ..."""
    _, P, _ = attention_forward(q, k, v)  # (T, T)
    return attention_backward(q, k, v, P, dO)
