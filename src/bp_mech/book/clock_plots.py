"""The figures of the learning-rate clock: the learning rate and the training loss through the
phases of a warmup-stable-decay schedule, in Part 02 · 12 (the scheduler clock) and 56
(continual pretraining).

``wsd_phases`` names the phases of a ``scheduler.WSDConfig`` in updates; ``train_through_wsd``
trains a workload's model on the book's general text with chapter 56's trainer
(``bench.trainer.phase_trainer``: the one training step, chapter 12's update clock) and returns one
row per step; ``plot_wsd_run`` draws rows like those (or
the step rows a continual-pretraining record holds) with the phases shaded.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from bp_mech.bench.trainer import phase_trainer
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.continual_data import TextStream, load_texts
from bp_mech.continual_pretrain import TrainConfig, train
from bp_mech.scheduler import WSDConfig

PHASE_COLOURS = {"warmup": "tab:orange", "stable": "tab:green", "decay": "tab:purple"}


def wsd_phases(cfg: WSDConfig) -> list[tuple[str, int, int]]:
    """The non-empty phases of a WSD schedule as ``(name, first update, end)``.

    Update k (counted from 0) is in a phase when ``first <= k < end``; past the last
    ``end`` the rate stays at the floor.

    Args:
        cfg: the schedule.
    Returns:
        ``[("warmup", 0, W), ("stable", W, W + S), ("decay", W + S, W + S + D)]`` without
        the phases of length zero.
    Example:
        >>> wsd_phases(WSDConfig(warmup=2, stable=0, decay=3))
        [('warmup', 0, 2), ('decay', 2, 5)]
    """
    w, s, d = cfg.warmup, cfg.stable, cfg.decay
    phases = [("warmup", 0, w), ("stable", w, w + s), ("decay", w + s, w + s + d)]
    return [p for p in phases if p[2] > p[1]]


def train_through_wsd(workload_id: str, cfg: WSDConfig, seed: int = 0) -> list[dict]:
    """Train ``workload_id``'s model on the book's general text through one WSD schedule.

    Chapter 56's trainer (``bench.trainer.phase_trainer``: AdamW, global-norm clip, chapter 12's
    update clock, plain float32) runs until the clock has counted ``cfg.total`` applied updates.

    Args:
        workload_id: e.g. ``"tiny-b2s64"``: model, batch and sequence length.
        cfg: the schedule; its decay must be cosine (the ``TrainConfig``'s).
        seed: seed of the data stream (which windows of the text each batch holds).
    Returns:
        One row per step, as a dict (``bench.trainer.Row``'s fields: ``update``, ``loss``,
        ``applied``, ``lr``, ``grad_norm``, ...), as a record keeps it.
    Example:
        >>> rows = train_through_wsd("tiny-b1s8", WSDConfig(warmup=1, stable=1, decay=1,
        ...                          decay_type="cosine"))
        >>> [r["update"] for r in rows], rows[1]["lr"]
        ([1, 2, 3], 0.001)
    """
    if cfg.decay_type != "cosine":
        raise ValueError(f"the trainer's TrainConfig decays by cosine, not {cfg.decay_type!r}")
    w = parse_workload(workload_id)
    phase = TrainConfig(updates=cfg.total, lr=cfg.base_lr, warmup=cfg.warmup, decay=cfg.decay,
                        min_lr_ratio=cfg.min_lr_ratio, seed=seed)
    ids = load_texts(w=w)["general"].ids
    trainer = phase_trainer(build_model(w), phase, TextStream(ids, w.batch, w.seq, seed))
    return [dataclasses.asdict(r) for r in train(trainer, cfg.total)]


def plot_wsd_run(rows: list[dict], cfg: WSDConfig, title: str, evals: list[dict] | None = None):
    """Learning rate (top) and loss (bottom) per applied update, the WSD phases shaded.

    Args:
        rows: one per step, with ``update`` (applied updates after it), ``lr`` (the rate it
            used), ``loss`` and ``applied``; skipped steps are left out.
        cfg: the schedule the rows ran under (for the phases).
        title: the figure's title.
        evals: optional ``{"update", "domain", "holdout"}`` evaluation losses to draw as
            markers on the loss panel (update 0: before training).
    Returns:
        The matplotlib figure.
    """
    fig, (ax_lr, ax_loss) = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True,
                                         constrained_layout=True)
    done = [r for r in rows if r["applied"]]
    k = [r["update"] - 1 for r in done]  # the index of the update each row applied
    for ax in (ax_lr, ax_loss):
        ax.grid(True, alpha=0.3)
        for name, start, end in wsd_phases(cfg):
            ax.axvspan(start - 0.5, end - 0.5, color=PHASE_COLOURS[name], alpha=0.12, lw=0)
    for name, start, end in wsd_phases(cfg):
        ax_lr.text((start + end - 1) / 2, cfg.base_lr * 1.04, name, ha="center", va="bottom",
                   fontsize=8, color=PHASE_COLOURS[name])
    ax_lr.plot(k, [r["lr"] for r in done], ".-", color="tab:blue")
    ax_lr.set_ylim(0, cfg.base_lr * 1.18)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title(title)
    ax_loss.plot(k, [r["loss"] for r in done], ".-", color="tab:red", label="training batch")
    for name, marker in (("domain", "o"), ("holdout", "s")):
        if evals:
            ax_loss.plot([e["update"] - 0.5 for e in evals], [e[name] for e in evals], marker,
                         mfc="none", ms=6, label=f"{name} evaluation")
    ax_loss.set_xlabel("update k (applied updates before it)")
    ax_loss.set_ylabel("loss (nats per token)")
    ax_loss.legend(fontsize=8)
    return fig
