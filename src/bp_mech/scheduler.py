"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK: a warmup–stable–decay schedule on an update clock.

A WSD schedule (Hu et al. 2024, "MiniCPM", §4; the formula of ``transformers.get_wsd_schedule``)
maps the index ``k`` of an *effective* update to a learning rate. With W, S, D the warmup,
stable and decay lengths and m = ``min_lr_ratio``::

    k <  W            lr = base * (m + (1 - m) * k / W)                     (linear warmup)
    W <= k < W+S      lr = base                                             (stable)
    W+S <= k < W+S+D  lr = base * (m + (1 - m) * f(p)),  p = (k - W - S) / D
                      f(p) = 1 - p (linear) or (1 + cos(pi p)) / 2 (cosine)  (decay)
    k >= W+S+D        lr = base * m

The clock that supplies ``k`` must count **successful updates only**. A step the AMP scaler
skips (non-finite gradients) or the trainer skips on purpose changes no parameter, so it must
not move warmup, stable or decay. ``UpdateClock`` does that; ``NaiveClock`` is the common bug
(``scheduler.step()`` after every optimizer call) and shifts every boundary earlier by the
number of skips before it.

Skip detection relies on public ``torch.amp.GradScaler`` API only (``scaler_step``):
``update()`` multiplies the scale by ``backoff_factor < 1`` exactly when the step found
inf/NaN, which is exactly when ``step()`` did not call ``optimizer.step()``; so a smaller
``get_scale()`` after ``update()`` means "skipped". (Accelerate does the same job with
``AcceleratedOptimizer.step_was_skipped``, which its scheduler wrapper consults.)

The experiment (a real GradScaler run with injected skips, both clocks) is
``bp_mech.experiments.scheduler``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAY_TYPES = ("linear", "cosine")


@dataclass(frozen=True)
class WSDConfig:
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
        return self.warmup + self.stable + self.decay

    @property
    def boundaries(self) -> dict[str, int]:
        """The effective update at which each phase ends (warmup end = first full-LR update)."""
        return {"warmup_end": self.warmup, "decay_start": self.warmup + self.stable, "end": self.total}


def wsd_factor(update: int, cfg: WSDConfig) -> float:
    """The LR multiplier at effective update ``update`` (0-based), as transformers computes it."""
    W, S, D, m = cfg.warmup, cfg.stable, cfg.decay, cfg.min_lr_ratio
    if update < W:
        progress = float(update) / float(max(1, W))
        return max(0.0, progress * (1.0 - m) + m)
    if update < W + S:
        return 1.0
    if update < W + S + D:
        progress = float(update - W - S) / float(max(1, D))
        f = 1.0 - progress if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, f * (1.0 - m) + m)
    return m


def wsd_lr(update: int, cfg: WSDConfig) -> float:
    """lr = base_lr * wsd_factor(update); LambdaLR multiplies the same way."""
    return cfg.base_lr * wsd_factor(update, cfg)


class UpdateClock:
    """The LR clock of a training loop: advances only when an update was applied.

    ``lr`` is the learning rate of the *next* update, ``wsd_lr(position)``; before any call it
    is ``wsd_lr(0)`` (as ``LambdaLR`` right after construction). ``step(applied)`` is called
    once per optimizer call; with an optimizer attached it writes ``lr`` into every param group.
    """

    def __init__(self, cfg: WSDConfig, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.updates = 0  # successful updates so far
        self.skipped = 0  # optimizer calls that changed nothing
        self._apply()

    @property
    def calls(self) -> int:
        return self.updates + self.skipped

    @property
    def position(self) -> int:
        """The count the schedule is read at."""
        return self.updates

    @property
    def lr(self) -> float:
        return wsd_lr(self.position, self.cfg)

    def step(self, applied: bool) -> float:
        if applied:
            self.updates += 1
        else:
            self.skipped += 1
        self._apply()
        return self.lr

    def _apply(self) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr


class NaiveClock(UpdateClock):
    """The bug: reads the schedule at the number of optimizer *calls*, skipped ones included."""

    @property
    def position(self) -> int:
        return self.calls


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer)`` + ``scaler.update()``; True when ``optimizer.step()`` ran.

    Public API only: the scale shrinks in ``update()`` iff the step found inf/NaN, which is
    iff ``step()`` skipped ``optimizer.step()``. A disabled scaler always steps (scale 1.0).
    """
    if scaler.is_enabled() and not scaler.get_backoff_factor() < 1.0:
        raise ValueError("skip detection needs backoff_factor < 1")
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not scaler.get_scale() < before


# --- cross-check against transformers ----------------------------------------------

def transformers_schedule(cfg: WSDConfig):
    """(dummy optimizer, ``transformers.get_wsd_schedule``) for ``cfg``; step both together."""
    from transformers import get_wsd_schedule

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.base_lr)
    sched = get_wsd_schedule(opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable,
                             decay_type=cfg.decay_type, min_lr_ratio=cfg.min_lr_ratio)
    return opt, sched


def compare_with_transformers(cfg: WSDConfig, past_end: int = 3) -> dict:
    """LR at every update 0 .. total+past_end-1: ours vs ``get_wsd_schedule``, no skips.

    Returns ``ours``, ``theirs`` (lists) and ``max_abs_diff`` (0.0 means bitwise equal).
    """
    opt, sched = transformers_schedule(cfg)
    ours, theirs = [], []
    for k in range(cfg.total + past_end):
        ours.append(wsd_lr(k, cfg))
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: a no-op, but it keeps LambdaLR's ordering check quiet
        sched.step()
    return dict(ours=ours, theirs=theirs, max_abs_diff=max(abs(a - b) for a, b in zip(ours, theirs)))
