"""Part 02 · 56 — continual pretraining: domain gain against holdout drift, measured per token.

A base model is trained further on a *domain* text. Two numbers say what that did, both measured
as the mean next-token loss per target token (``token_loss``; positions whose label is -100 are not
targets and are excluded from the sum and from the count)::

    L(D) = sum_{(b,t): y[b,t+1] != -100} -log p(y[b,t+1] | x[b,<=t])  /  #{(b,t): y[b,t+1] != -100}

    domain gain   G = L_domain(0) - L_domain(N)      (> 0: the run learned the domain)
    holdout drift Δ = L_holdout(N) - L_holdout(0)    (> 0: it forgot some of the general text)

with 0 the base (the 0-update baseline) and N the number of domain updates. The evaluation texts
are cut into non-overlapping windows of T tokens (``eval_batches``), the last one right-padded with
label -100, so every token of the text is counted once, whatever the window count.

A random-init model has nothing to forget, so the tiny model first gets a short deterministic
"pretraining" on the general text (``pretrain``); a pretrained workload starts from its weights.

The loop is the book's one training step, run by ``bench.trainer.Trainer`` (built for a phase by
``bench.trainer.phase_trainer``, which sits above the mechanisms; this module only steps it: ``train``
and ``domain_run`` call ``trainer.step()`` and read ``trainer.clock``). One full step per update: the
model's token-weighted mean loss, backward, unscale and global-norm clip (Part 02 · 55), AdamW, and
the update clock of Part 02 · 12, which moves only when the update was applied. The chapter's runs are
plain float32: the step's GradScaler (``bench.strategy.Entered``) is enabled only under fp16, so here it
is disabled, skips nothing and its state, still saved, is empty (an fp16 run's scaler state is part of
the training state the same way). Saving and resuming that state is ``bp_mech.training_state``; the
base model and its pretraining are ``bp_mech.experiments.continual_base``; the experiment is
``bp_mech.experiments.continual_pretrain``.
The texts and the data stream live in ``bp_mech.continual_data``, the evaluation (``eval_batches``,
``token_loss``, gain, drift) in ``bp_mech.continual_eval``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from bp_mech.continual_eval import token_loss
from bp_mech.scheduler import WSDConfig



@dataclass(frozen=True)
class TrainConfig:
    """One training phase (the general-text pretraining, or the domain run).

    The learning rate follows a WSD schedule (``schedule``) read at the update clock's count of
    applied updates; a step the GradScaler skips (fp16 only: a float32 run's scaler is disabled)
    moves neither the schedule nor ``updates``.

    Args:
        updates: effective updates of the phase (a step the scaler skips does not count).
        lr: peak AdamW learning rate: the WSD schedule's stable value.
        warmup: WSD warmup updates (linear, from ``min_lr_ratio * lr``).
        decay: WSD cosine-decay updates at the end; the updates in between are stable.
        min_lr_ratio: the schedule's floor, as a fraction of ``lr``.
        weight_decay: AdamW's decoupled weight decay.
        max_norm: global-norm clipping threshold, applied after unscaling.
        init_scale: the GradScaler's initial loss scale (fp16; float32 runs have none).
        growth_interval: applied updates before the scaler doubles its scale.
        seed: seed of the data stream's generator (which windows the batches hold).

    Example:
        >>> cfg = TrainConfig(updates=10, warmup=2, decay=4)
        >>> cfg.lr, cfg.schedule.stable
        (0.001, 4)
    """

    updates: int = 40  # effective updates of the phase (a step the scaler skips does not count)
    lr: float = 1e-3  # peak AdamW learning rate: the WSD schedule's stable value
    warmup: int = 4  # WSD warmup updates (linear, from min_lr_ratio * lr)
    decay: int = 12  # WSD cosine-decay updates at the end; the updates in between are stable
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    max_norm: float = 1.0  # global-norm clipping threshold, applied after unscaling
    init_scale: float = 2.0 ** 12  # the GradScaler's initial loss scale (fp16; float32 runs have none)
    growth_interval: int = 10  # applied updates before the scaler doubles its scale
    seed: int = 0  # seed of the data stream's generator (which windows the batches hold)

    @property
    def schedule(self) -> WSDConfig:
        """The phase's WSD schedule: ``warmup``, ``updates - warmup - decay`` stable, cosine ``decay``.

        Returns:
            A ``scheduler.WSDConfig`` with base LR ``lr`` and floor ``min_lr_ratio * lr``.

        Example:
            >>> s = TrainConfig(updates=40, warmup=4, decay=12).schedule
            >>> s.warmup, s.stable, s.decay, s.decay_type
            (4, 24, 12, 'cosine')
        """
        return WSDConfig(base_lr=self.lr, warmup=self.warmup, stable=self.updates - self.warmup - self.decay,
                         decay=self.decay, decay_type="cosine", min_lr_ratio=self.min_lr_ratio)


def train(trainer, until: int, after_update: Callable[[object], None] | None = None,
          progress=None) -> list:
    """Steps until the clock counts ``until`` applied updates; ``after_update(trainer)`` after each applied one.

    A run whose updates keep being skipped (non-finite) stops after 2 x ``until`` + 10 calls.

    Args:
        trainer: the trainer to step (``bench.trainer.Trainer``: ``step()`` draws its next batch, ``clock``
            counts applied updates), from wherever its clock stands.
        until: the clock's count of applied updates to reach (a total, not a number of further updates).
        after_update: called as ``after_update(trainer)`` after each applied update; None: nothing.
        progress: a tqdm-like ``progress(iterable, desc=...)``, advanced per applied update; None: no bar.

    Returns:
        One row per step (``bench.trainer.Row``: ``update``, ``loss``, ``applied``, ``lr``, ``grad_norm``,
        ...), skipped steps included.

    Example:
        >>> import torch
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> [row.update for row in train(t, 3)], t.clock.updates
        ([1, 2, 3], 3)
    """
    rows, limit = [], 2 * until + 10
    ticks = iter(progress(range(until - trainer.clock.updates), desc="updates")) if progress else None
    while trainer.clock.updates < until and trainer.clock.calls < limit:
        row = trainer.step()
        rows.append(row)
        if row.applied:
            if ticks is not None:
                next(ticks, None)  # the progress bar advances per applied update
            if after_update is not None:
                after_update(trainer)
    if ticks is not None:
        next(ticks, None)  # a tqdm bar closes when its iterable is exhausted
    return rows


def domain_run(trainer, evals: dict[str, list], eval_at, until: int,
               save_at=(), save: Callable[[object], object] | None = None, progress=None) -> dict:
    """Continue ``trainer`` to ``until`` updates, evaluating and saving on the way.

    Evaluate ``token_loss`` on every set of ``evals`` at each update of ``eval_at`` it reaches (0
    included when the trainer starts there), and call ``save(trainer)`` at each update of ``save_at``.

    Args:
        trainer: the trainer to continue (as ``train`` steps it).
        evals: evaluation set name -> its batches (``eval_batches``).
        eval_at: the updates (clock counts) to evaluate at; a set or any container.
        until: the clock's count of applied updates to reach.
        save_at: the updates to call ``save`` at.
        save: called as ``save(trainer)``, e.g. ``lambda t: save_training_state(t, root, ...)``; None: none.
        progress: a tqdm-like progress callable, as in ``train``; None: no bar.

    Returns:
        ``steps`` (each step's row as a dict, ``dataclasses.asdict``: JSON-able, as a record keeps it)
        and ``evals`` (``[{"update": u, name: loss, ...}]``).

    Example:
        >>> import torch
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_eval import eval_batches
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> run = domain_run(t, {"domain": eval_batches(torch.arange(64), 8, 4)}, eval_at={0, 2}, until=3)
        >>> len(run["steps"]), [e["update"] for e in run["evals"]], sorted(run["evals"][0])
        (3, [0, 2], ['domain', 'update'])
    """
    points = []

    def evaluate(t) -> None:
        points.append(dict(update=t.clock.updates, **{n: token_loss(t.model, b) for n, b in evals.items()}))

    def after(t) -> None:
        if t.clock.updates in eval_at:
            evaluate(t)
        if save is not None and t.clock.updates in save_at:
            save(t)

    if trainer.clock.updates in eval_at:
        evaluate(trainer)
    steps = train(trainer, until, after, progress)
    return dict(steps=[dataclasses.asdict(r) for r in steps], evals=points)
