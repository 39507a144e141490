"""``bench.trainer``: a loop's state around the one training step. Its rows against what the step did (the
clock, the scaler, clipping), an overflow injected by the loss hook, strategies entered on the model, the
data stream, Part 02 · 56's phase trainer."""

import contextlib
import math

import pytest
import torch

from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import parse
from bp_mech.bench.trainer import Trainer, loss_times, phase_trainer
from bp_mech.continual_data import TextStream
from bp_mech.continual_pretrain import TrainConfig
from bp_mech.instruments.workload import build_model, make_batches, parse_workload
from bp_mech.scheduler import WSDConfig, wsd_lr
from bp_mech.update_dynamics import clip_coefficient

W = parse_workload("tiny-b2s16")
SCHEDULE = WSDConfig(base_lr=1e-3, warmup=2, stable=2, decay=2, min_lr_ratio=0.1)


@pytest.fixture(scope="module")
def batches():
    return make_batches(W, 4)


def test_rows_say_what_the_step_did(batches):
    t = Trainer.build(build_model(W), SCHEDULE, max_norm=0.5)
    rows = [t.step(b) for b in batches]
    assert [r.update for r in rows] == [1, 2, 3, 4] and all(r.applied and r.finite for r in rows)
    assert [r.lr for r in rows] == [wsd_lr(k, SCHEDULE) for k in range(4)]  # the rate each update used
    assert t.optimizer.param_groups[0]["lr"] == wsd_lr(4, SCHEDULE)  # the next update's, written by the clock
    for r in rows:  # float64 coefficient of the reported norm, as Part 02 · 55 defines it
        assert r.clip_coef == float(clip_coefficient(torch.tensor(r.grad_norm, dtype=torch.float64), 0.5))
        assert r.scale is None and math.isfinite(r.loss)
    assert not t.scaler.is_enabled() and t.scaler.state_dict() == {}  # plain float32: a disabled scaler


def test_the_row_loss_and_the_update_are_train_steps(batches):
    """The same weights, the same batch: the trainer's step is train_step's, bit for bit."""
    a, b = build_model(W), build_model(W)
    t = Trainer.build(a, SCHEDULE, max_norm=1.0)
    row = t.step(batches[0])
    opt = torch.optim.AdamW(b.parameters(), lr=SCHEDULE.base_lr, foreach=True)
    opt.param_groups[0]["lr"] = wsd_lr(0, SCHEDULE)
    r = train_step(b, opt, batches[0], max_norm=1.0)
    assert row.loss == r.loss.item() and row.grad_norm == r.grad_norm.item()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_an_injected_overflow_is_skipped_and_holds_the_clock(batches):
    t = Trainer.build(build_model(W), SCHEDULE, parse("fp16"), max_norm=1.0, init_scale=2.0**10)
    t.step(batches[0])
    before = [p.detach().clone() for p in t.model.parameters()]
    lr = t.optimizer.param_groups[0]["lr"]
    with loss_times(t.model, math.inf):
        row = t.step(batches[1])
    assert not row.applied and not row.finite and row.clip_coef is None and row.scale == 2.0**10
    assert (row.update, t.clock.skipped, t.scaler.get_scale()) == (1, 1, 2.0**9)  # held; backed off
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    assert t.optimizer.param_groups[0]["lr"] == lr
    after = t.step(batches[2])  # the hook is gone: the next step applies at the halved scale
    assert after.applied and after.scale == 2.0**9 and after.update == 2


def test_loss_times_scales_the_loss_and_leaves_no_hook(batches):
    model = build_model(W)
    with torch.no_grad():
        plain = model(**batches[0]).loss
        with loss_times(model, 3.0):
            tripled = model(**batches[0]).loss
        again = model(**batches[0]).loss
    assert torch.equal(tripled, plain * 3.0) and torch.equal(again, plain)
    assert not model._forward_hooks and isinstance(loss_times(model, 1.0), contextlib.nullcontext)


def test_strategies_enter_per_step_and_leave_the_model_as_it_was(batches):
    """micro2 gives the full batch's loss (token-weighted); checkpointing is undone between steps."""
    full = Trainer.build(build_model(W), SCHEDULE).step(batches[0])
    model, seen = build_model(W), []

    def watch(phase, state):  # an observer: is checkpointing on while the forward runs?
        seen.append((phase, state.micro, state.model.is_gradient_checkpointing))
        return contextlib.nullcontext()

    t = Trainer.build(model, SCHEDULE, parse("checkpoint-all+micro2"), observers=[watch])
    row = t.step(batches[0])
    assert row.loss == pytest.approx(full.loss, rel=1e-6)  # float32: the micro-batch shares reorder a sum
    assert [x for x in seen if x[0] == "forward"] == [("forward", 0, True), ("forward", 1, True)]
    assert not model.is_gradient_checkpointing  # undone after the step


def test_a_data_stream_feeds_step_without_a_batch():
    t = Trainer.build(build_model(W), SCHEDULE, data=TextStream(torch.arange(200), W.batch, W.seq, 0))
    t.step()
    t.step()
    assert t.data.position == 2 and t.clock.updates == 2
    with pytest.raises(ValueError, match="data stream"):
        Trainer.build(build_model(W), SCHEDULE).step()


def test_phase_trainer_follows_the_train_config():
    cfg = TrainConfig(updates=10, lr=2e-3, warmup=2, decay=4, weight_decay=0.05, max_norm=0.7, init_scale=2.0**8,
                      growth_interval=3)
    t = phase_trainer(build_model(W), cfg, TextStream(torch.arange(200), W.batch, W.seq, 0))
    group = t.optimizer.param_groups[0]
    assert (group["weight_decay"], group["lr"], t.max_norm, t.cfg) == (0.05, 2e-3 * cfg.min_lr_ratio, 0.7, cfg)
    assert t.clock.cfg == cfg.schedule and not t.scaler.is_enabled()
    fp16 = phase_trainer(build_model(W), cfg, strategy=parse("fp16"))
    assert fp16.scaler.get_scale() == 2.0**8 and fp16.scaler.get_growth_interval() == 3
    assert Trainer.build(build_model(W), SCHEDULE).optimizer.defaults["weight_decay"] == 0.01  # AdamW's default
