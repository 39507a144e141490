"""Part 02 · 12: every property the exercise checks hold (``ex12``'s declarations, derived by ``checks.engine``)
rejects a solution that breaks exactly it, and the variant's and the prediction's checks reject the classic
mistakes; the schedule's and the clock's off-by-ones are in tests/test_scheduler.py."""

import math
import operator
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import mutant

from bp_mech.checks import ex12
from bp_mech.scheduler import UpdateClock, wsd_factor, wsd_lr

ANS = mutant("ex12_scheduler_clock")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny steps: more threads only spin on a shared machine


def _bad(**over):
    return mutant("ex12_scheduler_clock", **over)


class SharedClock(UpdateClock):  # the counts on the class: every clock moves together
    counts: ClassVar[dict] = {"updates": 0, "skipped": 0}  # the bug: one dict for all clocks
    updates = property(lambda s: s.counts["updates"], lambda s, v: s.counts.__setitem__("updates", v))
    skipped = property(lambda s: s.counts["skipped"], lambda s, v: s.counts.__setitem__("skipped", v))


class FloatCounts(UpdateClock):
    def step(self, applied):
        self.updates, self.skipped = self.updates + float(applied), self.skipped + float(not applied)
        return self.lr


class NumpyLr(UpdateClock):
    lr = property(lambda s: np.float64(wsd_lr(s.updates, s.cfg)))


class ForgetsSkipped(UpdateClock):
    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = state["updates"]


class AliasedState(UpdateClock):  # the counts live in a dict, and state_dict() hands that dict out
    updates = property(lambda s: s._sd["updates"], lambda s, v: s._put("updates", v))
    skipped = property(lambda s: s._sd["skipped"], lambda s, v: s._put("skipped", v))

    def _put(self, key, v):
        self.__dict__.setdefault("_sd", {})[key] = v

    def state_dict(self):
        return self._sd


class TrustingLoad(UpdateClock):
    def load_state_dict(self, state):
        self.updates, self.skipped = state.get("updates", 0), state.get("skipped", 0)


class HalfLoad(UpdateClock):
    def load_state_dict(self, state):
        self.updates = state["updates"]  # set before validating the rest
        super().load_state_dict(state)


def _wsd_unconverted(k, cfg):  # base * factor as it comes: an int 0 for an int base and floor
    if k < 0:
        raise ValueError("negative")
    return cfg.base_lr * wsd_factor(k, cfg)


def _restarts(off_by_one=False, no_mult=False, to_min=False, check=True, cast=float):
    def f(update, base_lr, cycle, mult=1, min_lr=0.0):
        if check and (update < 0 or cycle < 1 or mult < 1):
            raise ValueError("bad")
        t, length = update, cycle
        while t > length if off_by_one else t >= length:
            t -= length
            length *= 1 if no_mult else mult
        den = max(1, length - 1) if to_min else length
        return cast(min_lr + (base_lr - min_lr) * (1 + math.cos(math.pi * t / den)) / 2)
    return f


def _restarts_by_log(update, base_lr, cycle, mult=1, min_lr=0.0):  # torch's step(epoch) closed form
    if update < 0 or cycle < 1 or mult < 1:
        raise ValueError("bad")
    t, length = update, cycle
    if update >= cycle:
        if mult == 1:
            t = update % cycle
        else:
            n = int(math.log(update / cycle * (mult - 1) + 1, mult))
            t, length = update - cycle * (mult ** n - 1) / (mult - 1), cycle * mult ** n
    return float(min_lr + (base_lr - min_lr) * (1 + math.cos(math.pi * t / length)) / 2)


def _predict(no_overflows=False, no_periodic=False, period_off=False, as_list=False):
    def f(w, s, o, g):
        u = w + s
        call, naive = ANS.predict_decay_entry(w, s, 0 if no_overflows else o, g)
        if no_periodic:
            call, naive = o + u, max(0, u - o)
        if period_off:
            call = o + u + u // (g + 1)
        return [call, naive] if as_list else (call, naive)
    return f


def _wsd_leaves_float64(k, cfg):  # computes in torch and leaves the default dtype changed
    torch.set_default_dtype(torch.float64)
    return float(torch.tensor(wsd_lr(k, cfg)))


def _wsd_decay_type_by_identity(k, cfg):  # `decay_type is "linear"`: right for the literal only
    W, S, D, m = cfg.warmup, cfg.stable, cfg.decay, cfg.min_lr_ratio
    if not W + S <= k < W + S + D:
        return wsd_lr(k, cfg)
    p = (k - W - S) / D
    f = 1 - p if operator.is_(cfg.decay_type, "linear") else (1 + math.cos(math.pi * p)) / 2
    return float(cfg.base_lr * (m + (1 - m) * f))


