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

The loop (``Trainer``) is one full step per update: token-weighted loss (Part 02 · 11's
``token_loss_sum`` / ``count_targets``), backward through a GradScaler, unscale, global-norm clip,
AdamW, and the update clock of Part 02 · 12, which moves only when the scaler applied the update.
In float32 the scaler's power-of-two scale is exact, so it changes no number; the loop is the one
an fp16 run uses, and the scaler's state is part of the training state. Saving and resuming that
state is ``bp_mech.training_state``; the experiment is ``bp_mech.experiments.continual_pretrain``.
The texts and the data stream live in ``bp_mech.continual_data``, the evaluation (``eval_batches``,
``token_loss``, gain, drift) in ``bp_mech.continual_eval``; both are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bp_mech.accumulation import count_targets, token_loss_sum
from bp_mech.scheduler import UpdateClock, WSDConfig, scaler_step
from bp_mech.instruments.workload import build_model
from bp_mech.instruments.adamw import make_adamw
from bp_mech.continual_data import Text, TextStream, load_texts, split_text, text_sha256
from bp_mech.continual_eval import eval_batches, gain_and_drift, resume_difference, token_loss

__all__ = ["TrainConfig", "text_sha256", "split_text", "Text", "load_texts", "TextStream", "eval_batches", "token_loss",
           "Trainer", "train", "pretrain", "base_model", "domain_run", "resume_difference", "gain_and_drift"]


