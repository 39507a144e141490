"""TRAIN-AMP-BACKWARD's overflow sample: FP16 with overflows injected into the book's one training step
(``bench.trainer.Trainer`` under the ``fp16`` strategy: ``bench.step.train_step`` with autocast, the
GradScaler, unscale before the clip and the LR clock), the GradScaler checked against
``loss_scaling.DynamicLossScaler``, the parameters left as they were on a skipped step, and the LR clock held. An
overflow is injected where it would happen: a forward hook multiplies the model's loss
(``bench.trainer.loss_times``), so the step's backward starts from a loss that overflowed.
"""

from __future__ import annotations

import copy
import math

import torch

from bp_mech import loss_scaling
from bp_mech.bench.compare import all_finite
from bp_mech.bench.oom import release_memory
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import LowPrecision, parse
from bp_mech.bench.trainer import Trainer, loss_times
from bp_mech.records.results import json_safe

# The overflow sample fails when the scaler never recovers (no applied update after the last
# injected overflow, or the scale falls below SCALE_FLOOR: scaling then shrinks the loss instead of
# lifting small gradients) or when its loss ends non-finite.
SCALE_FLOOR = 1.0
FP16 = parse("fp16")  # the overflow sample's strategy: autocast + GradScaler
TRACE = ("loss", "scale", "finite", "applied", "grad_norm", "clip_coef", "lr")  # a trace's lists, one entry per call


def trainer(model, cfg, device: str, growth_interval: int) -> Trainer:
    """The overflow sample's trainer: the one training step under ``fp16``; ``cfg``'s LR clock, clip
    threshold and initial scale (``experiments.amp.AmpConfig``)."""
    return Trainer.build(model, cfg.schedule, FP16, device=device, max_norm=cfg.max_norm,
                         init_scale=cfg.init_scale, growth_interval=growth_interval)


def counts(trace: dict) -> dict:
    """Record fields from a trace: applied and skipped optimizer calls."""
    applied = trace["applied"]
    return dict(updates=sum(applied), skipped_updates=len(applied) - sum(applied))


def overflow_sample(base, cfg, device: str, batches: list[dict]) -> dict:
    """FP16 + GradScaler with overflows injected at ``cfg.overflow_calls``; no timing.

    The trace has one entry per call: the loss the step saw (times the factor on an injected call), the
    scale after the call (the scaler's update: a back-off shows on the call that overflowed), finite,
    applied, the gradient norm and clip coefficient (None when not finite) and the LR of the call."""
    model = copy.deepcopy(base).to(device)
    with loss_times(model, cfg.overflow_factor * cfg.init_scale):  # the same injection in fp32: no update
        train_step(model, None, batches[0], update=False)
    fp32_ok = all_finite(p.grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    tr = trainer(model, cfg, device, cfg.overflow_growth_interval)
    ref = loss_scaling.DynamicLossScaler(cfg.init_scale, growth_interval=cfg.overflow_growth_interval)
    trace = {k: [] for k in TRACE}
    predicted, unchanged, held = [], [], []
    for c in range(cfg.overflow_n):
        before = [p.detach().clone() for p in model.parameters()]
        updates, lr = tr.clock.updates, tr.clock.lr
        with loss_times(model, cfg.overflow_factor if c in cfg.overflow_calls else 1.0):
            row = tr.step(batches[c % (len(batches) - 1)])
        for key, value in (("loss", row.loss), ("scale", tr.scaler.get_scale()), ("finite", row.finite),
                           ("applied", row.applied), ("grad_norm", row.grad_norm if row.finite else None),
                           ("clip_coef", row.clip_coef), ("lr", row.lr)):
            trace[key].append(value)
        ref.update(found_inf=not row.finite)
        predicted.append(ref.scale)
        if not row.applied:
            unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            held.append(tr.clock.updates == updates and tr.clock.lr == lr)
        del before
    s = trace["scale"]
    prev = [cfg.init_scale] + s[:-1]
    out = dict(trace=trace, predicted_scale=predicted, scaler_matches_reference=predicted == s,
               params_unchanged_on_skip=all(unchanged), clock_held_on_skip=all(held),
               fp32_finite_under_same_injection=fp32_ok, updates=tr.clock.updates, skipped=tr.clock.skipped,
               backoff_calls=[c for c in range(len(s)) if s[c] < prev[c]],
               growth_calls=[c for c in range(len(s)) if s[c] > prev[c]],
               failure=overflow_failure(trace, cfg.overflow_calls))
    del model, tr
    release_memory(device)
    return out


def overflow_failure(trace: dict, injected) -> str | None:
    """Why an overflow sample failed, or None: the scaler never recovered (no update applied after the
    last injected overflow, or the scale fell below SCALE_FLOOR), or the loss ended non-finite."""
    last, why = max(injected, default=-1), []
    if not any(trace["applied"][last + 1:]):
        why.append(f"the scaler never recovered: no update applied after the last injected overflow (call {last})")
    if min(trace["scale"]) < SCALE_FLOOR:
        why.append(f"the loss scale fell to {min(trace['scale']):g}, below SCALE_FLOOR {SCALE_FLOOR:g}")
    if not math.isfinite(trace["loss"][-1]):
        why.append("the loss ended non-finite")
    return "; ".join(why) or None


def overflow_record(ctx, name: str, r: dict, cfg):
    t = r["trace"]
    ok = r["scaler_matches_reference"] and r["params_unchanged_on_skip"] and r["clock_held_on_skip"]
    return ctx.record(
        name, dtype=LowPrecision.FP16.label, **counts(t), all_finite=all(t["finite"]),
        failure=r["failure"], next_step=None if ok else "scaler semantics differ from the reference",
        metrics=json_safe(dict(
            {k: v for k, v in r.items() if k not in ("trace", "failure")}, semantics_ok=ok,
            injected_calls=list(cfg.overflow_calls), overflow_factor=cfg.overflow_factor,
            growth_interval=cfg.overflow_growth_interval, scale_floor=SCALE_FLOOR, loss_scale_trace=t["scale"],
            finite_per_step=t["finite"], applied_per_step=t["applied"], lr_per_call=t["lr"],
            skipped_calls=[c for c, a in enumerate(t["applied"]) if not a])))
