"""TRAIN-AMP-BACKWARD, the experiment: plain FP32 against the strategies ``fp16`` (autocast + GradScaler) and
``bf16`` (autocast), plus an overflow sample (the mechanism: ``bp_mech.amp``).

Every timed arm trains its own model copy, AdamW, scaler and LR clock with the one training step
(``bench.step.train_step`` under its strategy, clipping at ``max_norm`` after unscaling, the clock
advancing on applied updates only), measured by the harness (``harness.measure``, own weights):
interleaved on one CPU thread, one after another alone on CUDA. One warm update first allocates
AdamW's moments. ``updates`` counts the steps that applied an update, ``skipped_updates`` those the
scaler skipped: together every step of the measurement (warm, tracked, warm-up and timed),
``len(metrics.applied_per_step)``, the warm update first. The overflow
sample (``experiments.amp_overflow``) injects overflows into the same step (``bench.trainer.Trainer``
under ``fp16``) and checks GradScaler against ``loss_scaling.DynamicLossScaler``, the parameters and the LR clock.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from bp_mech import amp, loss_scaling
from bp_mech.bench.compare import all_finite
from bp_mech.bench.oom import Failed, attempt
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.strategy import Entered, LowPrecision, Strategy, parse
from bp_mech.bench.timing import SMOKE_SCHEDULE, timing_noise
from bp_mech.instruments.workload import build_model, make_batches
from bp_mech.instruments.adamw import make_adamw
from bp_mech.experiments import decision, harness
from bp_mech.experiments.amp_overflow import overflow_record, overflow_sample
from bp_mech.experiments.dry_run import own_weights_modes, steps_per_arm
from bp_mech.records.decision import Decision
from bp_mech.records.environment import bf16_supported
from bp_mech.records.results import json_safe
from bp_mech.scheduler import UpdateClock, WSDConfig, scaler_step, wsd_lr
from bp_mech.update_dynamics import clip_coefficient

CANDIDATES = ("plain", "fp16", "bf16", "fp16-overflow")  # strategy names, and the overflow sample
TIMED = {name: parse(name) for name in ("plain", "fp16", "bf16")}  # the arms measured with the one step
OVERFLOW = "-overflow"  # the overflow sample's suffix on the strategy it runs under (fp16)

# Decision rule for an AMP candidate, from ratios to the FP32 run of the same workload:
#   reject  if a step applied non-finite gradients, the skipped fraction exceeds
#           MAX_SKIPPED_FRACTION, or |eval loss - FP32's| / FP32's exceeds LOSS_REL_TOL;
#   tune    if its peak saving (1 - peak / FP32's peak) is below decision.MIN_PEAK_SAVING, the floor
#           every memory strategy shares (no memory win here);
#   none    if the time ratio is noise (``measure.timing_noise``): the time decides nothing;
#   accept  if its median step is at most (1 + MAX_TIME_COST) x FP32's;
#   tune    otherwise (numerically fine and smaller, but too slow here).
# FP16 and BF16 do not do strictly more work than FP32 (autocast's casts are not counted work), so
# only the spread between the median and the P95 ratio can make their time ratio noise.
LOSS_REL_TOL = 0.02
MAX_TIME_COST = 0.10
MAX_SKIPPED_FRACTION = 0.25
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
SETUP_S = {"cuda": 2.0, "cpu": 0.5}  # dry run: per candidate, copy the model to the device, first calls


def config_for(device, smoke: bool = False) -> AmpConfig:
    cfg = GPU_CONFIG if torch.device(device).type == "cuda" else CPU_CONFIG
    return dataclasses.replace(cfg, timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1]) if smoke else cfg


def strategy_of(candidate: str) -> Strategy:
    """The strategy a candidate's steps run under: its own name, the overflow sample ``fp16``'s."""
    return parse(candidate.removesuffix(OVERFLOW))


def available(candidate: str, device: str) -> bool:
    """BF16 only where the device and PyTorch report support; the others always."""
    return strategy_of(candidate).amp is not LowPrecision.BF16 or bf16_supported(torch.device(device).type)


@dataclass
class Outcome:
    """What a timed arm reports besides its measurement."""

    trace: dict  # per measured step: loss, scale (the one its backward used), finite, applied, grad_norm, clip_coef, lr
    eval_loss: float  # plain-FP32 loss on the held-out batch (no autocast): the yardstick across arms
    finite_params: bool  # every parameter finite after the steps


def outcome(run, model, clock: UpdateClock, cfg: AmpConfig, held_out: dict) -> Outcome:
    """The trace of ``run``'s steps and the held-out loss; ``clock``: the arm's LR clock after its steps
    (each step's LR is the schedule at the updates applied before it)."""
    with torch.no_grad():
        eval_loss = model(**held_out).loss.item()
    trace = {k: [] for k in ("loss", "scale", "finite", "applied", "grad_norm", "clip_coef", "lr")}
    applied = clock.updates - sum(r.applied for r in run.log)  # (0: every step of the clock is in the log)
    for r in run.log:
        norm = float(r.grad_norm)
        finite = math.isfinite(norm)  # the fp32 norm is finite iff every gradient is
        for key, value in (("loss", r.loss.item()), ("scale", r.scale), ("finite", finite), ("applied", r.applied),
                           ("grad_norm", norm if finite else None), ("lr", wsd_lr(applied, cfg.schedule)),
                           ("clip_coef", float(clip_coefficient(torch.tensor(norm), cfg.max_norm)) if finite else None)):
            trace[key].append(value)
        applied += r.applied
    return Outcome(trace, eval_loss, all_finite(model.parameters()))


def measure(base, names, cfg: AmpConfig, device: str, batches: list[dict], progress=None,
            together: bool | None = None) -> dict:
    """``{name: Measured | Failed}`` of the timed arms (``harness.measure``): each trains its own copy of
    ``base`` (kept on the host), one warm update first. Step ``i`` trains on ``batches[i + 1]``;
    ``batches[0]`` is the warm and the tracked update's, ``batches[-1]`` is held out. ``Measured.finish`` is
    an ``Outcome``: its trace has every step of the arm, the warm update first."""
    models, clocks = {}, {}

    def prepare(name, together):
        s = TIMED[name]
        model = models[name] = copy.deepcopy(base).to(device)
        opt = make_adamw(model.parameters(), cfg.schedule.base_lr, device)
        clock = clocks[name] = UpdateClock(cfg.schedule, opt)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=cfg.init_scale,
                                      growth_interval=cfg.growth_interval, enabled=s.amp == "float16")
        run = harness.Run.of(model, opt, batches, s, Entered(model, s, device, scaler=scaler), max_norm=cfg.max_norm,
                             clock=clock)
        run.step(-1)  # the warm update: AdamW's moments exist before anything is measured
        return run

    def finish(name, run):
        return outcome(run, models.pop(name), clocks.pop(name), cfg, batches[-1])

    return harness.measure(names, prepare, device, cfg.timed, cfg.warmup, together=together, finish=finish,
                           progress=progress)


