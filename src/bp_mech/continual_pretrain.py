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
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bp_mech.accumulation import IGNORE, count_targets, token_loss_sum
from bp_mech.scheduler import UpdateClock, WSDConfig, scaler_step
from bp_mech.bench.workload import PAD_ID, WorkloadError, build_model, load_text, make_adamw, tokenize


@dataclass(frozen=True)
class TrainConfig:
    """One training phase (the general-text pretraining, or the domain run)."""

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
        return WSDConfig(base_lr=self.lr, warmup=self.warmup, stable=self.updates - self.warmup - self.decay,
                         decay=self.decay, decay_type="cosine", min_lr_ratio=self.min_lr_ratio)


def text_sha256(ids: torch.Tensor) -> str:
    """Identity of a token sequence (16 hex digits of the sha256 of its int64 ids)."""
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def split_text(ids: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train part, evaluation part): the last ``eval_fraction`` of the tokens is never trained on."""
    cut = len(ids) - max(2, round(eval_fraction * len(ids)))
    if cut < 2:
        raise ValueError(f"a text of {len(ids)} tokens is too short to split into training and evaluation parts")
    return ids[:cut], ids[cut:]


@dataclass(frozen=True)
class Text:
    source: str  # "shipped:<name>" or the path the reader gave
    ids: torch.Tensor  # (N,) token ids


def load_texts(domain_path=None, holdout_path=None, w=None) -> dict[str, Text]:
    """The general, domain and holdout texts, tokenized for workload ``w``: the shipped ones, or the
    reader's own UTF-8 files for the domain and the holdout text."""
    out = {}
    for name, path in (("general", None), ("domain", domain_path), ("holdout", holdout_path)):
        if path is None:
            out[name] = Text(f"shipped:{name}", tokenize(load_text(name), w))
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise WorkloadError(f"cannot read the {name} text {path}: {e}") from None
        ids = tokenize(text, w)
        if len(ids) < 16:
            raise WorkloadError(f"the {name} text {path} has {len(ids)} tokens; at least 16 are needed")
        out[name] = Text(str(path), ids)
    return out