def _restarts_mult_default(update, base_lr, cycle, mult=2, min_lr=0.0):  # the docstring's default is 1
    return _restarts()(update, base_lr, cycle, mult, min_lr)


def _restarts_min_default(update, base_lr, cycle, mult=1, min_lr=1e-5):  # the docstring's default is 0.0
    return _restarts()(update, base_lr, cycle, mult, min_lr)


CASES = [
    (ex12.check_wsd_lr, {"wsd_lr": lambda k, c: np.float64(wsd_lr(k, c))}, "lr is a float64, expected a float"),
    (ex12.check_wsd_lr, {"wsd_lr": _wsd_unconverted}, "lr is an int, expected a float"),
    (ex12.check_wsd_lr, {"wsd_lr": lambda k, c: float(c.base_lr * wsd_factor(k, c))},
     r"for update -1 \(negative\), expected ValueError"),
    (ex12.check_wsd_lr, {"wsd_lr": _wsd_leaves_float64}, "left the default dtype changed"),
    (ex12.check_wsd_lr, {"wsd_lr": _wsd_decay_type_by_identity}, r"lr is .* at update 3, .*decay_type='linear'"),
    (ex12.check_UpdateClock, {"UpdateClock": SharedClock}, "a second clock.*keep the counts on self"),
    (ex12.check_UpdateClock, {"UpdateClock": FloatCounts}, r"\['(updates|skipped)'\] is a float, expected an int"),
    (ex12.check_UpdateClock, {"UpdateClock": NumpyLr}, "is a float64, expected a float"),
    (ex12.check_UpdateClock__state_dict, {"UpdateClock": ForgetsSkipped},
     r"\['state_dict\(\)'\] has \['updates'\] entries"),
    (ex12.check_UpdateClock__state_dict, {"UpdateClock": AliasedState}, "return a copy"),
    (ex12.check_UpdateClock__state_dict, {"UpdateClock": TrustingLoad},
     r"raised'\] is 'nothing \(it must raise ValueError"),
    (ex12.check_UpdateClock__state_dict, {"UpdateClock": HalfLoad}, "refused state.*the clock after"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts(off_by_one=True)}, "CosineAnnealingWarmRestarts"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts(no_mult=True)}, "mult 2"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts(to_min=True)}, "CosineAnnealingWarmRestarts"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts_by_log}, "update 111, .*mult 10"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts(check=False)}, "expected ValueError"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts(cast=np.float64)}, "lr is a float64"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts_mult_default}, r"mult left out \(default 1\)"),
    (ex12.check_cosine_restarts_lr, {"cosine_restarts_lr": _restarts_min_default}, r"min_lr left out \(default 0"),
    (ex12.check_predict_decay_entry, {"predict_decay_entry": _predict(no_overflows=True)}, "measurement"),
    (ex12.check_predict_decay_entry, {"predict_decay_entry": _predict(no_periodic=True)}, "measurement"),
    (ex12.check_predict_decay_entry, {"predict_decay_entry": _predict(period_off=True)}, "measurement"),
    (ex12.check_predict_decay_entry, {"predict_decay_entry": _predict(as_list=True)},
     r"returned a list, expected a tuple \(call, naive_updates\)"),
]


@pytest.mark.parametrize("check, over, message", CASES, ids=[
    "wsd-numpy-float", "wsd-int-for-int-base", "wsd-negative-accepted", "wsd-default-dtype", "wsd-decay-type-is",
    "clock-shared-state", "clock-float-counts", "clock-numpy-lr", "state-forgets-skipped", "state-aliased", "state-load-trusts",
    "state-half-load",
    "restarts-off-by-one", "restarts-ignores-mult", "restarts-reaches-min", "restarts-log-closed-form",
    "restarts-no-valueerror", "restarts-numpy-float", "restarts-mult-default", "restarts-min-lr-default",
    "predict-no-overflows", "predict-no-periodic-skips",
    "predict-period-off-by-one", "predict-list"])
def test_contract_check_rejects(check, over, message):
    function = check.__name__.removeprefix("check_").split("__")[0]
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(_bad(**over))


@pytest.mark.parametrize("check", ex12.CHECKS, ids=lambda c: c.__name__)
def test_checks_pass_on_the_answers(check):
    check(ANS)
