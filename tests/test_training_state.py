"""``training_state``: the clock's counts and a restore that shares or copies its tensors. Saving, loading,
resuming bit for bit and every refusal: ``tests/test_continual_pretrain.py``; a save's atomicity:
``tests/test_training_state_durability.py``."""

import torch

from bp_mech.bench.trainer import phase_trainer
from bp_mech.continual_data import TextStream
from bp_mech.continual_pretrain import TrainConfig, train
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.scheduler import UpdateClock, WSDConfig
from bp_mech.training_state import capture_state, clock_state, restore_state, set_clock_state


def test_setting_the_clock_moves_its_rate_but_leaves_the_optimizer_s_lr():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=123.0)
    clock = UpdateClock(WSDConfig(base_lr=1.0, warmup=4), opt)  # writes lr 0.0 into the optimizer
    set_clock_state(clock, {"updates": 2, "skipped": 5})
    assert clock_state(clock) == {"updates": 2, "skipped": 5} and clock.lr == 0.5
    assert opt.param_groups[0]["lr"] == 0.0  # the optimizer state's own lr is restored with it


def _trainer():
    return phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
                         TextStream(torch.arange(64), 1, 8, 0))


def test_a_restore_copies_the_state_unless_it_is_handed_over():
    t = _trainer()
    train(t, 1)
    state = capture_state(t)
    moment = next(iter(state["optimizer"]["state"].values()))["exp_avg"]
    before = moment.clone()
    restore_state(t, state)
    train(t, 2)  # (``until`` counts applied updates in total)
    assert t.clock.updates == 2 and state["clock"] == {"updates": 1, "skipped": 0}
    assert torch.equal(moment, before)  # copied: training on leaves the captured state as it was
    restore_state(t, state, copy_state=False)
    assert t.clock.updates == 1
    train(t, 2)
    assert not torch.equal(moment, before)  # handed over: the optimizer trains on state's own tensors
