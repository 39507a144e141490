"""Part 02 · 56's conformance row: the package's saved states against Transformers and Accelerate.

One uninterrupted run of ``UPDATES`` updates on a tiny Qwen2, prepared by Accelerate,
saves its state at ``AT`` three ways: ``training_state.save_training_state``,
``Accelerator.save_state`` (model, optimizer, RNG states, and the GradScaler, the update
clock and the data stream registered with ``register_for_checkpointing``) and
``save_pretrained``. The run trains under ``fp16`` (autocast and an enabled GradScaler, whose scale
grows twice before ``AT``), so the scaler's state is part of what must round-trip; every step is the
book's one training step (``bench.trainer.phase_trainer``). Then

* two fresh trainers (another random init, new AdamW, clock at 0) resume, one through
  ``load_training_state`` and one through ``Accelerator.load_state``; both must continue
  bit for bit where the uninterrupted run went (losses and final weights);
* ``from_pretrained`` must load the same weights from the package's saved state
  directory (it is a Transformers model directory) as from ``save_pretrained``'s, equal
  to the live model's at ``AT``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import torch

from bp_mech import continual_data, continual_pretrain as cpt, training_state
from bp_mech.bench.strategy import parse
from bp_mech.bench.timing import timing_threads
from bp_mech.bench.trainer import Trainer, phase_trainer
from bp_mech.instruments.workload import build_model, load_text, parse_workload, tokenize, workload_fields

UPDATES, AT = 6, 3  # updates of the run, the update whose state is saved
CFG = cpt.TrainConfig(updates=UPDATES, lr=3e-3, warmup=2, decay=2, growth_interval=2)  # the scale grows twice before AT


class ClockState:
    """The update clock as Accelerate's ``register_for_checkpointing`` wants it (``state_dict`` /
    ``load_state_dict``); ``scheduler.UpdateClock`` itself has no such methods."""

    def __init__(self, clock) -> None:
        self.clock = clock

    def state_dict(self) -> dict:
        return training_state.clock_state(self.clock)

    def load_state_dict(self, state: dict) -> None:
        training_state.set_clock_state(self.clock, state)


def _trainer(w, ids, seed: int) -> Trainer:
    return phase_trainer(build_model(w.replace(seed=seed)), CFG, continual_data.TextStream(ids, w.batch, w.seq, CFG.seed),
                         strategy=parse("fp16"))


def _accelerated(trainer):
    """``trainer`` with its model and AdamW prepared by an Accelerator.

    Its scaler, clock and data stream are registered for checkpointing."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    trainer.model, trainer.optimizer = acc.prepare(trainer.model, trainer.optimizer)
    trainer.clock.optimizer = trainer.optimizer
    acc.register_for_checkpointing(trainer.scaler, ClockState(trainer.clock),
                                   trainer.data)
    return acc


@contextlib.contextmanager
def _quiet():
    """Without Transformers' progress bars and Accelerate's notice that the tied lm_head is saved once."""
    from transformers.utils import logging as hf_logging

    bars, log = hf_logging.is_progress_bar_enabled(), logging.getLogger("accelerate")
    level = log.level
    hf_logging.disable_progress_bar()
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def compare() -> dict:
    """Run the three round trips; every entry True means bit for bit."""
    from transformers import Qwen2ForCausalLM

    w = parse_workload("tiny-b2s32")
    ids = tokenize(load_text("domain"))
    wl = workload_fields(w)
    with tempfile.TemporaryDirectory(prefix="bp-mech-56-conf-") as tmp:
        tmp = Path(tmp)
        ref = _trainer(w, ids, 0)
        acc = _accelerated(ref)
        ours, at_save = [], []  # our saved state directory; the live weights at AT

        def save(t):
            ours.append(training_state.save_training_state(t, tmp / "ours", wl, dict(semantic_id="conformance")))
            acc.save_state(str(tmp / "accelerate"))
            t.model.save_pretrained(tmp / "hf")
            at_save.append([p.detach().clone() for p in t.model.parameters()])

        run = cpt.domain_run(ref, {}, (), UPDATES, {AT}, save)
        want = [r["loss"] for r in run["steps"][AT:]]
        final = list(ref.model.parameters())

        ours_t = _trainer(w, ids, 1)
        training_state.load_training_state(ours_t, ours[0], wl)
        ours_losses = [r["loss"] for r in cpt.domain_run(ours_t, {}, (), UPDATES)["steps"]]

        acc_t = _trainer(w, ids, 2)
        _accelerated(acc_t).load_state(str(tmp / "accelerate"))
        acc_losses = [r["loss"] for r in cpt.domain_run(acc_t, {}, (), UPDATES)["steps"]]

        hf = Qwen2ForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
        from_ours = Qwen2ForCausalLM.from_pretrained(ours[0], dtype=torch.float32)
        return dict(
            ours_resume=ours_losses == want and _same(ours_t.model.parameters(), final),
            accelerate_resume=acc_losses == want and _same(acc_t.model.parameters(), final),
            accelerate_equals_ours=acc_losses == ours_losses and _same(acc_t.model.parameters(), ours_t.model.parameters()),
            from_pretrained=_same(hf.parameters(), at_save[0]) and _same(from_ours.parameters(), at_save[0]),
            steps=len(want))


def conformance():
    from bp_mech.records.registry import ConformanceRow

    with _quiet(), timing_threads("cpu"):  # one intra-op thread: the machines are shared
        r = compare()
    passed = all(v for k, v in r.items() if k != "steps")
    detail = (f"resume at update {AT} of {UPDATES}, {r['steps']} steps after it, bit for bit "
              f"(CPU, fp16 autocast + GradScaler): "
              f"load_training_state {r['ours_resume']}, Accelerator.load_state {r['accelerate_resume']}, "
              f"the two equal {r['accelerate_equals_ours']}; from_pretrained of our saved state = save_pretrained's = "
              f"the live weights: {r['from_pretrained']}")
    return ConformanceRow("Part 02 · 56", "TRAIN-CONTINUAL-PRETRAIN",
                          "transformers save_pretrained/from_pretrained + Accelerate save_state/load_state", passed, detail)