def decide(finite: bool, skipped_fraction: float, loss_rel_diff: float, peak_saving: float, time_ratio: float,
           noise: str | None = None) -> Decision:
    """An AMP candidate's decision against the FP32 run, by the rule stated above the constants.

    Args:
        finite: no applied step had non-finite gradients, the parameters and the held-out loss are finite.
        skipped_fraction: steps the scaler skipped / all steps.
        loss_rel_diff: |held-out loss - FP32's| / FP32's.
        peak_saving: 1 - peak / FP32's peak.
        time_ratio: median step time / FP32's.
        noise: why the time ratio is noise (``bench.timing.timing_noise``), or None.

    Returns:
        The ``Decision``; its reason names the numbers that fired the rule.

    Example:
        >>> decide(True, 0.0, 0.001, 0.11, 1.02).verdict
        'accept'
        >>> decide(True, 0.5, 0.001, 0.11, 1.02).reason
        'skipped fraction 50% > MAX_SKIPPED_FRACTION 25%'
    """
    why = [w for w, bad in (
        ("a step applied non-finite gradients", not finite),
        (f"skipped fraction {skipped_fraction:.0%} > MAX_SKIPPED_FRACTION {MAX_SKIPPED_FRACTION:.0%}",
         skipped_fraction > MAX_SKIPPED_FRACTION),
        (f"held-out loss {loss_rel_diff:.2%} off FP32's (LOSS_REL_TOL {LOSS_REL_TOL:.0%})",
         not loss_rel_diff <= LOSS_REL_TOL)) if bad]
    if why:
        return Decision("reject", "; ".join(why), "keep FP32 here")
    saving = f"peak saving {peak_saving:.1%}"
    if not peak_saving >= decision.MIN_PEAK_SAVING:
        return Decision("tune", f"numerically fine, but {saving} < MIN_PEAK_SAVING {decision.MIN_PEAK_SAVING:.0%}",
                        "no memory saving on this device: measure on the target GPU")
    if noise is not None:
        return Decision(None, f"numerically fine and {saving}, but the time ratio {time_ratio:.2f}x is noise ({noise})",
                        "time it on the target GPU or a quiet machine")
    if time_ratio <= 1 + MAX_TIME_COST:
        return Decision("accept", f"numerically fine, {saving}, median step {time_ratio:.2f}x FP32's (<= 1 + "
                        f"MAX_TIME_COST {1 + MAX_TIME_COST:g}x)")
    return Decision("tune", f"numerically fine and {saving}, but the median step is {time_ratio:.2f}x FP32's (> 1 + "
                    f"MAX_TIME_COST {1 + MAX_TIME_COST:g}x)", "too slow on this device: measure on the target GPU")


