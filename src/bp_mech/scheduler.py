"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK: a warmup–stable–decay schedule on an update clock.

A WSD schedule (Hu et al. 2024, "MiniCPM", §4; the formula of ``transformers.get_wsd_schedule``) maps
the index ``k`` of an *effective* update to a learning rate (W, S, D: phase lengths, m = ``min_lr_ratio``)::

    k <  W            lr = base * (m + (1 - m) * k / W)                     (linear warmup)
    W <= k < W+S      lr = base                                             (stable)
    W+S <= k < W+S+D  lr = base * (m + (1 - m) * f(p)),  p = (k - W - S) / D
                      f(p) = 1 - p (linear) or (1 + cos(pi p)) / 2 (cosine)  (decay)
    k >= W+S+D        lr = base * m

The clock that supplies ``k`` must count **successful updates only**. A step the AMP scaler skips
(non-finite gradients) or the trainer skips on purpose changes no parameter, so it must not move
warmup, stable or decay. ``UpdateClock`` does that; ``NaiveClock`` is the common bug (``scheduler.step()``
after every optimizer call) and shifts every boundary earlier by the number of skips before it.
``scaler_step`` detects skips by public ``GradScaler`` API; the experiment is ``experiments.scheduler``.
"""

import math
from dataclasses import dataclass

import torch

DECAY_TYPES = ("linear", "cosine")


@dataclass(frozen=True)
class WSDConfig:
    """A warmup–stable–decay schedule: phase lengths in effective updates, peak LR and floor.

    The fields' comments are the Args. ValueError: an unknown ``decay_type``, a negative length.

    Example:
        >>> WSDConfig(warmup=2, stable=3, decay=4).boundaries
        {'warmup_end': 2, 'decay_start': 5, 'end': 9}
    """

    base_lr: float = 1e-3  # peak learning rate (the stable value)
    warmup: int = 6  # W: updates of linear warmup from min_lr_ratio * base_lr up to base_lr
    stable: int = 10  # S: updates at base_lr
    decay: int = 8  # D: updates of decay from base_lr down to min_lr_ratio * base_lr
    decay_type: str = "cosine"  # "linear" or "cosine" (half a cosine wave)
    min_lr_ratio: float = 0.0  # m: floor as a fraction of base_lr (also where warmup starts)

    def __post_init__(self) -> None:
        if self.decay_type not in DECAY_TYPES:
            raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {self.decay_type!r}")
        if min(self.warmup, self.stable, self.decay) < 0:
            raise ValueError("warmup, stable and decay must be >= 0")

    @property
    def total(self) -> int:
        """W + S + D, the number of updates the schedule spans (int); after it the LR stays at the floor."""
        return self.warmup + self.stable + self.decay

    @property
    def boundaries(self) -> dict[str, int]:
        """Where each phase ends (an effective update): warmup_end W, decay_start W+S, end W+S+D."""
        return {"warmup_end": self.warmup, "decay_start": self.warmup + self.stable, "end": self.total}


def wsd_factor(update: int, cfg: WSDConfig) -> float:
    """The LR multiplier at effective update ``update``, as transformers computes it.

    Args:
        update: k, the 0-based index of the effective update (updates before it).
        cfg: the schedule.

    Returns:
        The factor in [m, 1] by the module's formula (m = ``cfg.min_lr_ratio``).

    Example:
        >>> cfg = WSDConfig(warmup=2, stable=1, decay=2, decay_type="linear")
        >>> [wsd_factor(k, cfg) for k in range(6)]
        [0.0, 0.5, 1.0, 1.0, 0.5, 0.0]
    """
    W, S, D, m = cfg.warmup, cfg.stable, cfg.decay, cfg.min_lr_ratio
    if update < W:
        progress = float(update) / float(max(1, W))
        return max(0.0, progress * (1.0 - m) + m)
    if update < W + S:
        return 1.0
    if update < W + S + D:
        progress = float(update - W - S) / float(max(1, D))
        f = (1.0 - progress if cfg.decay_type == "linear"
             else 0.5 * (1.0 + math.cos(math.pi * progress)))
        return max(0.0, f * (1.0 - m) + m)
    return m


def wsd_lr(update: int, cfg: WSDConfig) -> float:
    """lr = base_lr * wsd_factor(update); LambdaLR multiplies the same way.

    Args:
        update: k, the 0-based index of the effective update (updates before it).
        cfg: the schedule.

    Returns:
        The learning rate of update ``update``, a Python float.

    Raises:
        ValueError: ``update`` < 0.

    Example:
        >>> wsd_lr(1, WSDConfig(base_lr=0.5, warmup=2))
        0.25
    """
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    return float(cfg.base_lr * wsd_factor(update, cfg))


class UpdateClock:
    """The LR clock of a training loop: advances only when an update was applied.

    Args:
        cfg: the schedule.
        optimizer: if given, its param groups' ``lr`` are kept at ``self.lr``.

    Example:
        >>> clock = UpdateClock(WSDConfig(base_lr=1.0, warmup=4))
        >>> clock.step(True), clock.step(False), (clock.updates, clock.skipped)
        (0.25, 0.25, (1, 1))
    """

    def __init__(self, cfg: WSDConfig,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.updates = 0  # successful updates so far
        self.skipped = 0  # optimizer calls that changed nothing
        self._apply()

    @property
    def calls(self) -> int:
        """Optimizer calls so far, applied or skipped: ``updates + skipped``."""
        return self.updates + self.skipped

    @property
    def position(self) -> int:
        """The count the schedule is read at."""
        return self.updates

    @property
    def lr(self) -> float:
        """The learning rate of the next update, ``wsd_lr(position, cfg)``."""
        return wsd_lr(self.position, self.cfg)

    def step(self, applied: bool) -> float:
        """Record one optimizer call; write the new ``lr`` into the optimizer, if any.

        Args:
            applied: True when the call applied the update, False when it skipped it.

        Returns:
            The learning rate of the next update (``self.lr`` after the call).

        Example:
            >>> clock = UpdateClock(WSDConfig(base_lr=1.0, warmup=2))
            >>> clock.lr, clock.step(False), clock.step(True)
            (0.0, 0.0, 0.5)
        """
        if applied:
            self.updates += 1
        else:
            self.skipped += 1
        self._apply()
        return self.lr

    def state_dict(self) -> dict:
        """The counts a checkpoint keeps.

        Returns:
            ``{"updates": int, "skipped": int}``: a new, JSON-serialisable dict.

        Example:
            >>> UpdateClock(WSDConfig()).state_dict()
            {'updates': 0, 'skipped': 0}
        """
        return {"updates": self.updates, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s counts; the optimizer's LR follows.

        Args:
            state: ``{"updates": int, "skipped": int}``, both non-negative ints.

        Returns:
            None; the clock is changed in place.

        Raises:
            ValueError: a count missing, negative or not an int (the clock unchanged).

        Example:
            >>> clock = UpdateClock(WSDConfig(base_lr=1.0, warmup=2))
            >>> clock.load_state_dict({"updates": 1, "skipped": 3}); clock.lr
            0.5
        """
        keys = ("updates", "skipped")
        if not all(type(state.get(k)) is int and state[k] >= 0 for k in keys):
            raise ValueError(f"need non-negative int {keys}, got {state!r}")
        self.updates, self.skipped = state["updates"], state["skipped"]
        self._apply()

    def _apply(self) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr


