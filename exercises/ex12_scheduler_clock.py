"""Exercises for Part 02 · 12 — the WSD schedule and an LR clock that counts updates.

``WSDConfig`` (from the package) holds the schedule: ``base_lr``, ``warmup`` (W),
``stable`` (S), ``decay`` (D), ``decay_type`` ("linear" or "cosine") and
``min_lr_ratio`` (m).

Check your solutions with ``bp-mech check 12`` (or ``pytest tests/test_exercises.py -m
ch12 --impl exercises``). The checks compare against ``transformers.get_wsd_schedule``
at every update (relative tolerance 1e-12), with and without skipped steps, on schedules
with every phase of length 0 that ``WSDConfig`` allows; the variant against
``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``; the prediction against a
real ``torch.amp.GradScaler`` loop. Beyond the values, they hold each function to the
contract its docstring states (explored with hypothesis on drawn schedules and skip
patterns).
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
        The learning rate, exactly a Python ``float`` (not an int for an integer
        base_lr, not a numpy or tensor scalar: it goes into a JSON record).

    Raises:
        ValueError: if ``update < 0``.
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

    Contract (checked on drawn schedules and skip patterns): ``lr`` and ``step()``
    return Python floats, ``updates`` and ``skipped`` Python ints; two clocks never
    share state (keep the counts on the instance, not on the class); ``state_dict()``
    and ``load_state_dict()`` round-trip every piece of state, so that a resumed
    clock continues exactly where the saved one was.
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

    def state_dict(self) -> dict:
        """The clock's state, for a checkpoint.

        Returns:
            A new dict ``{"updates": int, "skipped": int}`` (JSON-serialisable; changing
            it afterwards does not change the clock).
        """
        raise NotImplementedError("ex12: UpdateClock.state_dict")

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: ``updates``, ``skipped`` and so ``lr``.

        Args:
            state: ``{"updates": int, "skipped": int}`` as ``state_dict`` returns it.

        Raises:
            ValueError: a missing key, or a count that is not a non-negative int
                (a float such as 3.0 included); the clock is left unchanged.
        """
        raise NotImplementedError("ex12: UpdateClock.load_state_dict")


def cosine_restarts_lr(update: int, base_lr: float, cycle: int, mult: int = 1,
                       min_lr: float = 0.0) -> float:
    """Cosine annealing with warm restarts (SGDR, Loshchilov & Hutter 2017).

    Math: cycle i lasts L_i = cycle * mult**i updates. Write update k as
    k = L_0 + ... + L_{i-1} + t with 0 <= t < L_i (t: updates since the last
    restart). Then

        lr = min_lr + (base_lr - min_lr) * (1 + cos(pi * t / L_i)) / 2

    so every cycle starts at base_lr (a restart) and falls towards min_lr, which it
    never reaches; with mult > 1 each cycle is mult times longer than the one before.
    This is ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(T_0=cycle,
    T_mult=mult, eta_min=min_lr)`` after ``update`` calls of ``step()``. Find t with
    integers (never with a float division and a ``% 1.0``: a restart would then land
    one update late whenever the quotient rounds just below an integer).

    Args:
        update: k, applied updates before this one (>= 0), as ``UpdateClock`` counts.
        base_lr: the rate at each restart.
        cycle: L_0, the length of the first cycle in updates (>= 1).
        mult: the growth factor of the cycle length (int >= 1).
        min_lr: the floor the cosine falls towards.

    Returns:
        The learning rate, exactly a Python ``float``.

    Raises:
        ValueError: if ``update < 0``, ``cycle < 1`` or ``mult < 1``.
    """
    raise NotImplementedError("ex12: cosine_restarts_lr")


def predict_decay_entry(warmup: int, stable: int, overflows: int,
                        growth_interval: int) -> tuple:
    """Predict where decay begins when a GradScaler skips steps, for both clocks.

    The loop: every optimizer call goes through ``torch.amp.GradScaler`` (growth and
    backoff factor 2). The scale starts ``overflows`` doublings above the largest one
    the gradients tolerate, so the first ``overflows`` calls overflow and are skipped,
    each halving the scale. From then on, after every ``growth_interval`` applied
    updates in a row the scaler doubles the scale, the next call overflows again, is
    skipped, and halves it back. The schedule is a WSD with W = ``warmup`` and
    S = ``stable`` (the decay starts at update W + S).

    Args:
        warmup: W (>= 0).
        stable: S (>= 0).
        overflows: skipped calls at the start (>= 0).
        growth_interval: the scaler's ``growth_interval`` (>= 1).

    Returns:
        A tuple of two Python ints ``(call, naive_updates)``: ``call`` is the 0-based
        optimizer call that applies the first decay-phase update under ``UpdateClock``
        (the call applying update W + S); ``naive_updates`` is the number of updates
        applied before the call at which ``NaiveClock`` (counting calls) first reads
        the decay phase (call W + S).
    """
    raise NotImplementedError("ex12: predict_decay_entry")