@dataclass(frozen=True)
class TrainConfig:
    """One training phase (the general-text pretraining, or the domain run).

    The learning rate follows a WSD schedule (``schedule``) read at the update clock's count of
    applied updates; a step the GradScaler skips moves neither the schedule nor ``updates``.

    Args:
        updates: effective updates of the phase (a step the scaler skips does not count).
        lr: peak AdamW learning rate: the WSD schedule's stable value.
        warmup: WSD warmup updates (linear, from ``min_lr_ratio * lr``).
        decay: WSD cosine-decay updates at the end; the updates in between are stable.
        min_lr_ratio: the schedule's floor, as a fraction of ``lr``.
        weight_decay: AdamW's decoupled weight decay.
        max_norm: global-norm clipping threshold, applied after unscaling.
        init_scale: the GradScaler's initial loss scale.
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
    init_scale: float = 2.0 ** 12  # the GradScaler's initial loss scale
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


class Trainer:
    """One training loop and its whole state.

    The model, AdamW, a GradScaler, the update clock (Part 02 · 12, counting applied updates) and
    the data stream. The clock writes the LR of update 0 into AdamW at construction.

    Args:
        model: the causal LM to train (in place); its output has ``.logits`` (B, T, V).
        cfg: the phase's ``TrainConfig`` (LR schedule, clipping, weight decay, scaler).
        data: the ``TextStream`` the batches come from.
        device: the model's device; AdamW is fused on CUDA, foreach elsewhere.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = Trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(), TextStream(torch.arange(64), 1, 8, 0))
        >>> t.clock.updates, round(t.optimizer.param_groups[0]["lr"], 4)  # warmup starts at 0.1 x lr
        (0, 0.0001)
    """

    def __init__(self, model, cfg: TrainConfig, data: TextStream, device="cpu") -> None:
        self.model, self.cfg, self.data, self.device = model, cfg, data, device
        self.optimizer = make_adamw(model.parameters(), cfg.lr, device, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=cfg.init_scale,
                                           growth_interval=cfg.growth_interval)
        self.clock = UpdateClock(cfg.schedule, self.optimizer)  # writes the LR of update 0 into AdamW

    def step(self) -> dict:
        """One full training step on the next batch of the data stream, then the clock.

        zero_grad, forward, token-weighted loss, scaled backward, unscale, global-norm
        clip, AdamW update (skipped by the scaler on inf/NaN), then the clock.

        Returns:
            The loss, whether the update was applied, the LR it used and the gradient
            norm: ``{"update": the clock's applied updates after the step, "loss": the
            batch's mean token loss (float), "applied": bool, "lr": float, "grad_norm":
            the global norm before clipping}``.

        Example:
            >>> from bp_mech.instruments.workload import build_model, parse_workload
            >>> model = build_model(parse_workload("tiny-b1s8"))
            >>> data = TextStream(torch.arange(64), batch=1, seq=8, seed=0)
            >>> t = Trainer(model, TrainConfig(), data)
            >>> row = t.step()
            >>> sorted(row), row["update"], row["applied"]
            (['applied', 'grad_norm', 'loss', 'lr', 'update'], 1, True)
        """
        batch = self.data.next()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=batch["input_ids"]).logits  # (B, T, V)
        loss = token_loss_sum(logits, batch["labels"]) / count_targets(batch["labels"])
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.cfg.max_norm)
        lr = self.clock.lr
        applied = scaler_step(self.scaler, self.optimizer)
        self.clock.step(applied)
        return dict(update=self.clock.updates, loss=loss.item(), applied=applied, lr=lr,
                    grad_norm=norm.item())


def train(trainer: Trainer, until: int, after_update: Callable[[Trainer], None] | None = None,
          progress=None) -> list[dict]:
    """Steps until the clock counts ``until`` applied updates; ``after_update(trainer)`` after each applied one.

    A run whose updates keep being skipped (non-finite) stops after 2 x ``until`` + 10 calls.

    Args:
        trainer: the ``Trainer`` to step, from wherever its clock stands.
        until: the clock's count of applied updates to reach (a total, not a number of further updates).
        after_update: called as ``after_update(trainer)`` after each applied update; None: nothing.
        progress: a tqdm-like ``progress(iterable, desc=...)``, advanced per applied update; None: no bar.

    Returns:
        One row per step (``Trainer.step``), skipped steps included.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = Trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(), TextStream(torch.arange(64), 1, 8, 0))
        >>> [row["update"] for row in train(t, 3)], t.clock.updates
        ([1, 2, 3], 3)
    """
    rows, limit = [], 2 * until + 10
    ticks = iter(progress(range(until - trainer.clock.updates), desc="updates")) if progress else None
    while trainer.clock.updates < until and trainer.clock.calls < limit:
        row = trainer.step()
        rows.append(row)
        if row["applied"]:
            if ticks is not None:
                next(ticks, None)  # the progress bar advances per applied update
            if after_update is not None:
                after_update(trainer)
    if ticks is not None:
        next(ticks, None)  # a tqdm bar closes when its iterable is exhausted
    return rows


def pretrain(model, ids: torch.Tensor, batch: int, seq: int, cfg: TrainConfig, device="cpu") -> list[dict]:
    """The short general-text pretraining that gives a random-init model something to forget.

    ``cfg.updates`` applied updates of a fresh ``Trainer`` on a ``TextStream`` seeded with ``cfg.seed``.

    Args:
        model: the model to train in place.
        ids: (N,) token ids of the general text.
        batch: sequences per batch.
        seq: tokens per sequence.
        cfg: the pretraining phase's ``TrainConfig``.
        device: the model's device.

    Returns:
        The step rows (``Trainer.step``).

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> rows = pretrain(model, torch.arange(64), batch=1, seq=8, cfg=TrainConfig(updates=3, warmup=1, decay=1))
        >>> len(rows), rows[-1]["update"]
        (3, 3)
    """
    return train(Trainer(model, cfg, TextStream(ids, batch, seq, cfg.seed, device), device), cfg.updates)


def base_model(w, general: torch.Tensor, cfg: TrainConfig, device="cpu"):
    """The workload's model, pretrained on the general text when it is a random-init one.

    A random-init model (``config`` source) gets ``pretrain``; a pretrained workload keeps its weights.

    Args:
        w: the ``instruments.workload.Workload`` (architecture, batch, seq, source, seed).
        general: (N,) token ids of the general text.
        cfg: the pretraining phase's ``TrainConfig``.
        device: where to build the model.

    Returns:
        (model, the pretraining's step rows); the rows are empty for a pretrained workload.

    Example:
        >>> from bp_mech.instruments.workload import parse_workload
        >>> cfg = TrainConfig(updates=2, warmup=1, decay=1)
        >>> model, rows = base_model(parse_workload("tiny-b1s8"), torch.arange(64), cfg)
        >>> len(rows), model.training
        (2, True)
    """
    model = build_model(w, device)
    return model, pretrain(model, general, w.batch, w.seq, cfg, device) if w.source == "config" else []


def domain_run(trainer: Trainer, evals: dict[str, list], eval_at, until: int,
               save_at=(), save: Callable[[Trainer], object] | None = None, progress=None) -> dict:
    """Continue ``trainer`` to ``until`` updates, evaluating and saving on the way.

    Evaluate ``token_loss`` on every set of ``evals`` at each update of ``eval_at`` it reaches (0
    included when the trainer starts there), and call ``save(trainer)`` at each update of ``save_at``.

    Args:
        trainer: the ``Trainer`` to continue.
        evals: evaluation set name -> its batches (``eval_batches``).
        eval_at: the updates (clock counts) to evaluate at; a set or any container.
        until: the clock's count of applied updates to reach.
        save_at: the updates to call ``save`` at.
        save: called as ``save(trainer)``, e.g. ``lambda t: save_training_state(t, root, ...)``; None: none.
        progress: a tqdm-like progress callable, as in ``train``; None: no bar.

    Returns:
        ``steps`` (``Trainer.step`` rows) and ``evals`` (``[{"update": u, name: loss, ...}]``).

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> t = Trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(), TextStream(torch.arange(64), 1, 8, 0))
        >>> run = domain_run(t, {"domain": eval_batches(torch.arange(64), 8, 4)}, eval_at={0, 2}, until=3)
        >>> len(run["steps"]), [e["update"] for e in run["evals"]], sorted(run["evals"][0])
        (3, [0, 2], ['domain', 'update'])
    """
    points = []

    def evaluate(t: Trainer) -> None:
        points.append(dict(update=t.clock.updates, **{n: token_loss(t.model, b) for n, b in evals.items()}))

    def after(t: Trainer) -> None:
        if t.clock.updates in eval_at:
            evaluate(t)
        if save is not None and t.clock.updates in save_at:
            save(t)

    if trainer.clock.updates in eval_at:
        evaluate(trainer)
    steps = train(trainer, until, after, progress)
    return dict(steps=steps, evals=points)
