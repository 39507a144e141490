"""A training loop's state around the one training step: model, optimizer, strategy, LR clock, clipping.

``Trainer`` holds what a loop keeps from one update to the next — the model, its optimizer, the memory
strategy entered once on the model (an ``Entered``: the offload's host pool, fp16's GradScaler; the
step-level switches, checkpointing and the chunked loss, are entered around each step as
``bench.strategy.configured`` does), the update clock of Part 02 · 12 (``scheduler.UpdateClock``), the
clip threshold and, for a loop that draws its own batches, a data stream — and its ``step`` is
``bench.step.train_step``, nothing else. Each step gives a ``Row``, the line a training log shows.

The loops of the package run on it: AMP's overflow sample (``experiments.amp_overflow``), Part 02 · 12's
clock run (``experiments.scheduler``) and Part 02 · 56's continual pretraining (``phase_trainer``;
``continual_pretrain.train`` and ``domain_run`` step it, ``training_state`` saves and restores it).

An overflow is injected where it happens: ``loss_times(model, factor)`` multiplies the model's loss (a
forward hook), so the step's backward starts from a loss that overflowed; ``train_step`` needs no
argument for it. A step the loop decides to skip is simply not run (tell the clock:
``trainer.clock.step(False)``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from bp_mech.bench.step import Observer, train_step
from bp_mech.bench.strategy import PLAIN, Entered, Strategy, configured
from bp_mech.instruments.adamw import make_adamw
from bp_mech.scheduler import UpdateClock, WSDConfig
from bp_mech.update_dynamics import clip_coefficient


@dataclass(frozen=True)
class Row:
    """One step of a ``Trainer``: what a training log shows of it."""

    update: int | None  # the clock's applied updates after the step (None: no clock)
    loss: float  # the batch's mean token loss (micro-batches: their token-weighted shares summed)
    applied: bool  # the optimizer applied the update (False: the fp16 scaler skipped it)
    finite: bool  # every gradient finite: the total norm is (without clipping: the loss is)
    grad_norm: float | None  # the total gradient norm before clipping, unscaled (None: no clipping)
    clip_coef: float | None  # min(1, max_norm / (grad_norm + 1e-6)) (None: no clipping, or a non-finite norm)
    scale: float | None  # fp16: the loss scale this step's backward used (None: no enabled scaler)
    lr: float | None  # the learning rate of the update: the clock's before the step (None: no clock)


class Trainer:
    """A training loop's state; ``step`` is one ``bench.step.train_step``.

    Args:
        model: a causal LM (``model(**batch).loss`` is its mean token loss).
        optimizer: its optimizer (``build`` makes the package's AdamW).
        strategy: the memory strategy (``bench.strategy.Strategy``), entered once on
            ``model``; default plain.
        clock: the LR clock every optimizer call steps (None: the LR stays).
        max_norm: clip the total gradient norm to it, after unscaling (None: no clipping).
        scaler: fp16's GradScaler (None: torch's defaults; disabled for every other
            strategy, whose steps it passes through).
        data: a stream whose ``next()`` gives the next batch, for ``step()`` without one.
        cfg: the configuration the loop was built from (kept for a saved state's identity).
        device: where the model lives (None: its parameters' device).
        observers: ``train_step``'s phase observers, around every step.

    Example:
        >>> from bp_mech.instruments.workload import build_model, make_batches, parse_workload
        >>> w = parse_workload("tiny-b1s8")
        >>> t = Trainer.build(build_model(w), WSDConfig(base_lr=1.0, warmup=2), max_norm=1.0)
        >>> rows = [t.step(b) for b in make_batches(w, 2)]
        >>> [(r.update, r.applied, r.lr, r.scale) for r in rows]  # warmup: 0, then 1/2 of the peak
        [(1, True, 0.0, None), (2, True, 0.5, None)]
    """

    def __init__(self, model, optimizer, strategy: Strategy = PLAIN, *, clock: UpdateClock | None = None,
                 max_norm: float | None = None, scaler: torch.amp.GradScaler | None = None, data=None,
                 cfg=None, device=None, observers: Sequence[Observer] = ()) -> None:
        self.device = torch.device(device if device is not None else next(model.parameters()).device)
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.clock, self.max_norm, self.data, self.cfg = clock, max_norm, data, cfg
        self.observers = tuple(observers)
        self.entered = Entered(model, strategy, self.device, scaler=scaler)  # one scaler, one host pool

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The strategy's GradScaler (enabled under fp16 only; a disabled one's ``state_dict()`` is {})."""
        return self.entered.scaler

    @classmethod
    def build(cls, model, schedule: WSDConfig, strategy: Strategy = PLAIN, *, device=None,
              max_norm: float | None = None, weight_decay: float | None = None, init_scale: float = 2.0**16,
              growth_interval: int = 2000, **kw) -> "Trainer":
        """A trainer with the package's AdamW, an update clock on ``schedule`` and, under fp16, a GradScaler.

        Args:
            model: the model to train, on ``device``.
            schedule: the WSD schedule the clock reads; its ``base_lr`` is AdamW's.
            strategy: the memory strategy.
            device: where the model lives (None: its parameters' device); AdamW is fused
                on CUDA, foreach elsewhere (``instruments.adamw.make_adamw``).
            max_norm: the clip threshold (None: no clipping).
            weight_decay: AdamW's decoupled weight decay (None: AdamW's default).
            init_scale: the GradScaler's first scale (fp16).
            growth_interval: the GradScaler's finite steps before a growth (fp16).
            **kw: the constructor's ``data``, ``cfg``, ``observers``.

        Returns:
            The ``Trainer``; its clock has written the LR of update 0 into AdamW.

        Example:
            >>> from bp_mech.bench.strategy import parse
            >>> from bp_mech.instruments.workload import build_model, parse_workload
            >>> t = Trainer.build(build_model(parse_workload("tiny-b1s8")), WSDConfig(), parse("fp16"),
            ...                   init_scale=2.0**10)
            >>> t.scaler.is_enabled(), t.scaler.get_scale(), t.clock.updates
            (True, 1024.0, 0)
        """
        device = torch.device(device if device is not None else next(model.parameters()).device)
        decay = {} if weight_decay is None else dict(weight_decay=weight_decay)
        opt = make_adamw(model.parameters(), schedule.base_lr, device, **decay)
        scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval,
                                      enabled=strategy.low is torch.float16)
        return cls(model, opt, strategy, clock=UpdateClock(schedule, opt), max_norm=max_norm, scaler=scaler,
                   device=device, **kw)

    def step(self, batch: dict | None = None) -> Row:
        """One ``train_step`` on ``batch``; the clock is stepped by it.

        Args:
            batch: ``input_ids`` and ``labels`` (B, T); None: the data stream's
                ``next()``.

        Returns:
            The step's ``Row``.

        Raises:
            ValueError: no batch and no data stream.

        Example:
            >>> from bp_mech.instruments.workload import (build_model,
            ...     make_batches, parse_workload)
            >>> w = parse_workload("tiny-b1s8")
            >>> t = Trainer.build(build_model(w), WSDConfig(), max_norm=1e-9)
            >>> r = t.step(make_batches(w, 1)[0])  # clipped: the norm is > 1e-9
            >>> r.finite, r.grad_norm > 1.0, r.clip_coef < 1e-9
            (True, True, True)
        """
        if batch is None:
            if self.data is None:
                raise ValueError("step() without a batch needs a data stream")
            batch = self.data.next()
        lr = self.clock.lr if self.clock is not None else None
        with configured(self.model, self.strategy):
            r = train_step(self.model, self.optimizer, batch, self.strategy,
                           entered=self.entered, observers=self.observers,
                           max_norm=self.max_norm, clock=self.clock)
        loss = r.loss.item()
        norm = None if r.grad_norm is None else r.grad_norm.item()
        # the fp32 norm is finite iff every gradient is
        finite = math.isfinite(loss if norm is None else norm)
        coef = None
        if norm is not None and finite:
            t = torch.tensor(norm, dtype=torch.float64)
            coef = float(clip_coefficient(t, self.max_norm))
        update = self.clock.updates if self.clock is not None else None
        return Row(update, loss, r.applied, finite, norm, coef, r.scale, lr)


def phase_trainer(model, cfg, data=None, device=None, strategy: Strategy = PLAIN) -> Trainer:
    """Part 02 · 56's trainer of one phase (``continual_pretrain.TrainConfig``).

    AdamW at the phase's LR and weight decay, the clock on its WSD schedule, clipping at
    its ``max_norm``; under fp16, a GradScaler with its ``init_scale`` and
    ``growth_interval``. The chapter's runs are plain float32: their GradScaler is
    disabled, so it skips nothing and its state is empty.

    Args:
        model: the causal LM to train in place.
        cfg: the phase's ``TrainConfig`` (kept as ``trainer.cfg``: the saved state's
            identity).
        data: the ``TextStream`` the batches come from.
        device: the model's device (None: its parameters').
        strategy: the memory strategy (default plain; fp16 enables the scaler).

    Returns:
        The ``Trainer``.

    Example:
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> t.clock.updates, round(t.optimizer.param_groups[0]["lr"], 4), t.scaler.state_dict()
        (0, 0.0001, {})
    """
    return Trainer.build(model, cfg.schedule, strategy, device=device, max_norm=cfg.max_norm,
                         weight_decay=cfg.weight_decay, init_scale=cfg.init_scale,
                         growth_interval=cfg.growth_interval, data=data, cfg=cfg)


def loss_times(model, factor: float):
    """While open, the model's loss comes out multiplied by ``factor``: an injected overflow.

    A forward hook on ``model`` scales the ``loss`` of its output, so a step's backward
    starts from the multiplied loss, as it would from one that overflowed.

    Args:
        model: a model whose output has a ``loss`` (a Transformers ``ModelOutput``).
        factor: the multiplier; 1.0 installs nothing.

    Returns:
        A context manager.

    Example:
        >>> from bp_mech.instruments.workload import build_model, make_batches, parse_workload
        >>> w = parse_workload("tiny-b1s8"); model, b = build_model(w), make_batches(w, 1)[0]
        >>> with torch.no_grad(), loss_times(model, 2.0):
        ...     doubled = model(**b).loss
        >>> with torch.no_grad():
        ...     bool(torch.equal(doubled, 2 * model(**b).loss))
        True
    """
    if factor == 1.0:
        return contextlib.nullcontext()
    return _hooked(model, factor)


@contextlib.contextmanager
def _hooked(model, factor: float):
    def hook(module, args, out):
        if out.get("loss") is not None:
            out["loss"] = out["loss"] * factor  # a ModelOutput: the key and the attribute
        return out

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
