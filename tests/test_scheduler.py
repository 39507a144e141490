"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK: values, the clock under skips, the run, and that the
exercise checks catch the classic mistakes (mutants)."""

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from bp_mech import registry, results
from bp_mech.scheduler import (DECAY_TYPES, ClockRun, NaiveClock, UpdateClock, WSDConfig, compare_with_transformers,
                               conformance, scaler_step, summarize, train_with_clock, wsd_lr)
from checks import ex12
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


def test_run_boundary_shifts_and_records(tmp_path):
    ctx = registry.make_context("TRAIN-SCHEDULER-CLOCK", "cpu", "tiny-b1s16")
    recs = {r.candidate: r for r in registry.run(ctx)}
    run_cfg = ClockRun()
    n_skips = len(run_cfg.overflow_calls) + len(run_cfg.explicit_skip_calls)
    for r in recs.values():
        results.load_record(results.save_record(r, tmp_path))
        assert r.update_count == run_cfg.schedule.total and r.skipped_updates == n_skips
        assert r.metrics["skipped_calls"] == sorted(run_cfg.overflow_calls + run_cfg.explicit_skip_calls)
        assert r.metrics["params_unchanged_on_skip"] and r.metrics["transformers_max_abs_diff"] == 0.0
        assert r.all_finite
    good, naive = recs["update-clock"].metrics, recs["naive-clock"].metrics
    assert good["shifts"] == {"warmup_end": 0, "decay_start": 0, "end": 0} and good["lr_error_max"] == 0.0
    # skips (2, 3) before warmup end, 11 before decay start, 22 before the end: shifts of 2, 3, 4
    assert naive["shifts"] == {"warmup_end": -2, "decay_start": -3, "end": -4}
    assert good["boundaries_calls"] == {"warmup_end": 8, "decay_start": 19, "end": 28}
    assert naive["updates_past_end"] == 4 and good["updates_past_end"] == 0 and naive["lr_error_max"] > 0
    assert (recs["update-clock"].decision, recs["naive-clock"].decision) == ("accept", "reject")
    assert good["final_lr"] == pytest.approx(run_cfg.schedule.base_lr * run_cfg.schedule.min_lr_ratio)


def test_naive_trace_matches_transformers_stepped_every_call():
    ctx = registry.make_context("TRAIN-SCHEDULER-CLOCK", "cpu", "tiny-b1s16")
    run_cfg = ClockRun(schedule=WSDConfig(warmup=3, stable=2, decay=3, decay_type="linear"), overflow_calls=(1,),
                       explicit_skip_calls=(5,))
    t = train_with_clock("naive-clock", ctx, run_cfg)
    s = summarize(t, run_cfg.schedule)
    # call 5 (the skip) is the naive decay-start call itself, so only call 1 precedes that boundary
    assert s["transformers_max_abs_diff"] == 0.0 and s["shifts"] == {"warmup_end": -1, "decay_start": -1, "end": -2}


def test_conformance_passes():
    row = conformance()
    assert row.passed, row.detail


def test_dry_run_plan():
    p = registry.plan(registry.make_context("TRAIN-SCHEDULER-CLOCK", "dry_run"))
    assert p["candidates"] == ["naive-clock", "update-clock"] and p["optimizer_calls"] == 28


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
    with pytest.raises(AssertionError):
        ex12.check_wsd_lr(mutant)


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
    caught = 0
    for check in (ex12.check_clock_no_skips, ex12.check_clock_skips_at_boundaries, ex12.check_clock_random_skips):
        try:
            check(mutant)
        except AssertionError:
            caught += 1
    assert caught >= 1
    if name == "advances on a skipped step":  # both skip checks must catch the main bug
        for check in (ex12.check_clock_skips_at_boundaries, ex12.check_clock_random_skips):
            with pytest.raises(AssertionError):
                check(mutant)
