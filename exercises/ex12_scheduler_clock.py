"""Exercises for Part 02 · 12 — the WSD schedule and an LR clock that counts updates.

``WSDConfig`` (from the package) holds the schedule: ``base_lr``, ``warmup`` (W),
``stable`` (S), ``decay`` (D), ``decay_type`` ("linear" or "cosine") and
``min_lr_ratio`` (m).

Check your solutions with ``bp-mech check 12`` (or ``pytest tests/test_exercises.py -m
ch12 --impl exercises``). The checks compare against ``transformers.get_wsd_schedule``
at every update (relative tolerance 1e-12), with and without skipped steps, on schedules
with every phase of length 0 that ``WSDConfig`` allows.
"""

from bp_mech.scheduler import WSDConfig  # noqa: F401  (the schedule's fields)


def wsd_lr(update: int, cfg: "WSDConfig") -> float:
    """The learning rate of effective update ``update`` (0-based) under a WSD schedule.

    Math (the convention of ``transformers.get_wsd_schedule``), with W, S, D, m from
    cfg:

        k <  W            lr = base * (m + (1 - m) * k / W)          linear warmup
        W <= k < W+S      lr = base                                  stable
        W+S <= k < W+S+D  lr = base * (m + (1 - m) * f(p)),  p = (k - W - S) / D
                          f(p) = 1 - p (linear)  or  (1 + cos(pi * p)) / 2 (cosine)
        k >= W+S+D        lr = base * m

    Note that warmup starts at base * m (not 0 unless m = 0), update W is the first at
    the full rate, update W+S the first of the decay, and update W+S+D the first at the
    floor. Use max(1, W) and max(1, D) as denominators so that W = 0 or D = 0 is
    allowed. Any phase may have length 0: with D = 0, update W+S is already at the floor
    base * m (no decay step at the full rate); with W = S = D = 0 every update is at the
    floor.

    Args:
        update: k, the number of successful updates before this one (>= 0).
        cfg: the schedule.

    Returns:
        The learning rate (a Python float).
    """
    raise NotImplementedError("ex12: wsd_lr")


class UpdateClock:
    """An LR clock that advances on successful updates only.

    A training loop calls ``step(applied)`` once per optimizer call, where ``applied``
    says whether ``optimizer.step()`` really ran (False when the AMP scaler skipped it
    because of inf/NaN gradients, or when the loop skipped the step itself). A skipped
    call must leave the schedule where it is.

    Attributes:
        cfg: the WSDConfig.
        updates: successful updates so far (int, starts at 0).
        skipped: skipped calls so far (int, starts at 0).

    ``lr`` is the learning rate of the *next* update, ``wsd_lr(updates, cfg)``: before
    any call it is ``wsd_lr(0, cfg)``, exactly like ``LambdaLR`` right after
    construction.
    """

    def __init__(self, cfg: "WSDConfig") -> None:
        """Start the clock at zero updates and zero skips.

        Args:
            cfg: the schedule.
        """
        raise NotImplementedError("ex12: UpdateClock.__init__")

    @property
    def lr(self) -> float:
        """The learning rate of the next update: ``wsd_lr(self.updates, self.cfg)``."""
        raise NotImplementedError("ex12: UpdateClock.lr")

    def step(self, applied: bool) -> float:
        """Record one optimizer call.

        Args:
            applied: True when the update was applied, False when it was skipped.

        Returns:
            The learning rate of the next update (``self.lr`` after the call).
        """
        raise NotImplementedError("ex12: UpdateClock.step")
