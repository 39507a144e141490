"""Answers for Part 02 · 55.

The package's implementation (``src/bp_mech/update_dynamics.py``) of the four functions
the chapter measures with; the variant and the prediction are written here.
"""

import math

from bp_mech.update_dynamics import (  # noqa: F401
    clip_by_global_norm_,
    clip_coefficient,
    global_grad_norm,
    update_ratio,
)


def clip_per_group_(groups, max_norms, eps=1e-6):
    norms = {}
    for name, params in groups.items():
        limit = max_norms[name] if isinstance(max_norms, dict) else max_norms
        norms[name] = clip_by_global_norm_(params, limit, eps)  # this group's norm
    return norms


def predict_first_update_norm(optimizer, numel, grad_norm, max_norm, lr):
    """Clipping multiplies g by c = min(1, max_norm / (||g|| + eps)). SGD moves by lr
    times the clipped gradient: lr c ||g||. AdamW's first bias-corrected moments are
    c g and c^2 g^2, so m/sqrt(v) = sign(g) per element (its eps is negligible): every
    element moves by lr, a norm of lr sqrt(numel), whatever c is."""
    if optimizer == "adamw":  # m/sqrt(v) = g/|g| = ±1 per element, whatever c is
        return lr * math.sqrt(numel)
    coef = min(1.0, max_norm / (grad_norm + 1e-6))  # SGD: p -= lr * c * g
    return lr * coef * grad_norm
