"""Exercises for the mixed-precision backward chapter — dynamic loss scaling and clipping.

Check your solutions with ``bp-mech check amp`` (or
``pytest tests/test_exercises.py -m amp --impl exercises``). The checks drive a real
``torch.amp.GradScaler`` with the same overflow patterns (also near float32's largest value) and
compare its scale, its growth tracker and its skipped steps with yours, and compare your clipping
with ``torch.nn.utils.clip_grad_norm_`` applied to the unscaled gradients (also tiny and zero
gradients, where eps decides, a non-default eps, and inf, -inf and NaN gradients). Each
function is also held to the whole contract its docstring states, on cases drawn by
hypothesis; a failure prints the smallest case that breaks it.
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
        scale: the current loss scale S (a Python float).
        growth_tracker: finite steps since the last overflow or growth (a Python int).

    Contract (checked): step by step the same skip, scale and tracker as GradScaler;
    two instances share no state (updating one never changes another); the
    ``state_dict`` round trip restores every piece of state.
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
            True when this step must apply no update (the skipped step): exactly a
            Python ``bool``, never a tensor or a NumPy bool.
        """
        raise NotImplementedError("ex_amp: DynamicLossScaler.update")

    def state_dict(self) -> dict:
        """The scaler's state as ``torch.amp.GradScaler.state_dict()`` gives it.

        Returns:
            A NEW dict (changing it does not change the scaler) with GradScaler's keys
            and values, JSON-serialisable: ``{"scale": float, "growth_factor": float,
            "backoff_factor": float, "growth_interval": int,
            "_growth_tracker": int}``.
        """
        raise NotImplementedError("ex_amp: DynamicLossScaler.state_dict")

    def load_state_dict(self, state: dict) -> None:
        """Restore every piece of state from a ``state_dict()`` (ours or GradScaler's).

        After ``b.load_state_dict(a.state_dict())``, ``b`` behaves exactly as ``a`` on
        every later step. ``state`` is not modified. A missing key raises ``KeyError``
        (nothing is guessed or kept silently).

        Args:
            state: a dict with the keys of ``state_dict()``.
        """
        raise NotImplementedError("ex_amp: DynamicLossScaler.load_state_dict")


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
        grads: the gradient tensors (any shapes; float32, float16 or bfloat16; possibly
            non-contiguous views into a larger buffer), modified in place THROUGH those
            tensors: the caller's objects hold the result (no copies returned).
        scale: the loss scale S they carry.
        max_norm: the clip threshold for the true gradient norm.
        eps: added to the norm in the denominator (as clip_grad_norm_).

    Returns:
        (total_norm, clip_coef, found_inf), exactly a Python float, a Python float and
        a Python bool: the unscaled norm before clipping (``inf`` when a gradient holds
        ±inf, ``nan`` when one holds a NaN: the two are told apart, as
        ``clip_grad_norm_`` tells them), the coefficient applied (in (0, 1]; 1.0 when
        found_inf), and whether any gradient was inf/NaN.
    """
    raise NotImplementedError("ex_amp: unscale_and_clip_")


def cast_report(grads: list[torch.Tensor], dtype: torch.dtype = torch.bfloat16):
    """A 16-bit policy WITHOUT a loss scaler: what storing gradients in ``dtype`` loses.

    BF16 needs no scaler (float32's exponent), FP16 does. Without a scaler the values a
    16-bit op's backward stores are the float32 values rounded to ``dtype`` (round to
    nearest, ties to even: what ``.to(dtype)`` and autocast's casts do). Over all
    elements x of all tensors, with r(x) the rounded value:

        underflow = #{x finite, x != 0 : r(x) == 0}     a nonzero gradient became zero
        overflow  = #{x finite : r(x) is +-inf}         a finite gradient became inf
        found_inf = any r(x) is inf or NaN              the step must be skipped

    A subnormal r(x) is kept: it is NOT an underflow (only a value at or below half the
    smallest subnormal rounds to 0). An input inf or NaN makes found_inf True and is in
    neither count (it was not finite before the cast). Float32's largest values are past
    bfloat16's: they overflow too.

    Args:
        grads: float32 tensors, any shapes, contiguous or not (e.g. a transposed view);
            NOT modified.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        (found_inf, underflow, overflow): exactly a Python bool and two Python ints
        (not tensors); (False, 0, 0) for an empty list.
    """
    raise NotImplementedError("ex_amp: cast_report")


def predict_recovery_step(overflows: int, growth_interval: int,
                          backoff_factor: float = 0.5,
                          growth_factor: float = 2.0) -> int:
    """Predict, then measure: when does the scale come back after a run of overflows?

    A ``DynamicLossScaler`` (or ``torch.amp.GradScaler``) starts at S0. Steps
    0, 1, ..., ``overflows`` - 1 overflow; every later step is finite. After which
    step's update is the scale back at S0 (or above) for the first time? Work it out
    from the scaler's update rule with pencil and paper, before you run anything. The
    check runs a real GradScaler through the same steps and compares exactly.

    Args:
        overflows: the number k >= 1 of overflow steps in a row at the start.
        growth_interval: N, the finite steps in a row before a growth.
        backoff_factor: a power of two below 1 (0.5, 0.25, ...).
        growth_factor: a power of two above 1 (2, 4, ...).

    Returns:
        The step index (0-based), exactly a Python int.
    """
    raise NotImplementedError("ex_amp: predict_recovery_step")
