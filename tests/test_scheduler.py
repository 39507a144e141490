"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK, the mechanism: values, the clock under skips, skip detection,
and that the exercise checks catch the classic mistakes (mutants). The run, its plan and the
conformance row: tests/experiments/test_scheduler.py."""

import dataclasses
import math
import types
import warnings
from pathlib import Path

import pytest
import torch

from bp_mech.scheduler import (DECAY_TYPES, NaiveClock, UpdateClock, WSDConfig, compare_with_transformers, scaler_step,
                               wsd_lr)
from bp_mech.checks import ex12
from checks.mutants import caught_by
from conftest import load_solution

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
@pytest.mark.parametrize("m", [0.0, 0.1, 0.3])
def test_bitwise_equal_to_transformers(decay_type, m):
    for W, S, D in ((5, 7, 9), (1, 0, 1), (0, 3, 4)):
        c = compare_with_transformers(WSDConfig(base_lr=3e-4, warmup=W, stable=S, decay=D, decay_type=decay_type,
                                                min_lr_ratio=m))
        assert c["max_abs_diff"] == 0.0, (W, S, D, c)


def test_boundary_values():
    cfg = WSDConfig(base_lr=2.0, warmup=4, stable=3, decay=5, decay_type="linear", min_lr_ratio=0.25)
    assert wsd_lr(0, cfg) == 0.5  # warmup starts at base * m
    assert wsd_lr(2, cfg) == 2.0 * (0.25 + 0.75 * 0.5)
    assert wsd_lr(4, cfg) == 2.0 and wsd_lr(6, cfg) == 2.0  # stable
    assert wsd_lr(7, cfg) == 2.0  # first decay update: progress 0
    assert wsd_lr(8, cfg) == pytest.approx(2.0 * (0.25 + 0.75 * 0.8))
    assert wsd_lr(12, cfg) == 0.5 and wsd_lr(100, cfg) == 0.5  # floor
    assert cfg.boundaries == {"warmup_end": 4, "decay_start": 7, "end": 12}


def test_update_clock_holds_on_skip_and_naive_does_not():
    cfg = WSDConfig(warmup=3, stable=2, decay=3)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=99.0)
    good, naive = UpdateClock(cfg, opt), NaiveClock(cfg)
    assert opt.param_groups[0]["lr"] == wsd_lr(0, cfg)  # attached optimizer set at construction
    for applied in (True, False, False, True):
        good.step(applied)
        naive.step(applied)
    assert (good.updates, good.skipped, good.position) == (2, 2, 2)
    assert (naive.updates, naive.skipped, naive.position) == (2, 2, 4)
    assert good.lr == wsd_lr(2, cfg) and naive.lr == wsd_lr(4, cfg) != good.lr
    assert opt.param_groups[0]["lr"] == good.lr


def test_scaler_step_detects_a_skip_with_public_api():
    p = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale((p * float("inf")).sum()).backward()
    assert scaler_step(scaler, opt) is False and torch.equal(p.detach(), torch.ones(3)) and scaler.get_scale() == 4.0
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    assert scaler_step(scaler, opt) is True and torch.allclose(p.detach(), torch.full((3,), 0.9))
    off = torch.amp.GradScaler("cpu", enabled=False)
    opt.zero_grad()
    off.scale(p.sum()).backward()
    assert scaler_step(off, opt) is True
    scaler.set_backoff_factor(1.0)  # GradScaler's constructor refuses this; the setter does not
    with pytest.raises(ValueError):
        scaler_step(scaler, opt)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_skipped_step_calls_fused_adamw_which_skips_inside(fused):
    """Chapter 12: on inf/NaN the GradScaler calls a fused AdamW's step (with found_inf; the
    kernel leaves parameters, moments and step count alone) and does not call a foreach one.
    Real torch objects on the CPU, where torch has the fused AdamW too."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused, foreach=not fused)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(p.square().sum()).backward()
    assert scaler_step(scaler, opt) is True and len(calls) == 1
    state = {k: v.clone() for k, v in opt.state[p].items()}
    before = p.detach().clone()
    opt.zero_grad()
    scaler.scale(p.sum() * float("inf")).backward()
    assert scaler_step(scaler, opt) is False
    assert len(calls) == (2 if fused else 1)  # fused: step() ran, and skipped inside
    assert torch.equal(p.detach(), before)
    assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())  # step, moments


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_lr_scheduler_warns_on_a_skipped_first_step_only_without_fused(fused):
    """Chapter 12: LRScheduler's "before optimizer.step()" warning needs step() not called."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused, foreach=not fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(p.sum() * float("inf")).backward()
    assert scaler_step(scaler, opt) is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    warned = any("before `optimizer.step()`" in str(w.message) for w in caught)
    assert warned is not fused


# --- the exercise checks catch the classic mistakes ------------------------------------

ANSWER = load_solution(ROOT / "answers", "ex12_scheduler_clock")


def _wsd_with(**shift):
    """wsd_lr with one boundary moved by one update."""
    def f(k, cfg):
        return wsd_lr(k, dataclasses.replace(cfg, **{n: max(0, getattr(cfg, n) + d) for n, d in shift.items()}))
    return f


WSD_MUTANTS = {
    "one-based update count": lambda k, cfg: wsd_lr(k + 1, cfg),
    "warmup one update too long": _wsd_with(warmup=1),
    "warmup one update too short": _wsd_with(warmup=-1, stable=1),
    "decay starts one update late": _wsd_with(stable=1, decay=-1),
    "decay starts one update early": _wsd_with(stable=-1, decay=1),
    "decay ends one update late": _wsd_with(decay=1),
    "decay ends one update early": _wsd_with(decay=-1),
}


@pytest.mark.parametrize("name", WSD_MUTANTS)
def test_wsd_check_catches(name):
    mutant = types.SimpleNamespace(wsd_lr=WSD_MUTANTS[name])
    with pytest.raises(AssertionError, match="^wsd_lr: "):
        ex12.check_wsd_lr(mutant)


def _wsd_floor_by_clamp(k, cfg):
    """The decay formula with p clamped at 1 standing in for the floor: right unless D = 0, where update
    W+S must already be at the floor but p = 0 gives the full rate."""
    W, S, D, m = cfg.warmup, cfg.stable, cfg.decay, cfg.min_lr_ratio
    if k < W + S:
        return wsd_lr(k, cfg)
    p = min(1.0, (k - W - S) / max(1, D))
    f = 1.0 - p if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.base_lr * (m + (1.0 - m) * f)


def test_zero_length_phase_check_catches_a_floor_reached_by_clamping():
    mutant = types.SimpleNamespace(wsd_lr=_wsd_floor_by_clamp)
    with pytest.raises(AssertionError, match=r"^wsd_lr: lr is .* at update 5, cfg .*decay=0.* \(the end of decay "
                                             r"boundary\)"):
        ex12.check_wsd_lr__zero_length_phases(mutant)


class ClockAheadByOne(UpdateClock):
    @property
    def position(self):
        return self.updates + 1


class ClockRestartsOnSkip(UpdateClock):
    def step(self, applied):
        if not applied:
            self.updates = max(0, self.updates - 1)
        return super().step(applied)


class ClockForgetsSkips(UpdateClock):
    def step(self, applied):
        self.updates += applied
        self._apply()
        return self.lr


CLOCK_MUTANTS = {"advances on a skipped step": NaiveClock, "one update ahead": ClockAheadByOne,
                 "steps back on a skip": ClockRestartsOnSkip, "does not count skips": ClockForgetsSkips}


@pytest.mark.parametrize("name", CLOCK_MUTANTS)
def test_clock_checks_catch(name):
    mutant = types.SimpleNamespace(wsd_lr=wsd_lr, UpdateClock=CLOCK_MUTANTS[name])
    checks = (ex12.check_UpdateClock, ex12.check_UpdateClock__skips_at_boundaries, ex12.check_UpdateClock__random_skips)
    assert caught_by(checks, mutant, "UpdateClock") >= 1
    if name == "advances on a skipped step":  # both skip checks must catch the main bug
        for check in (ex12.check_UpdateClock__skips_at_boundaries, ex12.check_UpdateClock__random_skips):
            with pytest.raises(AssertionError):
                check(mutant)
