"""``bench.optimizer``: the options resolved per device, the optimizer each names (its update by hand), and
Adafactor stepping on fake tensors. The for-loop AdamW against the planner is
``tests/planner/test_plan_options.py``."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bp_mech.bench.optimizer import Adafactor, StepOptions, make_optimizer


def test_defaults_resolve_per_device():
    cuda, cpu = StepOptions().for_device("cuda"), StepOptions().for_device("cpu")
    assert (cuda.adamw, cuda.autocast, cpu.adamw, cpu.autocast) == ("fused", "cuda", "foreach", "cpu")
    assert StepOptions(optimizer="adafactor").for_device("cuda").adamw == "foreach"  # Adafactor has no fused
    kept = StepOptions(adamw="for-loop", offload_min_bytes=7, autocast="cuda").for_device("cpu")
    assert (kept.adamw, kept.offload_min_bytes, kept.autocast) == ("for-loop", 7, "cuda")


@pytest.mark.parametrize("bad, match", [(dict(adamw="apex"), "AdamW implementation"),
                                        (dict(optimizer="lion"), "unknown optimizer"),
                                        (dict(autocast="tpu"), "autocast policy")])
def test_unknown_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        StepOptions(**bad)


def test_sgd_with_momentum_by_hand_and_frozen_parameters_left_out():
    p, frozen = torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.ones(1), requires_grad=False)
    opt = make_optimizer([p, frozen], StepOptions(optimizer="sgd", lr=0.1), "cpu")
    assert [q for g in opt.param_groups for q in g["params"]] == [p]
    buf, w = torch.zeros(2), p.detach().clone()
    for g in (torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.5])):
        p.grad = g.clone()
        opt.step()
        buf = g if not buf.any() else 0.9 * buf + g  # PyTorch's first step takes the gradient as the buffer
        w = w - 0.1 * buf
    torch.testing.assert_close(p.detach(), w)


def test_an_implementation_an_optimizer_lacks_is_refused():
    with pytest.raises(ValueError, match="adafactor has no implementation 'fused'"):
        make_optimizer([torch.nn.Parameter(torch.ones(1))], StepOptions(optimizer="adafactor"), "cpu", adamw="fused")


def test_adafactor_steps_fake_tensors_and_allocates_its_factored_moments():
    with FakeTensorMode():
        p = torch.nn.Parameter(torch.ones(8, 4))
        opt = make_optimizer([p], StepOptions(optimizer="adafactor"), "cpu")
        assert isinstance(opt, Adafactor)
        p.grad = torch.ones(8, 4)
        opt.step()
        state = opt.state[p]
    # factored second moments: one value per row and one per column, not per element
    assert state["row_var"].numel() == 8 and state["col_var"].numel() == 4
