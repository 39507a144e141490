"""TRAIN-AMP-BACKWARD, the experiment: FP32 against FP16 autocast + GradScaler and BF16 autocast, plus
an overflow sample (the mechanism: ``bp_mech.amp``).

Every timed candidate trains its own model copy, AdamW, scaler and LR clock (``amp.AmpTrainer``) on the
shared harness's ``measure_separate``: interleaved on one CPU thread after one tracked update each (the
peak), one after another alone on CUDA. ``updates`` counts the optimizer calls that applied an update,
``skipped_updates`` those the scaler skipped: together every call of the run (CPU: tracked, warm-up and
timed; CUDA: warm-up and timed), ``len(metrics.applied_per_step)``. The overflow sample injects
overflows and checks GradScaler against ``amp.DynamicLossScaler``, the parameters and the LR clock.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from bp_mech import amp
from bp_mech.records.environment import bf16_supported
from bp_mech.experiments import harness
from bp_mech.bench.timing import SMOKE_SCHEDULE, timing_noise
from bp_mech.bench.compare import all_finite
from bp_mech.bench.oom import oom_as_failure, release_memory
from bp_mech.records.results import json_safe
from bp_mech.scheduler import WSDConfig, scaler_step
from bp_mech.bench.workload import PLAN_BASIS, PLAN_BUILD_S, build_model, make_batches, plan_seconds

CANDIDATES = ("fp32", "fp16-amp", "bf16-amp", "fp16-overflow")
LOW = {"fp32": None, "fp16-amp": torch.float16, "bf16-amp": torch.bfloat16, "fp16-overflow": torch.float16}
DTYPE_LABEL = {None: "float32", torch.float16: "float16-autocast", torch.bfloat16: "bfloat16-autocast"}

# Decision rule for an AMP candidate, from ratios to the FP32 run of the same workload:
#   reject  if a step applied non-finite gradients, the skipped fraction exceeds
#           MAX_SKIPPED_FRACTION, or |eval loss - FP32's| / FP32's exceeds LOSS_REL_TOL;
#   tune    if its peak saving (1 - peak / FP32's peak) is below MIN_PEAK_SAVING (no memory win here);
#   none    if the time ratio is noise (``measure.timing_noise``): the time decides nothing;
#   accept  if its median step is at most (1 + MAX_TIME_COST) x FP32's;
#   tune    otherwise (numerically fine and smaller, but too slow here).
# FP16 and BF16 do not do strictly more work than FP32 (autocast's casts are not counted work), so
# only the spread between the median and the P95 ratio can make their time ratio noise.
LOSS_REL_TOL = 0.02
MIN_PEAK_SAVING = 0.05
MAX_TIME_COST = 0.10
MAX_SKIPPED_FRACTION = 0.25
# The overflow sample fails when the scaler never recovers (no applied update after the last
# injected overflow, or the scale falls below SCALE_FLOOR: scaling then shrinks the loss instead of
# lifting small gradients) or when its loss ends non-finite.
SCALE_FLOOR = 1.0
CONFORMANCE_TOL = 1e-6  # float32: unscale + clip against GradScaler.unscale_ + clip_grad_norm_, relative


@dataclass(frozen=True)
class AmpConfig:
    timed: int = 60  # timed steps per candidate (CPU: interleaved rounds, one step of each candidate per round)
    warmup: int = 3  # untimed steps (rounds) before them; the CPU runs one tracked update (the peak) first
    max_norm: float = 1.0  # clip threshold on the unscaled gradient norm
    schedule: WSDConfig = WSDConfig(base_lr=1e-3, warmup=2, stable=100, decay=10)  # the LR clock
    init_scale: float = 2.0**16  # GradScaler's initial loss scale (torch's default)
    growth_interval: int = 2000  # regular fp16 candidate: torch's default
    overflow_calls: tuple[int, ...] = (2, 3, 8)  # overflow sample: calls with an injected overflow
    overflow_factor: float = 2.0**24  # loss multiplier: finite in fp32, beyond 65504 in fp16 grads
    overflow_growth_interval: int = 3  # short, so that growth shows within the sample
    overflow_n: int = 12  # optimizer calls in the overflow sample


CPU_CONFIG = AmpConfig()
# One GPU (qwen05): 20 timed steps, and a base LR usual for a 0.5B model; at 1e-3 the FP32 and
# AMP trajectories would drift apart for reasons other than precision within 20 updates.
GPU_CONFIG = AmpConfig(timed=20, warmup=3, schedule=WSDConfig(base_lr=1e-4, warmup=2, stable=100, decay=10))
SETUP_S = {"cuda": 2.0, "cpu": 0.5}  # plan: per candidate, copy the model to the device, first calls


def config_for(device, smoke: bool = False) -> AmpConfig:
    cfg = GPU_CONFIG if torch.device(device).type == "cuda" else CPU_CONFIG
    return dataclasses.replace(cfg, timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1]) if smoke else cfg


def available(candidate: str, device: str) -> bool:
    """BF16 only where the device and PyTorch report support; the others always."""
    return LOW[candidate] is not torch.bfloat16 or bf16_supported(torch.device(device).type)


def trainer(model, candidate: str, cfg: AmpConfig, device: str, growth_interval: int | None = None) -> amp.AmpTrainer:
    """The candidate's trainer: its autocast dtype; cfg's LR clock, clip threshold and initial scale."""
    return amp.AmpTrainer(model, LOW[candidate], device, cfg.schedule, cfg.max_norm, cfg.init_scale,
                          cfg.growth_interval if growth_interval is None else growth_interval)


class TrainerSteps:
    """``step(i)`` for ``harness.measure_separate``: one update of ``trainer`` on ``batches[i + 1]`` (the
    tracked step, ``i = -1``, on ``batches[0]``); it carries the trainer to ``finish``."""

    def __init__(self, trainer: amp.AmpTrainer, batches: list[dict]) -> None:
        self.trainer, self.batches = trainer, batches

    def __call__(self, i: int) -> bool:
        return self.trainer.step(self.batches[i + 1])


def finish(tr: amp.AmpTrainer, held_out: dict) -> dict:
    """What a timed candidate reports besides its stats: trace, counts, and the plain-FP32 loss on the
    held-out batch (no autocast), the yardstick across candidates."""
    with torch.no_grad():
        eval_loss = tr.model(**held_out).loss.item()
    return dict(trace=tr.trace, updates=tr.clock.updates, skipped=tr.clock.skipped, eval_loss=eval_loss,
                finite_params=all_finite(tr.model.parameters()))


def measure(base, names, cfg: AmpConfig, device: str, batches: list[dict], progress=None,
            interleave: bool | None = None) -> dict:
    """``{name: (result, None) | (None, failure)}`` for the timed candidates (``harness.measure_separate``):
    each trains its own copy of ``base`` (kept on the host). Step ``i`` trains on ``batches[i + 1]``;
    ``batches[0]`` is the CPU's tracked update, ``batches[-1]`` is held out. ``result`` holds ``stats``,
    ``steps`` and what ``finish`` reads."""
    def prepare(name, together):
        tr = trainer(copy.deepcopy(base).to(device), name, cfg, device)
        return TrainerSteps(tr, batches), [tr.model.parameters()]  # AdamW's state appears in the first step

    return harness.measure_separate(prepare, names, device, cfg.timed, cfg.warmup, progress=progress,
                                    finish=lambda name, step, stats: finish(step.trainer, batches[-1]),
                                    interleave=interleave)


def overflow_sample(base, candidate: str, cfg: AmpConfig, device: str, batches: list[dict]) -> dict:
    """FP16 + GradScaler with overflows injected at ``cfg.overflow_calls``; no timing."""
    model = copy.deepcopy(base).to(device)
    (model(**batches[0]).loss * (cfg.overflow_factor * cfg.init_scale)).backward()  # the same injection in fp32
    fp32_ok = all_finite(p.grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    tr = trainer(model, candidate, cfg, device, cfg.overflow_growth_interval)
    ref = amp.DynamicLossScaler(cfg.init_scale, growth_interval=cfg.overflow_growth_interval)
    predicted, unchanged, held = [], [], []
    for c in range(cfg.overflow_n):
        before = [p.detach().clone() for p in model.parameters()]
        updates, lr = tr.clock.updates, tr.clock.lr
        applied = tr.step(batches[c % (len(batches) - 1)], cfg.overflow_factor if c in cfg.overflow_calls else 1.0)
        ref.update(found_inf=not tr.trace["finite"][-1])
        predicted.append(ref.scale)
        if not applied:
            unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            held.append(tr.clock.updates == updates and tr.clock.lr == lr)
        del before
    s = tr.trace["scale"]
    prev = [cfg.init_scale] + s[:-1]
    out = dict(trace=tr.trace, predicted_scale=predicted, scaler_matches_reference=predicted == s,
               params_unchanged_on_skip=all(unchanged), clock_held_on_skip=all(held),
               fp32_finite_under_same_injection=fp32_ok, updates=tr.clock.updates, skipped=tr.clock.skipped,
               backoff_calls=[c for c in range(len(s)) if s[c] < prev[c]],
               growth_calls=[c for c in range(len(s)) if s[c] > prev[c]],
               failure=overflow_failure(tr.trace, cfg.overflow_calls))
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


def decide(finite: bool, skipped_fraction: float, loss_rel_diff: float, peak_saving: float, time_ratio: float,
           noise: str | None = None):
    """(decision, next_step) by the rule stated above the constants."""
    if not finite or skipped_fraction > MAX_SKIPPED_FRACTION or not loss_rel_diff <= LOSS_REL_TOL:
        return "reject", "non-finite, too many skipped steps, or loss off FP32 beyond tolerance: keep FP32 here"
    if not peak_saving >= MIN_PEAK_SAVING:
        return "tune", "numerically fine, but no memory saving on this device: measure on the target GPU"
    if noise is not None:
        return None, (f"numerically fine and saves memory, but the time ratio is noise ({noise}): "
                      "time it on the target GPU or a quiet machine")
    if time_ratio <= 1 + MAX_TIME_COST:
        return "accept", None
    return "tune", "numerically fine and saves memory, but too slow on this device: measure on the target GPU"


def counts(trace: dict) -> dict:
    """Record fields from a trace: applied and skipped optimizer calls."""
    applied = trace["applied"]
    return dict(updates=sum(applied), skipped_updates=len(applied) - sum(applied))


def overflow_record(ctx, name: str, r: dict, cfg: AmpConfig):
    t = r["trace"]
    ok = r["scaler_matches_reference"] and r["params_unchanged_on_skip"] and r["clock_held_on_skip"]
    return ctx.record(
        name, dtype=DTYPE_LABEL[LOW[name]], **counts(t), update_count=r["updates"], all_finite=all(t["finite"]),
        failure=r["failure"], next_step=None if ok else "scaler semantics differ from the reference",
        metrics=json_safe(dict(
            {k: v for k, v in r.items() if k not in ("trace", "failure")}, semantics_ok=ok,
            injected_calls=list(cfg.overflow_calls), overflow_factor=cfg.overflow_factor,
            growth_interval=cfg.overflow_growth_interval, scale_floor=SCALE_FLOOR, loss_scale_trace=t["scale"],
            finite_per_step=t["finite"], applied_per_step=t["applied"], lr_per_call=t["lr"],
            skipped_calls=[c for c, a in enumerate(t["applied"]) if not a])))


def timed_record(ctx, name: str, r: dict, fp32: dict | None, cfg: AmpConfig):
    """A timed candidate's record; ratios and decision against ``fp32`` (its result, None if it failed)."""
    t, stats, dtype = r["trace"], r["stats"], DTYPE_LABEL[LOW[name]]
    finite = r["finite_params"] and math.isfinite(r["eval_loss"]) and all(
        f for f, a in zip(t["finite"], t["applied"]) if a)
    metrics = dict(eval_loss=r["eval_loss"], loss_scale_trace=t["scale"], finite_per_step=t["finite"],
                   applied_per_step=t["applied"], loss_per_step=t["loss"], grad_norm_per_step=t["grad_norm"],
                   clip_coef_per_step=t["clip_coef"], scaler=LOW[name] is torch.float16, autocast_dtype=dtype,
                   base_lr=cfg.schedule.base_lr, step_samples_s=stats.timing.samples,
                   interleaved=stats.timing.interleaved)
    fields = dict(dtype=dtype, **counts(t), update_count=r["updates"], all_finite=finite,
                  peak_allocated=stats.peak_allocated, peak_reserved=stats.peak_reserved,
                  step_median_s=stats.timing.median_s, step_p95_s=stats.timing.p95_s,
                  warmup_excluded=stats.timing.warmup_excluded, threads=stats.timing.threads,
                  memory_source=stats.memory_source)
    if name == "fp32":
        metrics["role"] = "baseline"
    elif fp32 is None:
        fields["next_step"] = "no FP32 baseline to compare with (it failed): see its record"
    else:
        base = fp32["stats"]
        noise = timing_noise(stats.timing, base.timing, more_work=False)
        ratios = dict(peak_saving=1 - stats.peak_allocated / base.peak_allocated,
                      time_ratio=stats.timing.median_s / base.timing.median_s,
                      p95_ratio=stats.timing.p95_s / base.timing.p95_s, loss_diff=r["eval_loss"] - fp32["eval_loss"],
                      loss_rel_diff=abs(r["eval_loss"] - fp32["eval_loss"]) / abs(fp32["eval_loss"]))
        metrics.update(ratios)
        fields["timing_noise"] = noise
        fields["decision"], fields["next_step"] = decide(
            finite, fields["skipped_updates"] / len(t["applied"]), ratios["loss_rel_diff"], ratios["peak_saving"],
            ratios["time_ratio"], noise=noise)
    return ctx.record(name, metrics=json_safe(metrics), **fields)  # a diverged run's NaN -> null


