"""Checks of exercises/ex12_scheduler_clock.py against transformers.get_wsd_schedule.

The reference is ``transformers.get_wsd_schedule`` (a ``LambdaLR``) on a dummy optimizer,
read at every update, and stepped only on applied calls for the clock checks. Never the
answer file. The schedules include the edge cases that expose off-by-one errors: a
one-update warmup, no warmup, no stable phase, a one-update decay, and skips that fall
exactly on the calls where a boundary would be crossed; and every zero-length phase the
docstring allows (no decay: the floor right after the stable phase; no phase at all).
"""

import random

import torch
from transformers import get_wsd_schedule

from bp_mech.checks.common import call
from bp_mech.checks.ex12_contract import (
    check_cosine_restarts_lr,
    check_cosine_restarts_lr__contract,
    check_predict_decay_entry,
    check_UpdateClock__contract,
    check_UpdateClock__state_dict,
    check_wsd_lr__contract,
)
from bp_mech.scheduler import WSDConfig

REL_TOL = 1e-12  # float64 arithmetic; a different but equivalent formula differs by ulps only

CONFIGS = [
    WSDConfig(base_lr=1e-3, warmup=4, stable=5, decay=6, decay_type="linear", min_lr_ratio=0.0),
    WSDConfig(base_lr=3e-4, warmup=5, stable=3, decay=7, decay_type="cosine", min_lr_ratio=0.1),
    WSDConfig(base_lr=2.0, warmup=1, stable=0, decay=4, decay_type="linear", min_lr_ratio=0.25),
    WSDConfig(base_lr=1.0, warmup=3, stable=2, decay=1, decay_type="cosine", min_lr_ratio=0.05),
    WSDConfig(base_lr=0.5, warmup=0, stable=2, decay=5, decay_type="cosine", min_lr_ratio=0.2),
]
ZERO_LENGTH = [  # W = 0 or D = 0 use max(1, .) as the denominator; D = 0 goes from base straight to the floor
    WSDConfig(base_lr=1e-3, warmup=3, stable=2, decay=0, decay_type="linear", min_lr_ratio=0.1),
    WSDConfig(base_lr=2e-3, warmup=4, stable=0, decay=0, decay_type="cosine", min_lr_ratio=0.5),
    WSDConfig(base_lr=5e-4, warmup=0, stable=0, decay=4, decay_type="linear", min_lr_ratio=0.0),
    WSDConfig(base_lr=1.0, warmup=0, stable=0, decay=0, decay_type="cosine", min_lr_ratio=0.3),
]
REF = "transformers.get_wsd_schedule"


class Reference:
    """transformers' WSD LambdaLR on a one-parameter SGD; ``advance()`` = one applied update."""

    def __init__(self, cfg: WSDConfig) -> None:
        self.opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.base_lr)
        self.sched = get_wsd_schedule(self.opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable,
                                      decay_type=cfg.decay_type, min_lr_ratio=cfg.min_lr_ratio)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def advance(self) -> None:
        self.opt.step()  # no gradient: a no-op that keeps LambdaLR's ordering check quiet
        self.sched.step()


def _phase(k: int, cfg: WSDConfig) -> str:
    names = {cfg.warmup: "warmup end", cfg.warmup + cfg.stable: "decay start", cfg.total: "end of decay"}
    if k in names:
        return f"the {names[k]} boundary"
    if k < cfg.warmup:
        return "warmup"
    if k < cfg.warmup + cfg.stable:
        return "stable"
    return "decay" if k < cfg.total else "after the schedule"


def _close(fn, what, got, want, base, at):
    if not isinstance(got, float):
        raise AssertionError(f"{fn}: {what} is a {type(got).__name__}, expected a Python float at {at}")
    err = abs(got - want) / max(abs(want), 1e-3 * base)
    assert err <= REL_TOL, f"{fn}: {what} is {got!r}, {REF} gives {want!r} (rel error {err:.1e} > {REL_TOL:g}) at {at}"


def _wsd_configs(m, configs):
    for cfg in configs:
        ref = Reference(cfg)
        for k in range(cfg.total + 3):
            at = f"update {k} ({_phase(k, cfg)}) of {cfg}"
            _close("wsd_lr", "lr", call("wsd_lr", m.wsd_lr, k, cfg, at=at), ref.lr, cfg.base_lr, at)
            ref.advance()


def check_wsd_lr(m):
    _wsd_configs(m, CONFIGS)


def check_wsd_lr__zero_length_phases(m):
    _wsd_configs(m, ZERO_LENGTH)


def _drive(m, cfg: WSDConfig, applied: list[bool], label: str) -> None:
    fn = "UpdateClock"
    clock, ref = call(fn, m.UpdateClock, cfg, at=f"UpdateClock({cfg})"), Reference(cfg)
    _close(fn, "lr before the first call", call(fn, lambda: clock.lr, at=label), ref.lr, cfg.base_lr, label)
    n_ok = 0
    for c, ok in enumerate(applied):
        before = ref.lr
        ret = call(fn, clock.step, ok, at=f"call {c} of {label}")
        if ok:
            ref.advance()
            n_ok += 1
        at = f"call {c} ({'applied' if ok else 'SKIPPED'}; {n_ok} updates, at {_phase(n_ok, cfg)}) of {label}"
        if not ok:
            _close(fn, "lr after a skipped call (a skip must not move it)", clock.lr, before, cfg.base_lr, at)
        _close(fn, "step()'s return value", ret, ref.lr, cfg.base_lr, at)
        _close(fn, "lr", clock.lr, ref.lr, cfg.base_lr, at)
        assert clock.updates == n_ok, f"{fn}: updates is {clock.updates}, expected {n_ok} at {at}"
        assert clock.skipped == c + 1 - n_ok, f"{fn}: skipped is {clock.skipped}, expected {c + 1 - n_ok} at {at}"


def _skip_at_boundaries(cfg: WSDConfig) -> list[bool]:
    """Applied flags with skips at call 0 and on the calls where each boundary is reached."""
    out, n = [False], 0
    for b in sorted({cfg.warmup, cfg.warmup + cfg.stable, cfg.total}):
        while n < b - 1:
            out.append(True)
            n += 1
        out += [False, False, True]  # two skips just before the boundary update, then it
        n += 1
    return out + [True] * 3


def check_UpdateClock(m):
    for cfg in CONFIGS + ZERO_LENGTH:
        _drive(m, cfg, [True] * (cfg.total + 3), f"no skips, {cfg}")


def check_UpdateClock__skips_at_boundaries(m):
    for cfg in CONFIGS + ZERO_LENGTH:
        _drive(m, cfg, _skip_at_boundaries(cfg), f"skips at the boundaries of {cfg}")


def check_UpdateClock__random_skips(m):
    rng = random.Random(12)
    for i, cfg in enumerate(CONFIGS + ZERO_LENGTH):
        flags = [rng.random() > 0.3 for _ in range(2 * cfg.total + 6)]
        _drive(m, cfg, flags, f"random skips #{i} of {cfg}")


CHECKS = [check_wsd_lr, check_wsd_lr__zero_length_phases, check_wsd_lr__contract, check_UpdateClock,
          check_UpdateClock__skips_at_boundaries, check_UpdateClock__random_skips, check_UpdateClock__contract,
          check_UpdateClock__state_dict, check_cosine_restarts_lr, check_cosine_restarts_lr__contract,
          check_predict_decay_entry]
