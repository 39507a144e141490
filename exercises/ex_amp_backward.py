"""Exercises for the mixed-precision backward chapter — dynamic loss scaling and clipping.

Check your solutions with ``bp-mech check amp`` (or
``pytest tests/test_exercises.py -m amp --impl exercises``). The checks drive a real
``torch.amp.GradScaler`` with the same overflow patterns (also near float32's largest value) and
compare its scale, its growth tracker and its skipped steps with yours, and compare your clipping
with ``torch.nn.utils.clip_grad_norm_`` applied to the unscaled gradients (also tiny and zero
gradients, where eps decides, a non-default eps, and inf, -inf and NaN gradients).
"""

import torch


class DynamicLossScaler:
    """The update rule of ``torch.amp.GradScaler`` (dynamic loss scaling), in Python.

    The loss is multiplied by ``scale`` (S) before ``backward()``. After each step the
    scaler learns whether any gradient was inf/NaN (``found_inf``) and:

        found_inf:  skip the update;  S <- S * backoff_factor;  tracker <- 0
        otherwise:  tracker <- tracker + 1
                    if tracker == growth_interval:
                        S <- S * growth_factor;  tracker <- 0

    GradScaler keeps S in a float32 tensor: every new S is rounded to float32, and a
    grown S that is inf *in float32* is not taken (the tracker still resets). Float32's
    largest value is about 3.4e38, so with growth_factor 2 the scale stops at 2^127,
    although 2^128 is a finite Python float.

    Attributes:
        scale: the current loss scale S (float).
        growth_tracker: finite steps since the last overflow or growth (int).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        """Same arguments and defaults as ``torch.amp.GradScaler``.

        Args:
            init_scale: the first S.
            growth_factor: multiplier of S after ``growth_interval`` consecutive finite
                steps.
            backoff_factor: multiplier of S on an overflow step (< 1).
            growth_interval: consecutive finite steps before a growth.
        """
        raise NotImplementedError("ex_amp: DynamicLossScaler.__init__")

    def update(self, found_inf: bool) -> bool:
        """Advance the scaler by one step.

        Args:
            found_inf: whether this step's (unscaled) gradients held an inf or a NaN.

        Returns:
            True when this step must apply no update (the skipped step).
        """
        raise NotImplementedError("ex_amp: DynamicLossScaler.update")


def unscale_and_clip_(grads: list[torch.Tensor], scale: float, max_norm: float,
                      eps: float = 1e-6):
    """Unscale gradients in place, then clip them by their *unscaled* global norm.

    Under a loss scale S the gradients in ``.grad`` are S times the true ones. The clip
    threshold ``max_norm`` is meant for true gradients, so unscale first:

        g_i <- g_i / S                                 (every tensor, in place)
        total_norm = || (g_1, ..., g_n) ||_2           (2-norm over all elements)
        clip_coef  = min(1, max_norm / (total_norm + eps))
        g_i <- g_i * clip_coef                         (only when total_norm is finite)

    This is what ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params,
    max_norm)`` does. When a gradient is inf/NaN, ``found_inf`` is True and nothing is
    clipped (the step will be skipped).

    Args:
        grads: the gradient tensors (any shapes), modified in place.
        scale: the loss scale S they carry.
        max_norm: the clip threshold for the true gradient norm.
        eps: added to the norm in the denominator (as clip_grad_norm_).

    Returns:
        (total_norm, clip_coef, found_inf): the unscaled norm (float, before clipping),
        the coefficient applied (float in (0, 1]; 1.0 when found_inf), and whether any
        gradient was inf/NaN (bool).
    """
    raise NotImplementedError("ex_amp: unscale_and_clip_")
