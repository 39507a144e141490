"""Part 02 · 12 — TRAIN-SCHEDULER-CLOCK, the experiment: the clocks of ``bp_mech.scheduler`` in a real
GradScaler run with injected skips.

The workload's model trains with the book's one training step under the ``fp16`` strategy
(``bench.trainer.Trainer``: ``bench.step.train_step`` with autocast and a ``torch.amp.GradScaler``,
AdamW from ``make_adamw``) until the schedule's updates have all been applied. Some calls get a
loss blown up to inf (a forward hook multiplies the model's loss, ``bench.trainer.loss_times``: the
scaler skips them), one call the trainer skips itself (it runs no step; the clock is told). Both clocks
(``naive-clock``, ``update-clock``) see the same calls; a ``transformers`` WSD scheduler is stepped
beside each by its policy. The record holds the per-call trace, the boundaries in calls and in
effective updates, and the decision of ``decide``. Nothing is timed: the clock needs no
benchmark.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from bp_mech.bench.strategy import parse
from bp_mech.bench.trainer import Trainer, loss_times
from bp_mech.instruments.adamw import make_adamw
from bp_mech.scheduler import (DECAY_TYPES, NaiveClock, UpdateClock, WSDConfig, compare_with_transformers,
                               transformers_schedule, wsd_lr)
from bp_mech.instruments.workload import build_model, make_batches
from bp_mech.records.decision import Decision


@dataclass(frozen=True)
class ClockRun:
    # the WSD schedule the clocks read
    schedule: WSDConfig = WSDConfig(warmup=6, stable=10, decay=8, decay_type="cosine", min_lr_ratio=0.1)
    overflow_calls: tuple[int, ...] = (2, 3, 11)  # optimizer calls whose loss is blown up to inf
    explicit_skip_calls: tuple[int, ...] = (22,)  # calls the trainer skips itself (a spike guard)
    overflow_factor: float = 2.0**120  # loss x factor x scale (2^16) exceeds the fp32 maximum

    @property
    def optimizer_calls(self) -> int:
        """Calls until ``schedule.total`` updates have been applied: one more per skip."""
        return self.schedule.total + len(self.overflow_calls) + len(self.explicit_skip_calls)


CLOCKS = {"naive-clock": NaiveClock, "update-clock": UpdateClock}
CANDIDATES = tuple(CLOCKS)


def first_call_at(positions: list[int], boundary: int) -> int | None:
    """Index of the first call whose clock position has reached ``boundary``."""
    return next((c for c, p in enumerate(positions) if p >= boundary), None)


def train_with_clock(candidate: str, ctx, run_cfg: ClockRun = ClockRun()) -> dict:
    """Train the workload's model with the one training step under ``fp16`` (AdamW + GradScaler) until
    ``schedule.total`` updates have been applied, injecting overflows and explicit skips; return the
    per-call trace.

    ``lr``, ``ref_lr``, ``applied``, ``scale`` (the scaler's after the call) have one entry per call;
    ``position`` and ``effective`` (the clock before call c) have one more: the state after the last
    call.
    """
    cfg = run_cfg.schedule
    device = ctx.device
    model = build_model(ctx.workload, device)
    opt = make_adamw(model.parameters(), cfg.base_lr, device)
    clock = CLOCKS[candidate](cfg, opt)
    trainer = Trainer(model, opt, parse("fp16"), clock=clock, device=device)  # GradScaler: torch's defaults
    ref_opt, ref_sched = transformers_schedule(cfg)  # stepped per the candidate's policy
    batches = make_batches(ctx.workload, run_cfg.optimizer_calls, device=device)
    trace = dict(lr=[], position=[], applied=[], effective=[], scale=[], ref_lr=[], unchanged_on_skip=[])
    for c in range(run_cfg.optimizer_calls):
        trace["lr"].append(opt.param_groups[0]["lr"])
        trace["ref_lr"].append(ref_opt.param_groups[0]["lr"])
        trace["position"].append(clock.position)
        trace["effective"].append(clock.updates)
        before = [p.detach().clone() for p in model.parameters()]
        if c in run_cfg.explicit_skip_calls:
            applied = False  # the trainer decided not to step: no step runs, no update; the clock counts the call
            clock.step(applied)
        else:  # the step steps the clock, applied or skipped by the scaler
            with loss_times(model, run_cfg.overflow_factor if c in run_cfg.overflow_calls else 1.0):
                applied = trainer.step(batches[c]).applied
        if not applied:
            trace["unchanged_on_skip"].append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        trace["applied"].append(applied)
        trace["scale"].append(trainer.scaler.get_scale())
        if applied or candidate == "naive-clock":
            ref_opt.step()
            ref_sched.step()
    trace["position"].append(clock.position)  # after the last call: where the next one would read
    trace["effective"].append(clock.updates)
    trace.update(clock=clock, finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    return trace


def trace_summary(trace: dict, cfg: WSDConfig) -> dict:
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


# Decision rule: a clock is accepted when every boundary lands on its nominal effective update (all
# shifts 0) and the rate of every applied update equals wsd_lr at that update's true index exactly
# (the same float operations: no tolerance); otherwise it is rejected.

def decide(shifts: dict[str, int | None], lr_error_max: float) -> Decision:
    """One clock's decision from its ``trace_summary``, by the rule above.

    Args:
        shifts: per boundary, its effective update minus the nominal one (None: never
            reached).
        lr_error_max: the largest |rate - wsd_lr at the true index| of the applied
            updates.

    Returns:
        The ``Decision``; its reason names the shifted boundaries and the rate error.

    Example:
        >>> decide({"warmup_end": -2, "decay_start": 0}, 0.0).reason
        'boundaries off their nominal update: warmup_end by -2'
    """
    off = {k: v for k, v in shifts.items() if v != 0}
    if not off and lr_error_max == 0.0:
        return Decision("accept", f"every boundary ({', '.join(shifts)}) on time, "
                        "every applied rate equal to wsd_lr at its true index")
    why = []
    if off:
        why.append("boundaries off their nominal update: " + ", ".join(
            f"{k} never reached" if v is None else f"{k} by {v:+d}"
            for k, v in off.items()))
    if lr_error_max != 0.0:
        why.append(f"a rate off wsd_lr at its true index by {lr_error_max:.3g}")
    return Decision("reject", "; ".join(why),
                    "advance the LR clock only when optimizer.step() ran")


def run(ctx, run_cfg: ClockRun = ClockRun()) -> list:
    cfg = run_cfg.schedule
    recs = []
    for name in ctx.progress(CANDIDATES, desc="clocks"):
        t = train_with_clock(name, ctx, run_cfg)
        s = trace_summary(t, cfg)
        decided = decide(s["shifts"], s["lr_error_max"])
        recs.append(ctx.record(
            name, updates=sum(t["applied"]), skipped_updates=t["clock"].skipped,
            all_finite=t["finite"], **decided.record_fields(),
            metrics=dict(s, final_lr=t["clock"].lr, schedule=asdict(cfg) | {"total": cfg.total},
                         overflow_calls=list(run_cfg.overflow_calls),
                         explicit_skip_calls=list(run_cfg.explicit_skip_calls),
                         params_unchanged_on_skip=all(t["unchanged_on_skip"]),
                         lr_per_call=t["lr"], applied_per_call=t["applied"], effective_per_call=t["effective"],
                         loss_scale_per_call=t["scale"]),
        ))
    return recs


def dry_run(ctx, run_cfg: ClockRun = ClockRun()) -> dict:
    cfg = run_cfg.schedule
    return dict(schedule=asdict(cfg), boundaries=cfg.boundaries, optimizer_calls=run_cfg.optimizer_calls,
                overflow_calls=list(run_cfg.overflow_calls), explicit_skip_calls=list(run_cfg.explicit_skip_calls),
                note="CPU mechanism; the clock needs no GPU benchmark")


def conformance():
    """Our WSD values vs transformers.get_wsd_schedule (bitwise), and the clock vs a real
    GradScaler run with injected overflows (the skipped call must not move the clock)."""
    from bp_mech.records.registry import ConformanceRow, make_context

    worst = 0.0
    for decay_type in DECAY_TYPES:
        for m in (0.0, 0.1):
            cfg = WSDConfig(warmup=5, stable=7, decay=9, decay_type=decay_type, min_lr_ratio=m)
            worst = max(worst, compare_with_transformers(cfg)["max_abs_diff"])
    t = train_with_clock("update-clock", make_context("TRAIN-SCHEDULER-CLOCK", "cpu"), ClockRun())
    s = trace_summary(t, ClockRun().schedule)
    held = all(v == 0 for v in s["shifts"].values()) and s["transformers_max_abs_diff"] == 0.0
    ok = worst == 0.0 and held and all(t["unchanged_on_skip"])
    return ConformanceRow("Part 02 · 12", "TRAIN-SCHEDULER-CLOCK", "transformers get_wsd_schedule + torch GradScaler",
                          ok, f"max |lr diff| {worst:g} over linear/cosine x min_lr_ratio 0/0.1 (exact); "
                              f"{t['clock'].skipped} skipped calls left the clock and parameters unchanged: {held}")
