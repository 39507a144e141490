"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK: a warmup–stable–decay schedule on an update clock.

A WSD schedule (Hu et al. 2024, "MiniCPM", §4; the formula of ``transformers.get_wsd_schedule``)
maps the index ``k`` of an *effective* update to a learning rate. With W, S, D the warmup,
stable and decay lengths and m = ``min_lr_ratio``::

    k <  W            lr = base * (m + (1 - m) * k / W)                     (linear warmup)
    W <= k < W+S      lr = base                                             (stable)
    W+S <= k < W+S+D  lr = base * (m + (1 - m) * f(p)),  p = (k - W - S) / D
                      f(p) = 1 - p (linear) or (1 + cos(pi p)) / 2 (cosine)  (decay)
    k >= W+S+D        lr = base * m

The clock that supplies ``k`` must count **successful updates only**. A step the AMP scaler
skips (non-finite gradients) or the trainer skips on purpose changes no parameter, so it must
not move warmup, stable or decay. ``UpdateClock`` does that; ``NaiveClock`` is the common bug
(``scheduler.step()`` after every optimizer call) and shifts every boundary earlier by the
number of skips before it.

Skip detection relies on public ``torch.amp.GradScaler`` API only (``scaler_step``):
``update()`` multiplies the scale by ``backoff_factor < 1`` exactly when the step found
inf/NaN, which is exactly when ``step()`` did not call ``optimizer.step()``; so a smaller
``get_scale()`` after ``update()`` means "skipped". (Accelerate does the same job with
``AcceleratedOptimizer.step_was_skipped``, which its scheduler wrapper consults.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

DECAY_TYPES = ("linear", "cosine")


@dataclass(frozen=True)
class WSDConfig:
    base_lr: float = 1e-3  # peak learning rate (the stable value)
    warmup: int = 6  # W: updates of linear warmup from min_lr_ratio * base_lr up to base_lr
    stable: int = 10  # S: updates at base_lr
    decay: int = 8  # D: updates of decay from base_lr down to min_lr_ratio * base_lr
    decay_type: str = "cosine"  # "linear" or "cosine" (half a cosine wave)
    min_lr_ratio: float = 0.0  # m: floor as a fraction of base_lr (also where warmup starts)

    def __post_init__(self) -> None:
        if self.decay_type not in DECAY_TYPES:
            raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {self.decay_type!r}")
        if min(self.warmup, self.stable, self.decay) < 0:
            raise ValueError("warmup, stable and decay must be >= 0")

    @property
    def total(self) -> int:
        return self.warmup + self.stable + self.decay

    @property
    def boundaries(self) -> dict[str, int]:
        """The effective update at which each phase ends (warmup end = first full-LR update)."""
        return {"warmup_end": self.warmup, "decay_start": self.warmup + self.stable, "end": self.total}


def wsd_factor(update: int, cfg: WSDConfig) -> float:
    """The LR multiplier at effective update ``update`` (0-based), as transformers computes it."""
    W, S, D, m = cfg.warmup, cfg.stable, cfg.decay, cfg.min_lr_ratio
    if update < W:
        progress = float(update) / float(max(1, W))
        return max(0.0, progress * (1.0 - m) + m)
    if update < W + S:
        return 1.0
    if update < W + S + D:
        progress = float(update - W - S) / float(max(1, D))
        f = 1.0 - progress if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, f * (1.0 - m) + m)
    return m


def wsd_lr(update: int, cfg: WSDConfig) -> float:
    """lr = base_lr * wsd_factor(update); LambdaLR multiplies the same way."""
    return cfg.base_lr * wsd_factor(update, cfg)


