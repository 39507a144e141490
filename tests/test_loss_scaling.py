"""``loss_scaling``: the Python update rule step by step against torch's own ``GradScaler`` driven with real
finite and infinite gradients (on the CPU). The rule against the checks' reference and its float32 ceiling:
``tests/test_amp.py``."""

import random

import pytest
import torch

from bp_mech.loss_scaling import DynamicLossScaler


def _torch_scaler_trace(pattern, **kw):
    """(skipped, scale after the step) per step of a real GradScaler on one parameter."""
    p = torch.nn.Parameter(torch.ones(2))
    opt, scaler = torch.optim.SGD([p], lr=0.0), torch.amp.GradScaler("cpu", **kw)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        x = torch.tensor([float("inf") if overflow else 1.0, 1.0])
        scaler.scale((p * x).sum()).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale() < before, scaler.get_scale()))
    return out


@pytest.mark.parametrize("kw", [dict(init_scale=2.0**10, growth_interval=2),
                                dict(init_scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1),
                                dict(init_scale=2.0**16, growth_interval=4)])
def test_a_random_overflow_pattern_gives_torch_s_scales(kw):
    rng = random.Random(str(kw))
    pattern = [rng.random() < 0.3 for _ in range(40)]
    ours = DynamicLossScaler(**kw)
    for overflow, (skipped, scale) in zip(pattern, _torch_scaler_trace(pattern, **kw)):
        assert ours.update(overflow) == overflow == skipped
        assert ours.scale == scale


def test_the_tracker_counts_finite_steps_since_the_last_overflow_or_growth():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    trackers = []
    for overflow in (False, False, True, False, False, False, False):
        s.update(overflow)
        trackers.append(s.growth_tracker)
    assert trackers == [1, 2, 0, 1, 2, 0, 1] and s.scale == 8.0  # 8 -> 4 (overflow) -> 8 (growth)


def test_the_scale_is_kept_in_float32():
    s = DynamicLossScaler(init_scale=0.1, backoff_factor=0.5)
    assert s.scale == torch.tensor(0.1, dtype=torch.float32).item() != 0.1
    s.update(True)
    assert s.scale == torch.tensor(0.1, dtype=torch.float32).item() * 0.5