def timed_record(ctx, name: str, m: harness.Measured, plain: harness.Measured | None, cfg: AmpConfig):
    """A timed arm's record; ratios and decision against ``plain`` (None if it failed)."""
    o, dtype = m.finish, TIMED[name].dtype_label
    t = o.trace
    finite = o.finite_params and math.isfinite(o.eval_loss) and all(f for f, a in zip(t["finite"], t["applied"]) if a)
    metrics = dict(eval_loss=o.eval_loss, loss_scale_trace=t["scale"], finite_per_step=t["finite"],
                   applied_per_step=t["applied"], loss_per_step=t["loss"], grad_norm_per_step=t["grad_norm"],
                   clip_coef_per_step=t["clip_coef"], lr_per_step=t["lr"], scaler=TIMED[name].amp is LowPrecision.FP16,
                   autocast_dtype=dtype, base_lr=cfg.schedule.base_lr, step_samples_s=m.timing.samples,
                   wall_samples_s=m.timing.wall_samples, interleaved=m.timing.interleaved)
    fields = dict(dtype=dtype, strategy=name, **m.record_fields(), all_finite=finite)
    if name == "plain":
        metrics["role"] = "baseline"
    elif plain is None:
        fields["next_step"] = "no FP32 baseline to compare with (it failed): see its record"
    else:
        noise = timing_noise(m.timing, plain.timing, more_work=False)
        ratios = dict(peak_saving=1 - m.peak.allocated / plain.peak.allocated,
                      time_ratio=m.timing.median_s / plain.timing.median_s,
                      p95_ratio=m.timing.p95_s / plain.timing.p95_s, loss_diff=o.eval_loss - plain.finish.eval_loss,
                      loss_rel_diff=abs(o.eval_loss - plain.finish.eval_loss) / abs(plain.finish.eval_loss))
        metrics.update(ratios)
        fields["timing_noise"] = noise
        fields.update(decide(finite, fields["skipped_updates"] / len(t["applied"]), ratios["loss_rel_diff"],
                             ratios["peak_saving"], ratios["time_ratio"], noise=noise).record_fields())
    return ctx.record(name, metrics=json_safe(metrics), **fields)  # a diverged run's NaN -> null