class UpdateClock:
    """The LR clock of a training loop: advances only when an update was applied.

    ``lr`` is the learning rate of the *next* update, ``wsd_lr(position)``; before any call it
    is ``wsd_lr(0)`` (as ``LambdaLR`` right after construction). ``step(applied)`` is called
    once per optimizer call; with an optimizer attached it writes ``lr`` into every param group.
    """

    def __init__(self, cfg: WSDConfig, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.updates = 0  # successful updates so far
        self.skipped = 0  # optimizer calls that changed nothing
        self._apply()

    @property
    def calls(self) -> int:
        return self.updates + self.skipped

    @property
    def position(self) -> int:
        """The count the schedule is read at."""
        return self.updates

    @property
    def lr(self) -> float:
        return wsd_lr(self.position, self.cfg)

    def step(self, applied: bool) -> float:
        if applied:
            self.updates += 1
        else:
            self.skipped += 1
        self._apply()
        return self.lr

    def _apply(self) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr


class NaiveClock(UpdateClock):
    """The bug: reads the schedule at the number of optimizer *calls*, skipped ones included."""

    @property
    def position(self) -> int:
        return self.calls


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer)`` + ``scaler.update()``; True when ``optimizer.step()`` ran.

    Public API only: the scale shrinks in ``update()`` iff the step found inf/NaN, which is
    iff ``step()`` skipped ``optimizer.step()``. A disabled scaler always steps (scale 1.0).
    """
    if scaler.is_enabled() and not scaler.get_backoff_factor() < 1.0:
        raise ValueError("skip detection needs backoff_factor < 1")
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not scaler.get_scale() < before


# --- cross-check against transformers ----------------------------------------------

def transformers_schedule(cfg: WSDConfig):
    """(dummy optimizer, ``transformers.get_wsd_schedule``) for ``cfg``; step both together."""
    from transformers import get_wsd_schedule

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.base_lr)
    sched = get_wsd_schedule(opt, cfg.warmup, cfg.decay, num_stable_steps=cfg.stable,
                             decay_type=cfg.decay_type, min_lr_ratio=cfg.min_lr_ratio)
    return opt, sched


def compare_with_transformers(cfg: WSDConfig, extra: int = 3) -> dict:
    """LR at every update 0 .. total+extra-1: ours vs ``get_wsd_schedule``, no skips.

    Returns ``ours``, ``theirs`` (lists) and ``max_abs_diff`` (0.0 means bitwise equal).
    """
    opt, sched = transformers_schedule(cfg)
    ours, theirs = [], []
    for k in range(cfg.total + extra):
        ours.append(wsd_lr(k, cfg))
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: a no-op, but it keeps LambdaLR's ordering check quiet
        sched.step()
    return dict(ours=ours, theirs=theirs, max_abs_diff=max(abs(a - b) for a, b in zip(ours, theirs)))


# --- the experiment: a real GradScaler run with injected skips --------------------


@dataclass(frozen=True)
class ClockRun:
    schedule: WSDConfig = WSDConfig(warmup=6, stable=10, decay=8, decay_type="cosine", min_lr_ratio=0.1)
    overflow_calls: tuple[int, ...] = (2, 3, 11)  # optimizer calls whose loss is blown up to inf
    explicit_skip_calls: tuple[int, ...] = (22,)  # calls the trainer skips itself (a spike guard)
    overflow_factor: float = 2.0**120  # loss x factor x scale (2^16) exceeds the fp32 maximum


CANDIDATES = ("naive-clock", "update-clock")
CLOCKS = {"naive-clock": NaiveClock, "update-clock": UpdateClock}


def first_call_at(positions: list[int], boundary: int) -> int | None:
    """Index of the first call whose clock position has reached ``boundary``."""
    return next((c for c, p in enumerate(positions) if p >= boundary), None)


def train_with_clock(candidate: str, ctx, run_cfg: ClockRun = ClockRun()) -> dict:
    """Train the workload's model with AdamW + GradScaler until ``schedule.total`` updates
    have been applied, injecting overflows and explicit skips; return the per-call trace.

    ``lr``, ``ref_lr``, ``applied``, ``scale`` have one entry per call; ``position`` and
    ``effective`` (the clock before call c) have one more: the state after the last call.
    """
    from bp_mech.workload import build_model, make_batches

    cfg = run_cfg.schedule
    device = ctx.device
    model = build_model(ctx.workload, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.base_lr)
    clock = CLOCKS[candidate](cfg, opt)
    ref_opt, ref_sched = transformers_schedule(cfg)  # stepped per the candidate's policy
    scaler = torch.amp.GradScaler(torch.device(device).type)
    n_calls = cfg.total + len(run_cfg.overflow_calls) + len(run_cfg.explicit_skip_calls)
    batches = make_batches(ctx.workload, n_calls, device=device)
    trace = dict(lr=[], position=[], applied=[], effective=[], scale=[], ref_lr=[], unchanged_on_skip=[])
    for c in range(n_calls):
        trace["lr"].append(opt.param_groups[0]["lr"])
        trace["ref_lr"].append(ref_opt.param_groups[0]["lr"])
        trace["position"].append(clock.position)
        trace["effective"].append(clock.updates)
        opt.zero_grad(set_to_none=True)
        loss = model(**batches[c]).loss
        if c in run_cfg.overflow_calls:
            loss = loss * run_cfg.overflow_factor
        before = [p.detach().clone() for p in model.parameters()]
        if c in run_cfg.explicit_skip_calls:
            applied = False  # the trainer decided not to step: no scaler.step, no update
        else:
            scaler.scale(loss).backward()
            applied = scaler_step(scaler, opt)
        if not applied:
            trace["unchanged_on_skip"].append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        trace["applied"].append(applied)
        trace["scale"].append(scaler.get_scale())
        clock.step(applied)
        if applied or candidate == "naive-clock":
            ref_opt.step()
            ref_sched.step()
    trace["position"].append(clock.position)  # after the last call: where the next one would read
    trace["effective"].append(clock.updates)
    trace.update(clock=clock, finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    return trace


def summarize(trace: dict, cfg: WSDConfig) -> dict:
    """Boundaries in calls and in effective updates, their shifts, and the LR error."""
    b_calls = {k: first_call_at(trace["position"], v) for k, v in cfg.boundaries.items()}
    b_eff = {k: (None if c is None else trace["effective"][c]) for k, c in b_calls.items()}
    shifts = {k: (None if b_eff[k] is None else b_eff[k] - cfg.boundaries[k]) for k in b_eff}
    applied = [c for c, a in enumerate(trace["applied"]) if a]
    lr_err = max(abs(trace["lr"][c] - wsd_lr(trace["effective"][c], cfg)) for c in applied)
    ref_diff = max(abs(a - b) for a, b in zip(trace["lr"], trace["ref_lr"]))
    past_end = sum(1 for c in applied if trace["position"][c] >= cfg.total)  # updates run after the schedule ended
    return dict(nominal=cfg.boundaries, boundaries_calls=b_calls, boundaries_effective=b_eff, shifts=shifts,
                lr_error_max=lr_err, transformers_max_abs_diff=ref_diff, updates_past_end=past_end,
                skipped_calls=[c for c, a in enumerate(trace["applied"]) if not a])


def run(ctx, run_cfg: ClockRun = ClockRun()) -> list:
    cfg = run_cfg.schedule
    recs = []
    for name in ctx.progress(CANDIDATES, desc="clocks"):
        t = train_with_clock(name, ctx, run_cfg)
        s = summarize(t, cfg)
        ok = all(v == 0 for v in s["shifts"].values()) and s["lr_error_max"] == 0.0
        recs.append(ctx.record(
            name, updates=sum(t["applied"]), update_count=t["clock"].updates, skipped_updates=t["clock"].skipped,
            all_finite=t["finite"], decision="accept" if ok else "reject",
            next_step=None if ok else "advance the LR clock only when optimizer.step() ran",
            metrics=dict(s, final_lr=t["clock"].lr, schedule=asdict(cfg) | {"total": cfg.total},
                         overflow_calls=list(run_cfg.overflow_calls),
                         explicit_skip_calls=list(run_cfg.explicit_skip_calls),
                         params_unchanged_on_skip=all(t["unchanged_on_skip"]),
                         lr_per_call=t["lr"], applied_per_call=t["applied"], effective_per_call=t["effective"],
                         loss_scale_per_call=t["scale"]),
        ))
    return recs


def plan(ctx, run_cfg: ClockRun = ClockRun()) -> dict:
    cfg = run_cfg.schedule
    return dict(schedule=asdict(cfg), boundaries=cfg.boundaries,
                optimizer_calls=cfg.total + len(run_cfg.overflow_calls) + len(run_cfg.explicit_skip_calls),
                overflow_calls=list(run_cfg.overflow_calls), explicit_skip_calls=list(run_cfg.explicit_skip_calls),
                note="CPU mechanism; the clock needs no GPU benchmark")


def conformance():
    """Our WSD values vs transformers.get_wsd_schedule (bitwise), and the clock vs a real
    GradScaler run with injected overflows (the skipped call must not move the clock)."""
    from bp_mech.registry import ConformanceRow, make_context

    worst = 0.0
    for decay_type in DECAY_TYPES:
        for m in (0.0, 0.1):
            cfg = WSDConfig(warmup=5, stable=7, decay=9, decay_type=decay_type, min_lr_ratio=m)
            worst = max(worst, compare_with_transformers(cfg)["max_abs_diff"])
    t = train_with_clock("update-clock", make_context("TRAIN-SCHEDULER-CLOCK", "cpu"), ClockRun())
    s = summarize(t, ClockRun().schedule)
    held = all(v == 0 for v in s["shifts"].values()) and s["transformers_max_abs_diff"] == 0.0
    ok = worst == 0.0 and held and all(t["unchanged_on_skip"])
    return ConformanceRow("Part 02 · 12", "TRAIN-SCHEDULER-CLOCK", "transformers get_wsd_schedule + torch GradScaler",
                          ok, f"max |lr diff| {worst:g} over linear/cosine x min_lr_ratio 0/0.1 (exact); "
                              f"{t['clock'].skipped} skipped calls left the clock and parameters unchanged: {held}")