class TextStream:
    """Full-sequence training batches cut from one token sequence at random offsets.

    Its state is ``generator`` (which draws the offsets) and ``position`` (batches drawn so far).
    Labels equal the inputs: every next token is a target.
    """

    def __init__(self, ids: torch.Tensor, batch: int, seq: int, seed: int, device="cpu") -> None:
        if len(ids) < 2:
            raise ValueError("a training text needs at least 2 tokens")
        self.ids = ids.cpu()  # (N,)
        self.batch, self.seq, self.device = batch, seq, device
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    @property
    def tokens(self) -> int:
        """Tokens of the batches drawn so far."""
        return self.position * self.batch * self.seq

    def next(self) -> dict[str, torch.Tensor]:
        n, T = len(self.ids), self.seq
        text = self.ids if n >= T else self.ids.repeat(T // n + 2)  # a short text wraps around
        starts = torch.randint(0, max(1, n - T + 1) if n >= T else n, (self.batch,), generator=self.generator)
        x = torch.stack([text[s:s + T] for s in starts.tolist()]).to(self.device)  # (B, T)
        self.position += 1
        return {"input_ids": x, "labels": x.clone()}

    def state_dict(self) -> dict:
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.generator.set_state(state["generator"].clone())


def eval_batches(ids: torch.Tensor, seq: int, batch: int) -> list[dict[str, torch.Tensor]]:
    """The whole text once, as non-overlapping windows of ``seq`` tokens, ``batch`` windows per batch.

    The last window is right-padded: PAD_ID inputs with label -100 (not targets). Under a causal mask
    right padding never changes a real token's logits. Returns dicts of (b, seq) ``input_ids``/``labels``.
    """
    windows = math.ceil(len(ids) / seq)
    x = torch.full((windows * seq,), PAD_ID, dtype=torch.long)
    y = torch.full((windows * seq,), IGNORE, dtype=torch.long)
    x[:len(ids)], y[:len(ids)] = ids, ids
    x, y = x.view(windows, seq), y.view(windows, seq)
    return [{"input_ids": x[i:i + batch], "labels": y[i:i + batch]} for i in range(0, windows, batch)]


@torch.no_grad()
def token_loss(model, batches) -> float:
    """Mean next-token cross-entropy per target token over all ``batches`` (nats per token).

    Each batch holds ``input_ids`` and ``labels`` (B, T); label -100 marks a position that is not a
    target. The token losses of all batches are summed, and divided once by the number of targets of
    all batches (float64 accumulation): every token weighs the same, however the batches are filled.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for b in batches:
        labels = b["labels"].to(device)
        logits = model(input_ids=b["input_ids"].to(device)).logits  # (B, T, V)
        total += token_loss_sum(logits, labels).double()
        count += int(count_targets(labels))
        del logits
    model.train(was_training)
    return (total / count).item()


class Trainer:
    """One training loop and its whole state: the model, AdamW, a GradScaler, the update clock
    (Part 02 · 12, counting applied updates) and the data stream."""

    def __init__(self, model, cfg: TrainConfig, data: TextStream, device="cpu") -> None:
        self.model, self.cfg, self.data, self.device = model, cfg, data, device
        self.optimizer = make_adamw(model.parameters(), cfg.lr, device, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=cfg.init_scale,
                                           growth_interval=cfg.growth_interval)
        self.clock = UpdateClock(cfg.schedule, self.optimizer)  # writes the LR of update 0 into AdamW

    def step(self) -> dict:
        """One full training step: zero_grad, forward, token-weighted loss, scaled backward, unscale,
        global-norm clip, AdamW update (skipped by the scaler on inf/NaN), then the clock.

        Returns the loss, whether the update was applied, the LR it used and the gradient norm."""
        batch = self.data.next()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=batch["input_ids"]).logits  # (B, T, V)
        loss = token_loss_sum(logits, batch["labels"]) / count_targets(batch["labels"])
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_norm)
        lr = self.clock.lr
        applied = scaler_step(self.scaler, self.optimizer)
        self.clock.step(applied)
        return dict(update=self.clock.updates, loss=loss.item(), applied=applied, lr=lr, grad_norm=norm.item())


def train(trainer: Trainer, until: int, after_update: Callable[[Trainer], None] | None = None,
          progress=None) -> list[dict]:
    """Steps until the clock counts ``until`` applied updates; ``after_update(trainer)`` after each
    applied one. A run whose updates keep being skipped (non-finite) stops after 2 x ``until`` + 10
    calls. Returns one row per step (``Trainer.step``)."""
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
    """The short general-text pretraining that gives a random-init model something to forget."""
    return train(Trainer(model, cfg, TextStream(ids, batch, seq, cfg.seed, device), device), cfg.updates)


def base_model(w, general: torch.Tensor, cfg: TrainConfig, device="cpu"):
    """The workload's model, pretrained on the general text when it is a random-init one (``config``
    source); a pretrained workload keeps its weights. Returns (model, the pretraining's step rows)."""
    model = build_model(w, device)
    return model, pretrain(model, general, w.batch, w.seq, cfg, device) if w.source == "config" else []


def domain_run(trainer: Trainer, evals: dict[str, list], eval_at, until: int,
               save_at=(), save: Callable[[Trainer], object] | None = None, progress=None) -> dict:
    """Continue ``trainer`` to ``until`` updates; evaluate ``token_loss`` on every set of ``evals``
    at each update of ``eval_at`` it reaches (0 included when the trainer starts there), and call
    ``save(trainer)`` at each update of ``save_at``.

    Returns ``steps`` (``Trainer.step`` rows) and ``evals`` (``[{"update": u, name: loss, ...}]``)."""
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


def resume_difference(main: dict, resumed: dict, clock: dict, final, got) -> dict:
    """A resumed ``domain_run`` against the uninterrupted one, from the saved state's ``clock``
    (``{"updates", "skipped"}``): the losses of the steps after it (relative), the evaluations both made
    (absolute) and the final weights ``got`` against ``final`` (relative; 0.0 everywhere: bit for bit)."""
    calls = clock["updates"] + clock["skipped"]
    a, b = [r["loss"] for r in main["steps"][calls:]], [r["loss"] for r in resumed["steps"]]
    loss_diff = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else math.inf
    ref = {e["update"]: e for e in main["evals"]}
    eval_diff = max((abs(e[k] - ref[e["update"]][k]) for e in resumed["evals"] if e["update"] in ref
                     for k in ("domain", "holdout")), default=0.0)
    weight_diff = max(((g.detach().double() - f.double()).abs().max() / f.double().abs().max().clamp_min(1e-300)).item()
                      for g, f in zip(got, final))
    bitwise = loss_diff == 0.0 and eval_diff == 0.0 and weight_diff == 0.0
    return dict(from_update=clock["updates"], loss_rel_diff=loss_diff, eval_abs_diff=eval_diff,
                weight_rel_diff=weight_diff, bitwise=bitwise, steps=len(b))


def gain_and_drift(evals: list[dict]) -> dict:
    """Domain gain and holdout drift between the first and the last evaluation (nats per token),
    absolute and relative to the first, and the largest holdout drift on the way (and where)."""
    first, last = evals[0], evals[-1]
    gain, drift = first["domain"] - last["domain"], last["holdout"] - first["holdout"]
    peak = max(evals, key=lambda e: e["holdout"])
    return dict(domain_gain=gain, holdout_drift=drift, domain_gain_rel=gain / first["domain"],
                holdout_drift_rel=drift / first["holdout"], updates=last["update"] - first["update"],
                max_holdout_drift=peak["holdout"] - first["holdout"], max_drift_update=peak["update"])