def run(ctx) -> list:
    cfg, device = config_for(ctx.device, ctx.smoke), ctx.device
    # one init (on the device: fast), kept on the host so that no candidate's peak holds it; copied per candidate
    base = build_model(ctx.workload, device).to("cpu")
    batches = make_batches(ctx.workload, cfg.warmup + cfg.timed + 2, device=device)  # [0]: tracked, [-1]: held out
    names = [c for c in CANDIDATES if available(c, device)]
    timed = measure(base, [n for n in names if n != "fp16-overflow"], cfg, device, batches, ctx.progress)
    fp32 = timed.get("fp32", (None,))[0]
    recs = []
    for name in names:
        if name == "fp16-overflow":
            r, failure = oom_as_failure(overflow_sample, base, name, cfg, device, batches)  # an OOM is its failure
        else:
            r, failure = timed[name]
        if failure:
            recs.append(ctx.record(name, dtype=DTYPE_LABEL[LOW[name]], failure=failure,
                                   next_step="failed: see the failure"))
        else:
            recs.append(overflow_record(ctx, name, r, cfg) if name == "fp16-overflow"
                        else timed_record(ctx, name, r, fp32, cfg))
    return recs


def plan(ctx) -> dict:
    """Per mode, the config and a planning estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, tokens = ctx.workload, ctx.workload.batch * ctx.workload.seq

    def mode_plan(dev):
        cfg = config_for(dev, ctx.smoke)
        steps = harness.separate_steps(dev, cfg.timed, cfg.warmup)
        seconds = {}
        for c in CANDIDATES:
            overflow = c == "fp16-overflow"
            seconds[c] = round(SETUP_S[dev] + plan_seconds(w.arch, tokens, cfg.overflow_n if overflow else steps, dev,
                                                           low=LOW[c] is not None)
                               + plan_seconds(w.arch, tokens, 1 if overflow else 1 / 3, dev), 1)  # fp32 inject / eval
        return cfg.timed, cfg.warmup, dict(config=asdict(cfg), estimated_seconds_per_candidate=seconds,
                                           estimated_seconds=round(PLAN_BUILD_S[dev] + sum(seconds.values()), 1))

    return dict(modes=harness.plan_separate(mode_plan),
                estimate_basis=f"{PLAN_BASIS}; + SETUP_S {SETUP_S} s per candidate",
                rule=dict(LOSS_REL_TOL=LOSS_REL_TOL, MIN_PEAK_SAVING=MIN_PEAK_SAVING, MAX_TIME_COST=MAX_TIME_COST,
                          MAX_SKIPPED_FRACTION=MAX_SKIPPED_FRACTION))


def conformance():
    """DynamicLossScaler vs torch.amp.GradScaler (scale and skips over an overflow pattern), and
    unscale_and_clip_ vs GradScaler.unscale_ + clip_grad_norm_ (float32, CPU)."""
    from bp_mech.records.registry import ConformanceRow

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler, ours, same = torch.amp.GradScaler("cpu", growth_interval=3), amp.DynamicLossScaler(growth_interval=3), True
    for found_inf in (False, False, True, False, False, False, True, True, False, False, False, False):
        opt.zero_grad()
        scaler.scale(p.sum() * (math.inf if found_inf else 1.0)).backward()
        before = p.detach().clone()
        skipped = not scaler_step(scaler, opt)
        same &= ours.update(found_inf) == skipped == torch.equal(before, p.detach())
        same &= ours.scale == scaler.get_scale()
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Linear(16, 8)
    ref_opt, ref_scaler = torch.optim.SGD(w.parameters(), lr=0.0), torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ref_scaler.scale(w(torch.randn(4, 16, generator=g)).pow(2).sum()).backward()
    mine = [q.grad.clone() for q in w.parameters()]  # scaled by 2^16
    norm, _, _ = amp.unscale_and_clip_(mine, 2.0**16, 0.5)
    ref_scaler.unscale_(ref_opt)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(w.parameters(), 0.5))
    err = max([abs(norm - ref_norm) / ref_norm] + [((a - q.grad).abs().max() / q.grad.abs().max()).item()
                                                   for a, q in zip(mine, w.parameters())])
    return ConformanceRow("Mixed-precision backward", "TRAIN-AMP-BACKWARD",
                          "torch.amp.GradScaler + clip_grad_norm_", same and err <= CONFORMANCE_TOL,
                          f"scaler model equals GradScaler's scale and skips over 12 steps: {same}; "
                          f"unscale+clip max rel. error {err:.1e} (tol {CONFORMANCE_TOL:g}, float32)")

