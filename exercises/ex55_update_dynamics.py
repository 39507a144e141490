"""Exercises for Part 02 · 55 — update dynamics: global-norm clipping and the update ratio.

Check your solutions with ``bp-mech check 55`` (or
``pytest tests/test_exercises.py -m ch55 --impl exercises``). The checks compare with
``torch.nn.utils.clip_grad_norm_`` and with float64 norms of the concatenated tensors, on
lists and generators, with None gradients, in float32, bfloat16 and float16, on zero and tiny
gradients (where eps decides) and at a non-default eps. Each function is also held to
the whole contract its docstring states, on cases drawn by hypothesis; a failure prints
the smallest case that breaks it.
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
        A 0-dim tensor in the dtype of the gradients, detached (no graph, even when the
        tensors require grad), sharing no storage with them. In float16 the squares of
        gradients of a few hundred already pass its largest value (65504) while the norm
        does not: do not sum squares in 16 bits (``torch.linalg.vector_norm``
        accumulates in float32). A gradient holding ±inf gives ``inf``, one holding a
        NaN gives ``nan`` (as ``clip_grad_norm_``): never a finite norm, never skipped.

    Contract (checked): the gradients are not modified; non-contiguous views (a slice,
    a transpose) give the same norm.
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
        A NEW 0-dim tensor c in (0, 1] in total_norm's dtype; ``total_norm`` is not
        modified (no ``total_norm.add_(eps)``). As ``clip_grad_norm_``: an inf norm
        gives c = 0, a NaN norm gives c = NaN (passed on, not hidden as 1).
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
        The global norm before clipping (0-dim tensor, detached), like
        ``torch.nn.utils.clip_grad_norm_``.

    Contract (checked): only the ``.grad`` tensors change, in place (the same tensor
    objects, also when a ``.grad`` is a non-contiguous view); the parameters' values do
    not. Non-finite gradients are treated as ``clip_grad_norm_`` treats them: an inf
    norm makes c = 0, a NaN norm makes c = NaN, and the gradients are multiplied by it.
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
        (update_norm, param_norm, ratio) as Python floats (computed in float64), exactly
        ``float`` (not tensors); the ratio is ``math.inf`` when param_norm is 0. A NaN
        in ``after`` makes update_norm and ratio NaN, an inf makes them inf.

    Contract (checked): ``before`` and ``after`` are not modified; non-contiguous views
    give the same values.
    """
    raise NotImplementedError("ex55: update_ratio")


def clip_per_group_(groups: dict, max_norms, eps: float = 1e-6) -> dict:
    """Per-layer (per-group) clipping: each group clipped by ITS OWN global norm.

    Math: for each group G, ||g_G|| = sqrt(sum_{i in G} ||g_i||^2) and every gradient of
    G is multiplied by c_G = min(1, max_norm_G / (||g_G|| + eps)). A spike in one group
    no longer shrinks the others (global clipping uses one c for all). This is
    ``torch.nn.utils.clip_grad_norm_(group, max_norm_G)`` applied to each group.

    Args:
        groups: a dict from a group's name to a list of parameters (as
            ``bp_mech.update_dynamics.param_groups`` gives); a ``.grad`` may be None
            (skipped) or a non-contiguous view.
        max_norms: one threshold for every group (a float) or a dict name -> float.
        eps: added to each group's norm.

    Returns:
        A dict name -> that group's norm before clipping (a detached 0-dim tensor in the
        gradients' dtype; ``torch.zeros(())`` for a group without any gradient), in the
        order of ``groups``.

    Contract (checked): only the ``.grad`` tensors change, in place (the same tensor
    objects); the parameters' values, ``groups`` and ``max_norms`` do not. A group
    with an inf or NaN gradient is clipped as ``clip_grad_norm_`` does it (c = 0 or
    NaN) and leaves every other group exactly as finite clipping would.
    """
    raise NotImplementedError("ex55: clip_per_group_")


def predict_first_update_norm(optimizer: str, numel: int, grad_norm: float,
                              max_norm: float, lr: float) -> float:
    """Predict, then measure: the norm ||p_1 - p_0|| of the FIRST update after clipping.

    A parameter of ``numel`` elements (all gradient elements far from zero) has a
    gradient of norm ``grad_norm``; it is clipped with ``clip_grad_norm_(max_norm)``
    (eps 1e-6), then one step of the optimizer runs with learning rate ``lr``:

    * ``"sgd"``: ``torch.optim.SGD(lr=lr)`` (no momentum);
    * ``"adamw"``: ``torch.optim.AdamW(lr=lr, weight_decay=0)`` with its default
      betas and eps (1e-8), on its first step (fresh state).

    Args:
        optimizer: "sgd" or "adamw".
        numel: the number of elements of the parameter.
        grad_norm: ||g|| before clipping.
        max_norm: the clip threshold.
        lr: the learning rate.

    Returns:
        The predicted update norm, exactly a Python float. The check runs the real
        optimizer on float64 parameters: SGD within 1e-9 (the update is linear in g),
        AdamW within 1e-3 (its eps against gradient elements far larger than it).
    """
    raise NotImplementedError("ex55: predict_first_update_norm")
