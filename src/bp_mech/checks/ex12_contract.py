"""Checks of exercises/ex12_scheduler_clock.py beyond the values: the contract, the variant, the prediction.

- ``wsd_lr``: exactly a Python float, equal to transformers' WSD lambda on schedules and updates drawn by
  hypothesis; ``ValueError`` for a negative update.
- ``UpdateClock``: exact types, no state shared between two clocks, a ``state_dict`` round trip that
  restores every count (a resumed clock continues call for call), a returned state that is a copy,
  ``ValueError`` on a bad state (the clock left as it was).
- ``cosine_restarts_lr`` (variant) against ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``.
- ``predict_decay_entry`` (prediction) against a real ``torch.amp.GradScaler`` loop, exactly (it is a count).
"""

from functools import lru_cache

import torch
from hypothesis import strategies as st
from transformers import get_wsd_schedule

from bp_mech.checks.common import call
from bp_mech.checks.properties import assert_json, assert_raises, assert_type, explore
from bp_mech.scheduler import WSDConfig

REL_TOL = 1e-12  # float64; an equivalent formula differs by a few ulps
CONFIGS = st.builds(WSDConfig, base_lr=st.sampled_from([1e-3, 3e-4, 2.0, 1]), warmup=st.integers(0, 6),
                    stable=st.integers(0, 6), decay=st.integers(0, 6), decay_type=st.sampled_from(["linear", "cosine"]),
                    min_lr_ratio=st.sampled_from([0.0, 0.1, 0.5, 0]))


@lru_cache(maxsize=256)
def _lam(cfg: WSDConfig):
    """transformers' own multiplier function of the WSD LambdaLR (read directly, no stepping)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_wsd_schedule(opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable, decay_type=cfg.decay_type,
                            min_lr_ratio=cfg.min_lr_ratio).lr_lambdas[0]


def _near(fn, what, got, want, base, at):
    assert_type(fn, what, got, float, at)
    err = abs(got - want) / max(abs(want), 1e-3 * abs(base))
    assert err <= REL_TOL, f"{fn}: {what} is {got!r}, the reference gives {want!r} (rel error {err:.1e}) at {at}"


def check_wsd_lr__contract(m):
    cfg = WSDConfig(base_lr=1, warmup=1, stable=1, decay=1, min_lr_ratio=0)  # ints: the floor must still be a float
    for k in range(5):
        at = f"update {k} of {cfg}"
        assert_type("wsd_lr", "lr", call("wsd_lr", m.wsd_lr, k, cfg, at=at), float, at)

    def body(case):
        cfg, ks = case
        lam = _lam(cfg)
        for k in ks:
            at = f"update {k} of {cfg}"
            _near("wsd_lr", "lr", call("wsd_lr", m.wsd_lr, k, cfg, at=at), cfg.base_lr * lam(k), cfg.base_lr, at)
        assert_raises("wsd_lr", m.wsd_lr, (-1, cfg), ValueError, "update -1 (negative)", str(cfg))
    explore(st.tuples(CONFIGS, st.lists(st.integers(0, 25), min_size=1, max_size=8)), body)


FLAGS = st.lists(st.booleans(), min_size=0, max_size=24)


def _state(clock):
    return clock.updates, clock.skipped, clock.lr


def check_UpdateClock__contract(m):
    fn = "UpdateClock"

    def body(case):
        cfg, flags = case
        at = f"{cfg}, calls {['applied' if f else 'skipped' for f in flags]}"
        a = call(fn, m.UpdateClock, cfg, at=at)
        b = call(fn, m.UpdateClock, cfg, at=at)
        for f in flags:
            ret = call(fn, a.step, f, at=at)
            assert_type(fn, "step()'s return value", ret, float, at)
        assert_type(fn, "lr", a.lr, float, at)
        assert_type(fn, "updates", a.updates, int, at)
        assert_type(fn, "skipped", a.skipped, int, at)
        lam = _lam(cfg)
        _near(fn, "lr", a.lr, cfg.base_lr * lam(sum(flags)), cfg.base_lr, at)
        lr0 = cfg.base_lr * lam(0)
        assert (b.updates, b.skipped) == (0, 0) and abs(b.lr - lr0) <= REL_TOL * max(abs(lr0), 1e-3 * cfg.base_lr), (
            f"{fn}: a second clock moved when the first was stepped (updates {b.updates}, skipped {b.skipped}): "
            f"state shared between instances (keep the counts on self, not on the class) at {at}")
    explore(st.tuples(CONFIGS, FLAGS), body)


def check_UpdateClock__state_dict(m):
    fn = "UpdateClock"

    def body(case):
        cfg, before, after = case
        at = f"{cfg}, saved after calls {before}, resumed for calls {after}"
        a = call(fn, m.UpdateClock, cfg, at=at)
        for f in before:
            call(fn, a.step, f, at=at)
        sd = call(fn, a.state_dict, at=at)
        assert_type(fn, "state_dict()", sd, dict, at)
        assert_json(fn, "state_dict()", sd, at)
        saved = _state(a)
        c = call(fn, m.UpdateClock, cfg, at=at)
        call(fn, c.step, True, at=at)  # a clock that had moved on: the load must overwrite every count
        call(fn, c.step, False, at=at)
        call(fn, c.load_state_dict, sd, at=at)
        assert _state(c) == saved, (f"{fn}: load_state_dict(state_dict()) gives (updates, skipped, lr) "
                                    f"{_state(c)}, the saved clock had {saved} at {at}")
        for key in list(sd):
            sd[key] = 10 ** 6  # a checkpoint writer that edits its dict must not move the live clock
        assert _state(a) == saved, (f"{fn}: changing the dict state_dict() returned changed the clock to "
                                    f"{_state(a)} (return a copy) at {at}")
        for i, f in enumerate(after):
            ra, rc = call(fn, a.step, f, at=at), call(fn, c.step, f, at=at)
            assert _state(c) == _state(a) and ra == rc, (
                f"{fn}: the resumed clock differs from the original {i + 1} calls after the load: "
                f"{_state(c)} vs {_state(a)} at {at}")
        for bad in ({"updates": 3}, {"updates": -1, "skipped": 0}, {"updates": 3.0, "skipped": 0}):
            before_bad = _state(c)
            assert_raises(fn, c.load_state_dict, (bad,), ValueError, f"load_state_dict({bad})", str(cfg))
            assert _state(c) == before_bad, (f"{fn}: a rejected load_state_dict({bad}) changed the clock to "
                                             f"{_state(c)} from {before_bad} at {cfg}")
    explore(st.tuples(CONFIGS, FLAGS, st.lists(st.booleans(), min_size=1, max_size=12)), body, examples=10)


# --- the variant: cosine annealing with warm restarts ---------------------------------------


@lru_cache(maxsize=512)
def _sgdr(base_lr, cycle, mult, min_lr, n):
    """The learning rate of updates 0 .. n-1 from torch's CosineAnnealingWarmRestarts, stepped once per update."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=cycle, T_mult=mult, eta_min=min_lr)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return tuple(out)


