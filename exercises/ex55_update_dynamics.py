"""Exercises for Part 02 · 55 — update dynamics: global-norm clipping and the update ratio.

Check your solutions with ``bp-mech check 55`` (or
``pytest tests/test_exercises.py -m ch55 --impl exercises``). The checks compare with
``torch.nn.utils.clip_grad_norm_`` and with float64 norms of the concatenated tensors, on
lists and generators, with None gradients, in float32, bfloat16 and float16, on zero and tiny
gradients (where eps decides) and at a non-default eps.
"""

import torch


def global_grad_norm(grads) -> torch.Tensor:
    """The total (global) L2 norm of a list of gradients.

    Math: ||g|| = sqrt(sum_i ||g_i||_2^2) = the L2 norm of all gradients concatenated
    into one vector. Entries that are None are skipped; with no gradient at all the norm
    is 0.

    Args:
        grads: any iterable (a list, a tuple, a generator that can be iterated only
            once) of tensors (any shapes, float32, bfloat16 or float16) or None.

    Returns:
        A 0-dim tensor in the dtype of the gradients. In float16 the squares of
        gradients of a few hundred already pass its largest value (65504) while the norm
        does not: do not sum squares in 16 bits (``torch.linalg.vector_norm``
        accumulates in float32).
    """
    raise NotImplementedError("ex55: global_grad_norm")


def clip_coefficient(total_norm: torch.Tensor, max_norm: float,
                     eps: float = 1e-6) -> torch.Tensor:
    """The clip coefficient of global-norm clipping (Pascanu et al., 2013).

    Math: c = min(1, max_norm / (total_norm + eps)). Gradients are scaled down when
    their norm exceeds max_norm and never scaled up.

    Args:
        total_norm: 0-dim tensor, the global gradient norm.
        max_norm: the threshold.
        eps: added to the norm (1e-6, as in torch.nn.utils.clip_grad_norm_).

    Returns:
        A 0-dim tensor c in (0, 1].
    """
    raise NotImplementedError("ex55: clip_coefficient")


def clip_by_global_norm_(params, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Clip the gradients of ``params`` in place by their global norm.

    Math: every gradient is multiplied by the same c = min(1, max_norm / (||g|| + eps)),
    ||g|| the global norm over *all* gradients (not one norm per tensor).

    Args:
        params: any iterable of parameters, e.g. ``model.parameters()`` (a generator:
            iterate it once); those whose ``.grad`` is None are skipped.
        max_norm: the threshold.
        eps: as in ``clip_coefficient``.

    Returns:
        The global norm before clipping (0-dim tensor), like
        ``torch.nn.utils.clip_grad_norm_``.
    """
    raise NotImplementedError("ex55: clip_by_global_norm_")


def update_ratio(before, after):
    """The update-to-parameter ratio of a group of tensors.

    Math: with Δ_i = after_i - before_i,
        update_norm = sqrt(sum_i ||Δ_i||^2),  param_norm = sqrt(sum_i ||before_i||^2),
        ratio = update_norm / param_norm.
    One global ratio for the group (not the mean of per-tensor ratios), relative to the
    parameters *before* the update.

    Args:
        before: list of tensors, the parameters before the optimizer step (any float
            dtype).
        after: list of tensors of the same shapes, after the step (they may be live
            parameters that require grad).

    Returns:
        (update_norm, param_norm, ratio) as Python floats (computed in float64).
    """
    raise NotImplementedError("ex55: update_ratio")
