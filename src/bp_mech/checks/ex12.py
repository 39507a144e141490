"""Checks of exercises/ex12_scheduler_clock.py: one declaration per function (``engine.Contract``).

References: ``transformers.get_wsd_schedule``'s own multiplier (its LambdaLR's lambda, times base_lr) for the
schedule and the clock, ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`` stepped once per update for the
variant, a real ``torch.amp.GradScaler`` loop for the prediction. Never the answer file. The domains: schedules
with a one-update warmup, no warmup, no stable phase, a one-update decay and every zero-length phase the docstring
allows (no decay: the floor right after the stable phase; no phase at all); int base rates and floors (the result
must still be a float); skips on call 0 and on the calls where a boundary is reached; cycles of 1 and mult = 10 at
update 111 (a float log lands one cycle early). ``UpdateClock`` is graded through a driver: a clock stepped through
a pattern, a second clock built beside it, a ``state_dict`` round trip onto a clock that had moved on, the returned
dict edited, the resumed clock stepped on, and refused states. The engine derives the rest.
"""

from functools import lru_cache

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed
from bp_mech.checks.engine import Contract, Raises, checks
from bp_mech.scheduler import WSDConfig

TOL = 1e-12  # float64; an equivalent formula differs by a few ulps
WSD = "transformers.get_wsd_schedule"
CONFIGS = [
    WSDConfig(base_lr=1e-3, warmup=4, stable=5, decay=6, decay_type="linear", min_lr_ratio=0.0),
    WSDConfig(base_lr=3e-4, warmup=5, stable=3, decay=7, decay_type="cosine", min_lr_ratio=0.1),
    WSDConfig(base_lr=2.0, warmup=1, stable=0, decay=4, decay_type="linear", min_lr_ratio=0.25),
    WSDConfig(base_lr=1.0, warmup=3, stable=2, decay=1, decay_type="cosine", min_lr_ratio=0.05),
    WSDConfig(base_lr=0.5, warmup=0, stable=2, decay=5, decay_type="cosine", min_lr_ratio=0.2),
    WSDConfig(base_lr=1, warmup=1, stable=1, decay=1, min_lr_ratio=0),  # ints: the floor must still be a float
    WSDConfig(base_lr=0.1, warmup=1, stable=1, decay=3, decay_type="".join(["lin", "ear"]), min_lr_ratio=0.1),
]  # the last: "linear" read from a file, not the literal (compare strings with ==, not is)
ZERO_LENGTH = [  # W = 0 or D = 0 use max(1, .) as the denominator; D = 0 goes from base straight to the floor
    WSDConfig(base_lr=1e-3, warmup=3, stable=2, decay=0, decay_type="linear", min_lr_ratio=0.1),
    WSDConfig(base_lr=2e-3, warmup=4, stable=0, decay=0, decay_type="cosine", min_lr_ratio=0.5),
    WSDConfig(base_lr=5e-4, warmup=0, stable=0, decay=4, decay_type="linear", min_lr_ratio=0.0),
    WSDConfig(base_lr=1.0, warmup=0, stable=0, decay=0, decay_type="cosine", min_lr_ratio=0.3),
]
DRAWN_CONFIGS = st.builds(WSDConfig, base_lr=st.sampled_from([1e-3, 3e-4, 2.0, 1]), warmup=st.integers(0, 6),
                          stable=st.integers(0, 6), decay=st.integers(0, 6),
                          decay_type=st.sampled_from(["linear", "cosine"]), min_lr_ratio=st.sampled_from([0.0, 0.1, 0]))


@lru_cache(maxsize=256)
def _lam(cfg: WSDConfig):
    """transformers' own multiplier function of the WSD LambdaLR (read directly, no stepping)."""
    from transformers import get_wsd_schedule  # here, not at the top: it imports peft (seconds) through trainer_utils

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_wsd_schedule(opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable, decay_type=cfg.decay_type,
                            min_lr_ratio=cfg.min_lr_ratio).lr_lambdas[0]


def _wsd(update: int, cfg: WSDConfig) -> float:
    """transformers' WSD learning rate of update ``update``: base_lr times its LambdaLR's lambda."""
    return float(cfg.base_lr * _lam(cfg)(update))


def _phase(k: int, cfg: WSDConfig) -> str:
    names = {cfg.warmup: "warmup end", cfg.warmup + cfg.stable: "decay start", cfg.total: "end of decay"}
    if k in names:
        return f"the {names[k]} boundary"
    if k < 0:
        return "a negative update"
    if k < cfg.warmup:
        return "warmup"
    if k < cfg.warmup + cfg.stable:
        return "stable"
    return "decay" if k < cfg.total else "after the schedule"


def _wsd_ref(update, cfg):
    return Raises(ValueError, f"update {update} (negative)") if update < 0 else (_wsd(update, cfg),)


def _updates(configs):
    return [{"update": k, "cfg": cfg} for cfg in configs for k in range(-1, cfg.total + 3)]