def _restarts_case(m, base_lr, cycle, mult, min_lr, n):
    want = _sgdr(base_lr, cycle, mult, min_lr, n)
    for k, w in enumerate(want):
        at = f"update {k}, base_lr={base_lr}, cycle={cycle}, mult={mult}, min_lr={min_lr}"
        got = call("cosine_restarts_lr", m.cosine_restarts_lr, k, base_lr, cycle, mult, min_lr, at=at)
        if not isinstance(got, float) or abs(got - w) > REL_TOL * max(abs(w), 1e-3 * base_lr):
            raise AssertionError(f"cosine_restarts_lr: lr is {got!r}, torch's CosineAnnealingWarmRestarts gives "
                                 f"{w!r} at {at}")


def check_cosine_restarts_lr(m):
    for args in ((1.0, 5, 1, 0.0, 17), (3e-4, 3, 2, 3e-5, 30), (0.1, 1, 1, 0.0, 4), (2.0, 2, 3, 0.5, 30),
                 (1e-3, 7, 1, 1e-4, 22), (0.1, 1, 10, 0.0, 115)):  # the last: log(1000, 10) < 3 in floats
        _restarts_case(m, *args)


def check_cosine_restarts_lr__contract(m):
    def body(case):
        base_lr, cycle, mult, ratio, n = case
        _restarts_case(m, base_lr, cycle, mult, base_lr * ratio, n)
        got = m.cosine_restarts_lr(n, base_lr, cycle, mult, base_lr * ratio)
        assert_type("cosine_restarts_lr", "the learning rate", got, float, f"update {n}, base_lr={base_lr}")
        for bad in ((-1, base_lr, cycle, mult), (0, base_lr, 0, mult), (0, base_lr, cycle, 0)):
            assert_raises("cosine_restarts_lr", m.cosine_restarts_lr, bad, ValueError,
                          f"(update, base_lr, cycle, mult) = {bad}", "a bad argument")
    explore(st.tuples(st.sampled_from([1.0, 3e-4, 2, 0.5]), st.integers(1, 9), st.integers(1, 3),
                      st.sampled_from([0.0, 0.1, 0]), st.integers(1, 40)), body)


# --- the prediction: where decay begins when a GradScaler skips -----------------------------

EDGE = 27  # the scale 2**27 times a gradient of 2**100 is the largest finite float32 power of two here


@lru_cache(maxsize=512)
def measure_skips(overflows: int, growth_interval: int, calls: int) -> tuple[bool, ...]:
    """Run ``calls`` optimizer calls through a real GradScaler; True where the parameter changed (applied).
    Cached: the loop is deterministic, and shrinking a failure re-runs the same settings."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0 ** -100)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (EDGE + overflows), growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=growth_interval)
    flags = []
    for _ in range(calls):
        opt.zero_grad()
        before = p.detach().clone()
        scaler.scale((p * 2.0 ** 100).sum()).backward()  # gradient 2**100 * scale: inf above 2**27
        scaler.step(opt)
        scaler.update()
        flags.append(not torch.equal(before, p.detach()))
    return tuple(flags)


def check_predict_decay_entry(m):
    fn = "predict_decay_entry"

    def body(case):
        W, S, o, g = case
        at = f"warmup={W}, stable={S}, overflows={o}, growth_interval={g}"
        got = call(fn, m.predict_decay_entry, W, S, o, g, at=at)
        flags = measure_skips(o, g, o + 2 * (W + S) + 2)
        applied = [c for c, f in enumerate(flags) if f]
        want = (applied[W + S], sum(flags[:W + S]))
        assert_type(fn, "the prediction", got, tuple, at)
        assert len(got) == 2 and all(type(x) is int for x in got), (
            f"{fn}: returned {got!r}, expected a tuple of two Python ints at {at}")
        assert got == want, (f"{fn}: predicted (call, naive_updates) = {got}, the GradScaler loop measured {want} "
                             f"(skipped calls {[c for c, f in enumerate(flags) if not f]}) at {at}")
    explore(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 9), st.integers(1, 5)), body)