def run(ctx) -> list:
    cfg, device = config_for(ctx.device, ctx.smoke), ctx.device
    # one init (on the device: fast), kept on the host so that no arm's peak holds it; copied per arm
    base = build_model(ctx.workload, device).to("cpu")
    batches = make_batches(ctx.workload, cfg.warmup + cfg.timed + 2, device=device)  # [0]: warm, tracked; [-1]: held out
    names = [c for c in CANDIDATES if available(c, device)]
    timed = measure(base, [n for n in names if n in TIMED], cfg, device, batches, ctx.progress)
    plain = timed.get("plain")
    plain = plain if isinstance(plain, harness.Measured) else None
    recs = []
    for name in names:
        r = attempt(overflow_sample, base, cfg, device, batches) if name == "fp16-overflow" else timed[name]
        failure = r.failure if isinstance(r, Failed) else None  # an out-of-memory is that arm's failure
        if failure:
            recs.append(ctx.record(name, strategy=name if name in TIMED else None, dtype=strategy_of(name).dtype_label,
                                   failure=failure, next_step="failed: see the failure"))
        else:
            recs.append(overflow_record(ctx, name, r, cfg) if name == "fp16-overflow"
                        else timed_record(ctx, name, r, plain, cfg))
    return recs


def dry_run(ctx) -> dict:
    """Per mode, the config and an estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, tokens = ctx.workload, ctx.workload.batch * ctx.workload.seq

    def mode_schedule(dev):
        cfg = config_for(dev, ctx.smoke)
        steps = 1 + steps_per_arm(cfg.timed, cfg.warmup)  # the warm update, then the measured ones
        seconds = {}
        for c in CANDIDATES:
            overflow = c == "fp16-overflow"
            seconds[c] = round(SETUP_S[dev] + dry_run_seconds(w.arch, tokens, cfg.overflow_n if overflow else steps,
                                                              dev, low=strategy_of(c).low is not None)
                               + dry_run_seconds(w.arch, tokens, 1 if overflow else 1 / 3, dev), 1)  # fp32 inject / eval
        return cfg.timed, cfg.warmup, dict(config=asdict(cfg), estimated_seconds_per_candidate=seconds,
                                           estimated_seconds=round(ASSUMED_BUILD_S[dev] + sum(seconds.values()), 1))

    return dict(modes=own_weights_modes(mode_schedule),
                estimate_basis=f"{ASSUMED_BASIS}; + SETUP_S {SETUP_S} s per arm",
                rule=dict(LOSS_REL_TOL=LOSS_REL_TOL, MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING, MAX_TIME_COST=MAX_TIME_COST,
                          MAX_SKIPPED_FRACTION=MAX_SKIPPED_FRACTION))


def conformance():
    """DynamicLossScaler vs torch.amp.GradScaler (scale and skips over an overflow pattern), and
    unscale_and_clip_ vs GradScaler.unscale_ + clip_grad_norm_ (float32, CPU). The reference is torch's own
    GradScaler driving an SGD on one parameter, not a training loop (``bench.step`` lists it)."""
    from bp_mech.records.registry import ConformanceRow

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler, ours, same = torch.amp.GradScaler("cpu", growth_interval=3), loss_scaling.DynamicLossScaler(growth_interval=3), True
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
    return ConformanceRow("Part 02 · 12b", "TRAIN-AMP-BACKWARD",
                          "torch.amp.GradScaler + clip_grad_norm_", same and err <= CONFORMANCE_TOL,
                          f"scaler model equals GradScaler's scale and skips over 12 steps: {same}; "
                          f"unscale+clip max rel. error {err:.1e} (tol {CONFORMANCE_TOL:g}, float32)")

