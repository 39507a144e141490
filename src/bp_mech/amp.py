"""TRAIN-AMP-BACKWARD — mixed-precision backward: FP32 → AMP (FP16 + GradScaler, BF16), overflow samples.

Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training") keeps float32 master
weights and runs the matmuls of forward and backward in 16 bits under ``torch.autocast``.
FP16 has a 5-bit exponent: its largest value is 65504; below 6.1e-5 values are subnormal (fewer
significant bits), down to 6e-8 (2^-24); below about half of that they round to zero. Dynamic loss scaling multiplies the loss
by S before ``backward()`` (so small gradients survive), divides the gradients by S before the
update (``unscale_``), and

* skips ``optimizer.step()`` when any unscaled gradient is inf/NaN, and backs off S *= 0.5;
* after ``growth_interval`` consecutive finite steps grows S *= 2 (if the result is finite).

``DynamicLossScaler`` is that rule in plain Python; the overflow sample checks it against
``torch.amp.GradScaler``'s trace. Clipping comes *after* ``unscale_``: the threshold is in
the units of the true gradient (``unscale_and_clip_``); ``clipping_order`` measures what
clipping the still-scaled gradients does instead. BF16 has float32's 8-bit exponent, so it
needs no scaler; it rounds harder (8-bit significand). A skipped step changes no parameter and
must not advance the LR clock (Part 02 · 12, ``UpdateClock``).

Measuring (``timed_runs``): on the CPU every timed candidate has its own model copy, AdamW and
scaler, alive together; one tracked update each gives its peak, then the candidates are timed
interleaved on one intra-op thread (``measure.time_interleaved``). On CUDA they run one after
another, each alone on the device (the GPU is not shared), so the allocator's peak is its own.
``updates`` counts the optimizer calls of a record that applied an update, ``skipped_updates``
those the scaler skipped; together they are every call of the candidate's run (CPU: the tracked
update, the warm-up and the timed steps; CUDA: warm-up and timed), ``len(metrics.applied_per_step)``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from bp_mech.environment import bf16_supported
from bp_mech.measure import (CPU_TIMING_THREADS, SMOKE_SCHEDULE, PeakMemory, StepStats, all_finite, free, guarded,
                             measure_steps, time_interleaved, timing_noise)
from bp_mech.results import json_safe
from bp_mech.scheduler import UpdateClock, WSDConfig, scaler_step
from bp_mech.workload import PLAN_BASIS, PLAN_BUILD_S, build_model, make_adamw, make_batches, plan_seconds


class DynamicLossScaler:
    """``torch.amp.GradScaler``'s update rule (``_amp_update_scale_``) in plain Python.

    Same constructor arguments as GradScaler. State: ``scale`` (S, the loss is multiplied
    by it before backward) and ``growth_tracker`` (finite steps since the last overflow or
    growth).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor  # S *= growth_factor after growth_interval finite steps
        self.backoff_factor = backoff_factor  # S *= backoff_factor on a step with inf/NaN gradients
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> bool:
        """Advance one step; returns True when ``optimizer.step()`` must be skipped."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        return False


def unscale_and_clip_(grads: list[torch.Tensor], scale: float, max_norm: float, eps: float = 1e-6):
    """In place: g <- g / S, then clip by the *unscaled* total norm (as clip_grad_norm_).

    Returns ``(total_norm, clip_coef, found_inf)`` with total_norm = ||(g_1/S, ..., g_n/S)||_2
    and clip_coef = min(1, max_norm / (total_norm + eps)). Nothing is clipped when a gradient
    is inf/NaN: that step is skipped anyway.
    """
    for g in grads:
        g.mul_(1.0 / scale)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    found_inf = not math.isfinite(total)
    coef = 1.0 if found_inf else min(1.0, max_norm / (total + eps))
    if not found_inf:
        for g in grads:
            g.mul_(coef)
    return total, coef, found_inf


# --- the experiment -----------------------------------------------------------------

CANDIDATES = ("fp32", "fp16-amp", "bf16-amp", "fp16-overflow")
LOW = {"fp32": None, "fp16-amp": torch.float16, "bf16-amp": torch.bfloat16, "fp16-overflow": torch.float16}
DTYPE_LABEL = {None: "float32", torch.float16: "float16-autocast", torch.bfloat16: "bfloat16-autocast"}

# Decision rule for an AMP candidate, from ratios to the FP32 run of the same workload:
#   reject  if a step applied non-finite gradients, the skipped fraction exceeds
#           MAX_SKIPPED_FRACTION, or |eval loss - FP32's| / FP32's exceeds LOSS_REL_TOL;
#   tune    if its peak is not at least MIN_PEAK_SAVING below FP32's (no memory win here);
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


def autocast(device_type: str, low: torch.dtype | None):
    """``torch.autocast`` to ``low``, or ``nullcontext()`` for plain FP32."""
    return contextlib.nullcontext() if low is None else torch.autocast(device_type, dtype=low)


class AmpTrainer:
    """One model + AdamW + GradScaler + WSD update clock; ``step`` is one optimizer call."""

    def __init__(self, model, candidate: str, cfg: AmpConfig, device: str, growth_interval: int) -> None:
        self.model, self.cfg, self.low = model, cfg, LOW[candidate]
        self.device_type = torch.device(device).type
        # fused on CUDA: GradScaler hands it found_inf and the kernel skips the update itself
        self.opt = make_adamw(model.parameters(), cfg.schedule.base_lr, device)
        self.clock = UpdateClock(cfg.schedule, self.opt)
        self.scaler = torch.amp.GradScaler(self.device_type, init_scale=cfg.init_scale,
                                           growth_interval=growth_interval, enabled=self.low is torch.float16)
        self.trace = {k: [] for k in ("loss", "scale", "finite", "applied", "grad_norm", "clip_coef", "lr")}

    def step(self, batch: dict, inject: float = 1.0) -> bool:
        """Forward under autocast, scaled backward, unscale, clip, scaler step, clock."""
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.device_type, self.low):
            loss = self.model(**batch).loss  # float32: transformers upcasts the logits
        self.scaler.scale(loss if inject == 1.0 else loss * inject).backward()
        self.scaler.unscale_(self.opt)  # BEFORE clipping: max_norm is in true-gradient units
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_norm))
        lr = self.clock.lr
        applied = scaler_step(self.scaler, self.opt)
        self.clock.step(applied)
        finite, t = math.isfinite(norm), self.trace  # the fp32 norm is finite iff every gradient is
        t["loss"].append(loss.item())
        t["scale"].append(self.scaler.get_scale() if self.scaler.is_enabled() else None)
        t["finite"].append(finite)
        t["applied"].append(applied)
        t["grad_norm"].append(norm if finite else None)
        t["clip_coef"].append(min(1.0, self.cfg.max_norm / (norm + 1e-6)) if finite else None)
        t["lr"].append(lr)
        return applied


def autocast_dtypes(model, batch: dict, device_type: str, low: torch.dtype | None) -> dict[str, str]:
    """Output dtype per module type in one forward under ``autocast`` (what runs in 16 bits)."""
    seen: dict[str, set] = {}

    def hook(mod, args, out):
        out = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(out):
            seen.setdefault(type(mod).__name__, set()).add(str(out.dtype).removeprefix("torch."))

    hooks = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad(), autocast(device_type, low):
            out = model(**batch)
    finally:
        for h in hooks:
            h.remove()
    seen["(logits)"], seen["(loss)"] = {str(out.logits.dtype)[6:]}, {str(out.loss.dtype)[6:]}
    return {k: "/".join(sorted(v)) for k, v in seen.items()}


# clipping_order on the page: tiny-b2s64, lr 1e-3. Its gradient norm starts near 3 and settles near 2
# within a few updates, so at this max_norm the correct run clips only its first updates.
CLIP_DEMO_MAX_NORM = 2.25
CLIP_DEMO_UPDATES = 10


def clipping_order(base, batches: list[dict], max_norm: float, scale: float = 2.0**16, lr: float = 1e-3,
                   adam_eps: float = 1e-8, device: str = "cpu") -> list[dict]:
    """The clipping bug, measured. Two AdamW runs (constant ``lr``, ``eps=adam_eps``) from the same
    weights on the same batches, FP16 autocast and a GradScaler held at ``scale``:
    (a) unscale, then clip at ``max_norm`` (correct); (b) clip the still-scaled gradients, and let
    ``scaler.step`` unscale them afterwards (the bug). One row per update: each run's norm as
    ``clip_grad_norm_`` saw it (b's is ``scale`` times the true one), whether it clipped, its
    coefficient min(1, max_norm / (norm + 1e-6)), the median |gradient| element AdamW received, and
    ||Δp_b - Δp_a|| / ||Δp_a|| of the updates."""
    runs = []
    for clip_scaled in (False, True):
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=adam_eps, foreach=True)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=scale, growth_interval=2**30)
        runs.append((model, opt, scaler, clip_scaled))
    rows = []
    for b in batches:
        row, deltas = {}, []
        for model, opt, scaler, clip_scaled in runs:
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            with autocast(torch.device(device).type, torch.float16):
                loss = model(**b).loss
            scaler.scale(loss).backward()
            if not clip_scaled:
                scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            coef, key = min(1.0, max_norm / (norm + 1e-6)), "b" if clip_scaled else "a"
            row.update({f"loss_{key}": loss.item(), f"norm_{key}": norm, f"clipped_{key}": coef < 1.0,
                        f"clip_coef_{key}": coef, f"applied_{key}": scaler_step(scaler, opt),  # unscales (b) too
                        f"grad_median_{key}": torch.cat([p.grad.reshape(-1) for p in model.parameters()]).abs()
                        .median().item()})  # what AdamW saw, per element
            deltas.append([p.detach() - q for p, q in zip(model.parameters(), before)])
        diff = sum((x - y).double().pow(2).sum().item() for x, y in zip(*deltas)) ** 0.5
        size = sum(x.double().pow(2).sum().item() for x in deltas[0]) ** 0.5
        rows.append(dict(row, update_rel_diff=diff / size if size > 0 else math.nan))
    return rows


def tracked_trainer(base, candidate: str, cfg: AmpConfig, device: str, batch: dict):
    """The candidate's own model copy and trainer, and the peak of its first update (CPU: tracked
    storages, the parameters resident). Returns ``(trainer, PeakMemory)``."""
    tr = AmpTrainer(copy.deepcopy(base).to(device), candidate, cfg, device, cfg.growth_interval)
    with PeakMemory(device, resident=[tr.model.parameters()]) as pm:
        tr.step(batch)
    return tr, pm


def finish(tr: AmpTrainer, stats: StepStats, held_out: dict) -> dict:
    """What a timed candidate reports: stats, trace, counts, and the plain-FP32 loss on the held-out
    batch (no autocast), the yardstick across candidates."""
    with torch.no_grad():
        eval_loss = tr.model(**held_out).loss.item()
    return dict(stats=stats, trace=tr.trace, updates=tr.clock.updates, skipped=tr.clock.skipped, eval_loss=eval_loss,
                finite_params=all_finite(tr.model.parameters()))


def timed_runs(base, names, cfg: AmpConfig, device: str, batches: list[dict], progress=None,
               interleave: bool | None = None) -> dict:
    """``{name: (result of finish, None) | (None, failure)}`` for the timed candidates. Step ``i`` trains
    on ``batches[i + 1]``; ``batches[0]`` is the CPU's tracked update, ``batches[-1]`` is held out.

    CPU (``interleave``, the default there): every candidate alive together (own model copy, AdamW,
    scaler); one tracked update each gives its peak, then ``time_interleaved``: cfg.warmup untimed and
    cfg.timed timed rounds, one update of every candidate per round, one intra-op thread. CUDA: one
    candidate after another, alone on the device (the GPU is not shared): ``measure_steps`` over
    cfg.warmup + cfg.timed updates, the allocator's peak covering them, its state freed before the next.
    """
    out = {}
    if not (torch.device(device).type == "cpu" if interleave is None else interleave):
        def alone(name):
            tr = AmpTrainer(copy.deepcopy(base).to(device), name, cfg, device, cfg.growth_interval)
            st = measure_steps(lambda i: tr.step(batches[i + 1]), cfg.warmup + cfg.timed, cfg.warmup, device,
                               resident=[tr.model.parameters()])
            return finish(tr, st, batches[-1])

        for name in names:
            out[name] = guarded(alone, name)  # an OOM is this candidate's failure
            free(device)
        return out
    started = {}
    for name in names:
        r, failure = guarded(tracked_trainer, base, name, cfg, device, batches[0])
        if failure:
            out[name] = (None, failure)
        else:
            started[name] = r
    steps = {n: (lambda i, tr=tr: tr.step(batches[i + 1])) for n, (tr, _) in started.items()}
    timings, failure = guarded(time_interleaved, steps, cfg.timed, cfg.warmup, device, progress=progress)
    for n, (tr, pm) in started.items():
        out[n] = (None, failure) if failure else (
            finish(tr, StepStats(timings[n], pm.peak_allocated, pm.peak_reserved, pm.memory_source), batches[-1]), None)
    return {n: out[n] for n in names}


def overflow_sample(base, candidate: str, cfg: AmpConfig, device: str, batches: list[dict]) -> dict:
    """FP16 + GradScaler with overflows injected at ``cfg.overflow_calls``; no timing."""
    model = copy.deepcopy(base).to(device)
    (model(**batches[0]).loss * (cfg.overflow_factor * cfg.init_scale)).backward()  # the same injection in fp32
    fp32_ok = all_finite(p.grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    tr = AmpTrainer(model, candidate, cfg, device, cfg.overflow_growth_interval)
    ref = DynamicLossScaler(cfg.init_scale, growth_interval=cfg.overflow_growth_interval)
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
    free(device)
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


def decide(finite: bool, skipped_fraction: float, loss_rel_diff: float, peak_ratio: float, time_ratio: float,
           noise: str | None = None):
    """(decision, next_step) by the rule stated above the constants."""
    if not finite or skipped_fraction > MAX_SKIPPED_FRACTION or not loss_rel_diff <= LOSS_REL_TOL:
        return "reject", "non-finite, too many skipped steps, or loss off FP32 beyond tolerance: keep FP32 here"
    if not peak_ratio <= 1 - MIN_PEAK_SAVING:
        return "tune", "numerically fine, but no memory saving on this device: measure on the target GPU"
    if noise is not None:
        return None, (f"numerically fine and saves memory, but the time ratio is noise ({noise}): "
                      "time it on the target GPU or a quiet machine")
    if time_ratio <= 1 + MAX_TIME_COST:
        return "accept", None
    return "tune", "numerically fine and saves memory, but too slow on this device: measure on the target GPU"


def run(ctx) -> list:
    cfg, device = config_for(ctx.device, ctx.smoke), ctx.device
    # one init (on the device: fast), kept on the host so that no candidate's peak holds it; copied per candidate
    base = build_model(ctx.workload, device).to("cpu")
    batches = make_batches(ctx.workload, cfg.warmup + cfg.timed + 2, device=device)  # [0]: tracked, [-1]: held out
    names = [c for c in CANDIDATES if available(c, device)]
    timed = timed_runs(base, [n for n in names if n != "fp16-overflow"], cfg, device, batches, ctx.progress)
    recs, fp32 = [], None
    for name in names:
        if name == "fp16-overflow":
            r, failure = guarded(overflow_sample, base, name, cfg, device, batches)  # an OOM is its failure
        else:
            r, failure = timed[name]
        dtype = DTYPE_LABEL[LOW[name]]
        if failure:
            recs.append(ctx.record(name, dtype=dtype, failure=failure, next_step="failed: see the failure"))
            continue
        t = r["trace"]
        fields = dict(dtype=dtype, updates=sum(t["applied"]), skipped_updates=len(t["applied"]) - sum(t["applied"]),
                      update_count=r["updates"])
        if name == "fp16-overflow":
            ok = r["scaler_matches_reference"] and r["params_unchanged_on_skip"] and r["clock_held_on_skip"]
            recs.append(ctx.record(
                name, **fields, all_finite=all(t["finite"]), failure=r["failure"],
                next_step=None if ok else "scaler semantics differ from the reference",
                metrics=json_safe(dict(
                    {k: v for k, v in r.items() if k not in ("trace", "failure")}, semantics_ok=ok,
                    injected_calls=list(cfg.overflow_calls), overflow_factor=cfg.overflow_factor,
                    growth_interval=cfg.overflow_growth_interval, scale_floor=SCALE_FLOOR,
                    loss_scale_trace=t["scale"], finite_per_step=t["finite"], applied_per_step=t["applied"],
                    lr_per_call=t["lr"], skipped_calls=[c for c, a in enumerate(t["applied"]) if not a]))))
            continue
        st = r["stats"]
        finite = r["finite_params"] and math.isfinite(r["eval_loss"]) and all(
            f for f, a in zip(t["finite"], t["applied"]) if a)
        metrics = dict(eval_loss=r["eval_loss"], loss_scale_trace=t["scale"], finite_per_step=t["finite"],
                       applied_per_step=t["applied"], loss_per_step=t["loss"], grad_norm_per_step=t["grad_norm"],
                       clip_coef_per_step=t["clip_coef"], scaler=LOW[name] is torch.float16, autocast_dtype=dtype,
                       base_lr=cfg.schedule.base_lr, step_samples_s=st.timing.samples,
                       interleaved=st.timing.interleaved)
        fields.update(all_finite=finite, peak_allocated=st.peak_allocated, peak_reserved=st.peak_reserved,
                      step_median_s=st.timing.median_s, step_p95_s=st.timing.p95_s,
                      warmup_excluded=st.timing.warmup_excluded, threads=st.timing.threads,
                      memory_source=st.memory_source)
        if name == "fp32":
            fp32 = dict(timing=st.timing, peak=st.peak_allocated, eval_loss=r["eval_loss"])
            metrics["role"] = "baseline"
        elif fp32 is None:
            fields["next_step"] = "no FP32 baseline to compare with (it failed): see its record"
        else:
            bt = fp32["timing"]
            noise = timing_noise(st.timing, bt, more_work=False)
            ratios = dict(peak_ratio=st.peak_allocated / fp32["peak"], time_ratio=st.timing.median_s / bt.median_s,
                          p95_ratio=st.timing.p95_s / bt.p95_s, loss_diff=r["eval_loss"] - fp32["eval_loss"],
                          loss_rel_diff=abs(r["eval_loss"] - fp32["eval_loss"]) / abs(fp32["eval_loss"]))
            metrics.update(ratios)
            fields["timing_noise"] = noise
            fields["decision"], fields["next_step"] = decide(finite, fields["skipped_updates"] / len(t["applied"]), *(
                ratios[k] for k in ("loss_rel_diff", "peak_ratio", "time_ratio")), noise=noise)
        recs.append(ctx.record(name, metrics=json_safe(metrics), **fields))  # a diverged run's NaN -> null
    return recs


def plan(ctx) -> dict:
    """Per mode, the config and a planning estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, tokens, modes = ctx.workload, ctx.workload.batch * ctx.workload.seq, {}
    for mode, dev in (("real_gpu", "cuda"), ("cpu", "cpu")):
        cfg = config_for(dev, ctx.smoke)
        calls = cfg.warmup + cfg.timed + (dev == "cpu")  # the CPU adds one tracked update
        est = {c: round(SETUP_S[dev] + plan_seconds(w.arch, tokens, cfg.overflow_n if c == "fp16-overflow" else calls,
                                                    dev, low=LOW[c] is not None)
                        + plan_seconds(w.arch, tokens, 1 if c == "fp16-overflow" else 1 / 3, dev), 1)  # fp32 inject/eval
               for c in CANDIDATES}
        modes[mode] = dict(config=asdict(cfg), updates_per_candidate=calls, interleaved=dev == "cpu",
                           threads=CPU_TIMING_THREADS if dev == "cpu" else None, estimated_s=est,
                           estimated_seconds=round(PLAN_BUILD_S[dev] + sum(est.values()), 1))
    return dict(modes=modes, estimate_basis=f"{PLAN_BASIS}; + SETUP_S {SETUP_S} s per candidate",
                decision_rule=dict(LOSS_REL_TOL=LOSS_REL_TOL, MIN_PEAK_SAVING=MIN_PEAK_SAVING,
                                   MAX_TIME_COST=MAX_TIME_COST, MAX_SKIPPED_FRACTION=MAX_SKIPPED_FRACTION))


def conformance():
    """DynamicLossScaler vs torch.amp.GradScaler (scale and skips over an overflow pattern), and
    unscale_and_clip_ vs GradScaler.unscale_ + clip_grad_norm_ (float32, CPU)."""
    from bp_mech.registry import ConformanceRow

    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler, ours, same = torch.amp.GradScaler("cpu", growth_interval=3), DynamicLossScaler(growth_interval=3), True
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
    norm, _, _ = unscale_and_clip_(mine, 2.0**16, 0.5)
    ref_scaler.unscale_(ref_opt)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(w.parameters(), 0.5))
    err = max([abs(norm - ref_norm) / ref_norm] + [((a - q.grad).abs().max() / q.grad.abs().max()).item()
                                                   for a, q in zip(mine, w.parameters())])
    return ConformanceRow("Mixed-precision backward", "TRAIN-AMP-BACKWARD",
                          "torch.amp.GradScaler + clip_grad_norm_", same and err <= 1e-6,
                          f"scaler model equals GradScaler's scale and skips over 12 steps: {same}; "
                          f"unscale+clip max rel. error {err:.1e} (tol 1e-6, float32)")
