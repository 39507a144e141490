"""Part 02 · 56's base model: a random-init model gets a short general-text pretraining first.

A random-init model has learned nothing, so it has nothing to forget; the tiny workload's model
therefore trains a few updates on the general text (``pretrain``) before the domain run of
``bp_mech.experiments.continual_pretrain``. Both train with the bench's trainer
(``bench.trainer.phase_trainer``: the one training step, ``bench.step.train_step``), stepped by the
mechanism's ``continual_pretrain.train``.
"""

from __future__ import annotations

import torch

from bp_mech.bench.trainer import phase_trainer
from bp_mech.continual_data import TextStream
from bp_mech.continual_pretrain import TrainConfig, train
from bp_mech.instruments.workload import build_model


def pretrain(model, ids: torch.Tensor, batch: int, seq: int, cfg: TrainConfig, device="cpu") -> list:
    """The short general-text pretraining that gives a random-init model something to forget.

    ``cfg.updates`` applied updates of a fresh trainer (``phase_trainer``) on a ``TextStream`` seeded
    with ``cfg.seed``.

    Args:
        model: the model to train in place.
        ids: (N,) token ids of the general text.
        batch: sequences per batch.
        seq: tokens per sequence.
        cfg: the pretraining phase's ``TrainConfig``.
        device: the model's device.

    Returns:
        The step rows (``bench.trainer.Row``).

    Example:
        >>> from bp_mech.instruments.workload import parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> rows = pretrain(model, torch.arange(64), batch=1, seq=8, cfg=TrainConfig(updates=3, warmup=1, decay=1))
        >>> len(rows), rows[-1].update
        (3, 3)
    """
    return train(phase_trainer(model, cfg, TextStream(ids, batch, seq, cfg.seed, device), device), cfg.updates)


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