WSD_LR = Contract(
    "wsd_lr", lambda c: {"update": c["update"], "cfg": c["cfg"]}, _wsd_ref, ("lr",), returns=float, tol=TOL,
    ref_name=WSD, note=lambda c: _phase(c["update"], c["cfg"]),
    draw=st.fixed_dictionaries({"update": st.integers(-2, 25), "cfg": DRAWN_CONFIGS}),
    examples={"": _updates(CONFIGS), "zero_length_phases": _updates(ZERO_LENGTH)})


# --- the clock, through a driver -------------------------------------------------------------

BAD_STATES = {"{'updates': 3} (no 'skipped')": {"updates": 3}, "a negative count": {"updates": -1, "skipped": 0},
              "a float count 3.0": {"updates": 3.0, "skipped": 0}}


def _obs(clock) -> dict:
    return {"updates": clock.updates, "skipped": clock.skipped, "lr": clock.lr}


def _refused(clock, state) -> dict:
    try:
        clock.load_state_dict(state)
        raised = "nothing (it must raise ValueError)"
    except ValueError:
        raised = "ValueError"
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 (the learner's code may raise anything)
        raised = type(e).__name__
    try:
        return {"raised": raised, "the clock after": _obs(clock)}
    except Exception as e:  # noqa: BLE001 (a state it should have refused broke it: "raised" above says so)
        return {"raised": raised, "the clock after": f"unreadable ({type(e).__name__}: {e})"}


def _drive_clock(cls):
    """The driver of ``UpdateClock``: ``run(cfg, applied, resume)`` -> what a training loop and a checkpoint
    observe: the lr before any call; after each call of ``applied`` step()'s return, lr, updates, skipped; a second
    clock built beside the first; then (``resume`` not None) the state_dict() returned, a clock that had moved on
    after load_state_dict of it, the first clock after that dict was edited, the loaded clock stepped through
    ``resume``, and load_state_dict of each refused state: what it raised, and the clock after."""
    def run(cfg, applied, resume):
        a, b = cls(cfg), cls(cfg)
        out = {"lr before any call": a.lr, "after each call": {}}
        for i, f in enumerate(applied):
            ret = a.step(f)
            out["after each call"][f"call {i} ({'applied' if f else 'SKIPPED'})"] = {"step()": ret, **_obs(a)}
        out["a second clock, built beside it (keep the counts on self, not on the class)"] = _obs(b)
        if resume is None:  # the calls only
            return out
        sd = a.state_dict()
        out["state_dict()"] = dict(sd) if isinstance(sd, dict) else sd
        c = cls(cfg)
        c.step(True), c.step(False)  # a clock that had moved on: the load must overwrite every count
        c.load_state_dict(sd)
        out["a moved-on clock after load_state_dict(state_dict())"] = _obs(c)
        for key in list(sd) if isinstance(sd, dict) else ():
            sd[key] = 10 ** 6  # a checkpoint writer that edits its dict must not move the live clock
        out["the clock after the dict state_dict() returned was edited (return a copy)"] = _obs(a)
        out["the resumed clock, call by call"] = [{"step()": c.step(f), **_obs(c)} for f in resume]
        out["load_state_dict of a refused state"] = {why: _refused(c, s) for why, s in BAD_STATES.items()}
        return out
    return run


def _clock_reference(cfg, applied, resume) -> tuple:
    """What ``_drive_clock`` must observe (its structure exactly), from transformers' schedule and the counts."""
    def obs(u, s):
        return {"updates": u, "skipped": s, "lr": _wsd(u, cfg)}
    out = {"lr before any call": _wsd(0, cfg), "after each call": {}}
    u = s = 0
    for i, f in enumerate(applied):
        u, s = u + bool(f), s + (not f)
        out["after each call"][f"call {i} ({'applied' if f else 'SKIPPED'})"] = {"step()": obs(u, s)["lr"],
                                                                                **obs(u, s)}
    out["a second clock, built beside it (keep the counts on self, not on the class)"] = obs(0, 0)
    if resume is None:
        return (out,)
    out["state_dict()"] = {"updates": u, "skipped": s}
    out["a moved-on clock after load_state_dict(state_dict())"] = obs(u, s)
    out["the clock after the dict state_dict() returned was edited (return a copy)"] = obs(u, s)
    resumed = []
    for f in resume:
        u, s = u + bool(f), s + (not f)
        resumed.append({"step()": obs(u, s)["lr"], **obs(u, s)})
    out["the resumed clock, call by call"] = resumed
    out["load_state_dict of a refused state"] = {why: {"raised": "ValueError", "the clock after": obs(u, s)}
                                                 for why in BAD_STATES}
    return (out,)


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


def _random_skips(i: int, cfg: WSDConfig) -> list[bool]:
    g = torch.Generator().manual_seed(1200 + i)
    return (torch.rand(2 * cfg.total + 6, generator=g) > 0.3).tolist()


def _clock(configs, flags, resume=None):
    return [{"cfg": cfg, "applied": flags(i, cfg), "resume": resume} for i, cfg in enumerate(configs)]


CLOCK = Contract(
    "UpdateClock", lambda c: {"cfg": c["cfg"], "applied": c["applied"], "resume": c["resume"]}, _clock_reference,
    ("the clock",), tol=TOL, use=_drive_clock, ref_name=f"{WSD} at the applied count",
    draw=st.fixed_dictionaries({"cfg": DRAWN_CONFIGS, "applied": st.lists(st.booleans(), max_size=24),
                                "resume": st.none() | st.lists(st.booleans(), min_size=1, max_size=12)}),
    examples={"": _clock(CONFIGS + ZERO_LENGTH, lambda i, cfg: [True] * (cfg.total + 3)),
              "skips_at_boundaries": _clock(CONFIGS + ZERO_LENGTH, lambda i, cfg: _skip_at_boundaries(cfg)),
              "random_skips": _clock(CONFIGS + ZERO_LENGTH, _random_skips),
              "state_dict": _clock(CONFIGS + ZERO_LENGTH, _random_skips, [True, False, True, True])
              + _clock(CONFIGS[:2], lambda i, cfg: [], [False, True])})  # saved before any call


# --- the variant: cosine annealing with warm restarts ---------------------------------------


@lru_cache(maxsize=512)
def _sgdr(base_lr, cycle, mult, min_lr, n):
    """The learning rate of updates 0 .. n-1 from torch's CosineAnnealingWarmRestarts, stepped once per update."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=cycle, T_mult=mult, eta_min=min_lr)
    out = []
    for _ in range(n):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return tuple(out)


def _restarts_ref(update, base_lr, cycle, mult, min_lr):
    if update < 0 or cycle < 1 or mult < 1:
        return Raises(ValueError, f"update {update}, cycle {cycle}, mult {mult} (update < 0, cycle < 1 or mult < 1)")
    return (_sgdr(base_lr, cycle, mult, min_lr, update + 1)[update],)


def _restarts(base_lr, cycle, mult, min_lr, n):
    return [{"update": k, "base_lr": base_lr, "cycle": cycle, "mult": mult, "min_lr": min_lr} for k in range(n)]


RESTARTS = Contract(
    "cosine_restarts_lr", lambda c: {n: c[n] for n in ("update", "base_lr", "cycle", "mult", "min_lr")},
    _restarts_ref, ("lr",), returns=float, tol=TOL, defaults={"mult": 1, "min_lr": 0.0},
    ref_name="torch's CosineAnnealingWarmRestarts",
    draw=st.fixed_dictionaries({"update": st.integers(-1, 40), "base_lr": st.sampled_from([1.0, 3e-4, 2, 0.5]),
                                "cycle": st.integers(0, 9), "mult": st.integers(0, 3),
                                "min_lr": st.sampled_from([0.0, 0.05, 0])}),
    examples={"": [c for args in ((1.0, 5, 1, 0.0, 17), (3e-4, 3, 2, 3e-5, 30), (0.1, 1, 1, 0.0, 4),
                                  (2.0, 2, 3, 0.5, 30), (1e-3, 7, 1, 1e-4, 22), (2, 3, 2, 0, 8))
                   for c in _restarts(*args)]
              + [c for c in _restarts(0.1, 1, 10, 0.0, 115) if c["update"] >= 100]  # log(1000, 10) < 3 in floats
              + [{"update": u, "base_lr": 1.0, "cycle": L, "mult": g, "min_lr": 0.0}
                 for u, L, g in ((-1, 3, 1), (0, 0, 1), (2, 3, 0))]})  # refused: update < 0, cycle < 1, mult < 1


# --- the prediction: where decay begins when a GradScaler skips -----------------------------

EDGE = 27  # the scale 2**27 times a gradient of 2**100 is the largest finite float32 power of two here


@lru_cache(maxsize=512)
def _measure_skips(overflows: int, growth_interval: int, calls: int) -> tuple[bool, ...]:
    """One bool per call of ``calls`` optimizer calls through a real GradScaler whose initial scale is
    ``overflows`` doublings too large: True where the parameter changed (applied). Cached: it is deterministic."""
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


def _skips(warmup, stable, overflows, growth_interval):
    return _measure_skips(overflows, growth_interval, overflows + 2 * (warmup + stable) + 2)


def _measured(warmup, stable, overflows, growth_interval):
    flags = _skips(warmup, stable, overflows, growth_interval)
    applied = [c for c, f in enumerate(flags) if f]
    return applied[warmup + stable], sum(flags[:warmup + stable])


ARGS = ("warmup", "stable", "overflows", "growth_interval")
PREDICT = Contract(
    "predict_decay_entry", lambda c: dict(zip(ARGS, c["args"])), _measured, ("call", "naive_updates"),
    ref_name="the GradScaler loop's measurement",
    note=lambda c: f"skipped calls {[i for i, f in enumerate(_skips(*c['args'])) if not f]}",
    draw=st.fixed_dictionaries({"args": st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 9),
                                                  st.integers(1, 5))}),
    examples={"": [{"args": a} for a in ((3, 3, 2, 2), (0, 0, 0, 1), (4, 2, 9, 5), (2, 5, 0, 1), (6, 6, 3, 3),
                                         (1, 0, 1, 1), (5, 4, 4, 4))]})

CHECKS = checks(WSD_LR, CLOCK, RESTARTS, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex12.check_UpdateClock__random_skips, ...