class NaiveClock(UpdateClock):
    """The bug: reads the schedule at the number of optimizer *calls*, skips included.

    Example:
        >>> NaiveClock(WSDConfig(base_lr=1.0, warmup=2)).step(False)  # the skip counted
        0.5
    """

    @property
    def position(self) -> int:
        """The count the schedule is read at: ``calls``, the bug."""
        return self.calls


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer)``, ``scaler.update()``; True if the update was applied.

    Public API only: the scale shrinks in ``update()`` iff the update was skipped (a
    plain optimizer is then not called; a fused AdamW is called with ``found_inf`` and
    skips inside, leaving parameters, moments and step count). A disabled scaler steps.

    Args:
        scaler: a ``GradScaler`` after ``scaler.scale(loss).backward()``.
        optimizer: the optimizer to step.

    Returns:
        True when the update was applied, False when the scaler skipped it.

    Raises:
        ValueError: an enabled scaler whose ``backoff_factor`` is not < 1.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([p], lr=0.1)
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
        >>> scaler.scale(p.sum() * float("inf")).backward(); scaler_step(scaler, opt)
        False
        >>> opt.zero_grad(); scaler.scale(p.sum()).backward(); scaler_step(scaler, opt)
        True
    """
    if scaler.is_enabled() and not scaler.get_backoff_factor() < 1.0:
        raise ValueError("skip detection needs backoff_factor < 1")
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not scaler.get_scale() < before


def transformers_schedule(cfg: WSDConfig):
    """(dummy optimizer, ``transformers.get_wsd_schedule``) for ``cfg``; step both together.

    Args:
        cfg: the schedule.

    Returns:
        (opt, sched): SGD over one dummy tensor at ``cfg.base_lr``, its ``get_wsd_schedule``.

    Example:
        >>> opt, sched = transformers_schedule(WSDConfig(base_lr=1.0, warmup=2))
        >>> opt.step(); sched.step(); opt.param_groups[0]["lr"]
        0.5
    """
    from transformers import get_wsd_schedule

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.base_lr)
    return opt, get_wsd_schedule(opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable,
                                 decay_type=cfg.decay_type, min_lr_ratio=cfg.min_lr_ratio)


def compare_with_transformers(cfg: WSDConfig, past_end: int = 3) -> dict:
    """LR at every update 0 .. total+past_end-1: ours vs ``get_wsd_schedule``, no skips.

    Args:
        cfg: the schedule.
        past_end: updates to compare after the schedule's end (on the floor).

    Returns:
        A dict: ``ours``, ``theirs`` (lists of floats) and ``max_abs_diff`` (0.0 means bitwise equal).

    Example:
        >>> compare_with_transformers(WSDConfig())["max_abs_diff"]
        0.0
    """
    opt, sched = transformers_schedule(cfg)
    ours, theirs = [wsd_lr(k, cfg) for k in range(cfg.total + past_end)], []
    for _ in ours:
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: a no-op, but it keeps LambdaLR's ordering check quiet
        sched.step()
    return dict(ours=ours, theirs=theirs, max_abs_diff=max(abs(a - b) for a, b in zip(ours, theirs)))
