"""Part 02 · 55 — TRAIN-UPDATE-DYNAMICS: how big is each update, and does clipping bound it?

Three candidates run the same number of AdamW updates from the same initial weights on the
same batches: the base learning rate, a high one without clipping, and the high one with
global-norm clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural
networks"). Per update it records

* finiteness of the loss and of every gradient;
* the total gradient norm  ||g|| = sqrt(sum_i ||g_i||^2)  over all parameters, before clipping;
* the clip coefficient  c = min(1, max_norm / (||g|| + eps))  (eps = 1e-6, as in
  ``torch.nn.utils.clip_grad_norm_``); the clipped gradient is c g;
* per parameter group: the update norm ||p_after - p_before|| and the update-to-parameter
  ratio ||p_after - p_before|| / ||p_before||;
* the loss.

This is local stability over a few updates. It is not a quality evaluation: a candidate
that stays finite and lowers the training loss here still needs a held-out evaluation.

Step time and peak come from a separate run (``measure_candidates``): on the CPU every candidate
gets its own model copy and AdamW, alive together; one tracked update each gives its peak, then the
candidates are timed interleaved on one intra-op thread (``measure.time_interleaved``). On CUDA
they run one after another on the one model, each with only its own optimizer state. The
candidates do the same work, except that clipping adds a global norm and a scaling: the clipped
candidate's time is compared with the unclipped high LR's (strictly more work, so measuring it
faster is noise), the high LR's with the base LR's. The decision never depends on the time.
``updates`` counts the optimizer steps of a candidate's runs that completed: the traced updates
and the measurement's (warm update, tracked update on the CPU, warm-up and timed steps);
``metrics.updates_by_run`` splits them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from bp_mech.measure import (CPU_TIMING_THREADS, SMOKE_SCHEDULE, PeakMemory, StepStats, all_finite, free, guarded,
                             measure_steps, time_interleaved, timing_noise)
from bp_mech.results import json_safe
from bp_mech.workload import PLAN_BASIS, PLAN_BUILD_S, build_model, make_adamw, make_batches, param_count, plan_seconds

CANDIDATES = ("base_lr", "high_lr", "high_lr_clip")
TIME_BASELINE = {"high_lr": "base_lr", "high_lr_clip": "high_lr"}  # the step each one's time is compared with
EPS = 1e-6  # the eps of clip_grad_norm_'s coefficient
GROUPS = ("embedding", "attention", "mlp", "norm_bias")  # parameter groups, by role

# Decision rule (per candidate), from its own trace:
#   reject  if any update had a non-finite loss or gradient;
#   tune    if the loss spiked: some update's loss exceeds the lowest earlier loss by more than
#           SPIKE_MAX nats, or the last loss is not below the first;
#   accept  otherwise (finite, no spike, loss went down). Local stability only.
SPIKE_MAX = 0.5


@dataclass(frozen=True)
class DynamicsConfig:
    base_lr: float = 1e-3  # AdamW learning rate of "base_lr"
    high_factor: float = 100.0  # "high_lr" and "high_lr_clip" use base_lr * high_factor
    max_norm: float = 1.0  # global-norm clipping threshold of "high_lr_clip"
    weight_decay: float = 0.1  # on the embedding, attention and MLP matrices; 0 on norms and biases
    updates: int = 20  # updates of the traced run, per candidate
    timed: int = 60  # timed steps per candidate (separate run, no snapshots; CPU: interleaved rounds)
    warmup: int = 3  # untimed steps (rounds) before them; the CPU runs one tracked update (the peak) first


def config_for(arch: str, device: str, smoke: bool = False) -> DynamicsConfig:
    """qwen05 gets a base LR typical of pretraining a 0.5B model; the GPU times more steps."""
    base = 1e-4 if arch == "qwen05" else 1e-3
    if smoke:
        return DynamicsConfig(base_lr=base, timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1], updates=4)
    gpu = torch.device(device).type == "cuda"
    return DynamicsConfig(base_lr=base, timed=20, warmup=2) if gpu else DynamicsConfig(base_lr=base)


def lr_of(name: str, cfg: DynamicsConfig) -> float:
    return cfg.base_lr if name == "base_lr" else cfg.base_lr * cfg.high_factor


def group_of(name: str) -> str:
    """The role of a Qwen2 parameter, from its name."""
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name or name.endswith(".bias"):
        return "norm_bias"
    return "attention" if "self_attn" in name else "mlp"


def param_groups(model) -> dict[str, list[torch.nn.Parameter]]:
    groups: dict[str, list] = {g: [] for g in GROUPS}
    for n, p in model.named_parameters():  # tied weights appear once
        groups[group_of(n)].append(p)
    return groups


def make_optimizer(model, lr: float, cfg: DynamicsConfig, device):
    g = param_groups(model)
    return make_adamw([dict(params=g[k], weight_decay=0.0 if k == "norm_bias" else cfg.weight_decay, name=k)
                       for k in GROUPS if g[k]], lr, device)


# --- from scratch: the global norm, the clip coefficient, the update ratio -----------------

def global_grad_norm(tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """sqrt(sum_i ||g_i||_2^2) over all tensors (None skipped), a 0-dim tensor in their dtype (or in
    ``dtype``, e.g. float64 to compare norms across runs). The book's one global norm."""
    norms = [torch.linalg.vector_norm(g.detach(), dtype=dtype) for g in tensors if g is not None]  # one per tensor
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_coefficient(total_norm, max_norm: float, eps: float = EPS):
    """c = min(1, max_norm / (total_norm + eps)): gradients are only scaled down, never up."""
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def clip_by_global_norm_(params, max_norm: float, eps: float = EPS) -> torch.Tensor:
    """Scale every gradient in place by the one global coefficient; return the pre-clip norm."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(p.grad for p in params)
    c = clip_coefficient(total, max_norm, eps)
    for p in params:
        p.grad.mul_(c.to(p.grad.device))
    return total


def update_ratio(before, after) -> tuple[float, float, float]:
    """(||after - before||, ||before||, ratio) over a group of tensors (global L2, float64)."""
    du = sum((a.detach().double() - b.double()).pow(2).sum().item() for b, a in zip(before, after)) ** 0.5
    pn = sum(b.double().pow(2).sum().item() for b in before) ** 0.5
    return du, pn, du / pn if pn > 0 else math.inf


# --- the experiment ---------------------------------------------------------------------

def trace(model, init: dict, batches, name: str, cfg: DynamicsConfig, device) -> list[dict]:
    """``len(batches)`` updates of one candidate from ``init``; one dict per update."""
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)  # after a failed candidate, stale gradients may remain
    opt = make_optimizer(model, lr_of(name, cfg), cfg, device)
    groups = param_groups(model)
    out = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        finite = bool(torch.isfinite(loss)) and all_finite(p.grad for p in model.parameters())
        total = global_grad_norm(p.grad for p in model.parameters())
        if name == "high_lr_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)  # the framework's clip
        before = {g: [p.detach().clone() for p in ps] for g, ps in groups.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = dict(loss=loss.item(), finite=finite, grad_norm=total.item(),
                   clip_coef=clip_coefficient(total, cfg.max_norm).item() if name == "high_lr_clip" else 1.0,
                   would_clip=clip_coefficient(total, cfg.max_norm).item(), groups={})
        for g, ps in groups.items():
            du, pn, r = update_ratio(before[g], ps)
            row["groups"][g] = dict(update_norm=du, param_norm=pn, ratio=r)
        del before
        out.append(row)
    return out


def prepare_candidate(model, init: dict, batches, name: str, cfg: DynamicsConfig, device):
    """Load ``init`` into ``model``, make the candidate's AdamW and run one warm update (which creates
    the optimizer state). Returns ``(step, resident)``: one plain update (forward, backward, clip if
    any, AdamW step) and the tensors that exist before it (parameters, AdamW state)."""
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model, lr_of(name, cfg), cfg, device)

    def step(i: int) -> None:
        model(**batches[i % len(batches)]).loss.backward()
        if name == "high_lr_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # creates the AdamW state before the measurement
    return step, [list(model.parameters()), [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]]


def measure_candidates(model, init: dict, batches, cfg: DynamicsConfig, device, progress=None,
                       interleave: bool | None = None) -> dict:
    """``{name: (StepStats, None) | (None, failure)}`` for every candidate.

    CPU (``interleave``, the default there): every candidate its own copy of ``model`` and AdamW,
    alive together; one tracked update each gives its peak, then ``time_interleaved``: cfg.warmup
    untimed and cfg.timed timed rounds, one update of every candidate per round, one intra-op thread.
    CUDA: one candidate after another on ``model``, with only its own optimizer state:
    ``measure_steps`` over cfg.warmup + cfg.timed updates, the allocator's peak covering them.
    """
    out, started = {}, {}
    sequential = not (torch.device(device).type == "cpu" if interleave is None else interleave)
    for name in CANDIDATES:
        if sequential:
            def alone(name=name):
                step, resident = prepare_candidate(model, init, batches, name, cfg, device)
                free(device)  # the reserved peak is this candidate's own
                return measure_steps(step, cfg.warmup + cfg.timed, cfg.warmup, device, resident=resident)

            out[name] = guarded(alone)
            continue

        def start(name=name):  # its own model copy; the peak of one tracked update
            step, resident = prepare_candidate(copy.deepcopy(model), init, batches, name, cfg, device)
            with PeakMemory(device, resident=resident) as pm:
                step(-1)
            return step, pm

        r, failure = guarded(start)
        if failure:
            out[name] = (None, failure)
        else:
            started[name] = r
    if started:
        timings, failure = guarded(time_interleaved, {n: s for n, (s, _) in started.items()}, cfg.timed,
                                   cfg.warmup, device, progress=progress)
        for n, (_, pm) in started.items():
            out[n] = (None, failure) if failure else (
                StepStats(timings[n], pm.peak_allocated, pm.peak_reserved, pm.memory_source), None)
    return {n: out[n] for n in CANDIDATES}


def summarize(rows: list[dict]) -> dict:
    """Scalars of a trace: finiteness, first/last/peak loss, spike, clip count, max ratios."""
    losses = [r["loss"] for r in rows]
    spike = max((losses[t] - min(losses[:t]) for t in range(1, len(losses))), default=0.0)
    return dict(all_finite=all(r["finite"] for r in rows),
                first_nonfinite=next((i for i, r in enumerate(rows) if not r["finite"]), None),
                first_loss=losses[0], last_loss=losses[-1], max_loss=max(losses), spike=spike,
                clipped_updates=sum(r["clip_coef"] < 1.0 for r in rows),
                max_grad_norm=max(r["grad_norm"] for r in rows),
                max_ratio={g: max(r["groups"][g]["ratio"] for r in rows) for g in rows[0]["groups"]})


def decide(s: dict) -> tuple[str, str]:
    """The documented rule; returns (decision, next_step)."""
    finite_losses = all(math.isfinite(x) for x in (s["first_loss"], s["last_loss"], s["spike"]))
    if not s["all_finite"] or not finite_losses:
        return "reject", f"non-finite from update {s['first_nonfinite']}: lower the LR (clipping did not hold it)"
    if s["spike"] > SPIKE_MAX or s["last_loss"] >= s["first_loss"]:
        return "tune", "finite, but the loss spiked or did not fall: lower the LR or add warmup"
    return "accept", "locally stable; judge quality on a held-out evaluation before adopting it"


def run(ctx) -> list:
    cfg = config_for(ctx.workload.arch, ctx.device, ctx.smoke)
    dev = ctx.device
    model = build_model(ctx.workload, dev)
    init = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    batches = make_batches(ctx.workload, cfg.updates, device=dev)
    traces = {name: guarded(trace, model, init, batches, name, cfg, dev)
              for name in ctx.progress(CANDIDATES, desc="candidates")}
    meas = measure_candidates(model, init, batches, cfg, dev, progress=ctx.progress)
    recs = []
    for name in CANDIDATES:
        (rows, fail), (st, fail2) = traces[name], meas[name]
        fail = fail or fail2
        s = summarize(rows) if rows else None
        decision, nxt = decide(s) if s else (None, None)
        s, rows = json_safe(s), json_safe(rows)  # a diverged trace holds NaN/inf: null in the record
        if fail:
            decision, nxt = None, f"failed: {fail}"
        base = meas.get(TIME_BASELINE.get(name), (None,))[0]
        noise = timing_noise(st.timing, base.timing, more_work=name == "high_lr_clip") if st and base else None
        by_run = dict(trace=len(rows) if rows else None,
                      measurement=1 + (torch.device(dev).type == "cpu") + cfg.warmup + cfg.timed if st else None)
        ran = [n for n in by_run.values() if n is not None]
        recs.append(ctx.record(
            name, updates=sum(ran) if ran else None, update_count=len(rows) if rows else None,
            all_finite=s["all_finite"] if s else None, skipped_updates=0 if ran else None,
            peak_allocated=st and st.peak_allocated, peak_reserved=st and st.peak_reserved,
            step_median_s=st and st.timing.median_s, step_p95_s=st and st.timing.p95_s,
            warmup_excluded=st and st.timing.warmup_excluded, threads=st and st.timing.threads, timing_noise=noise,
            memory_source=ctx.memory_source if st else None, failure=fail, decision=decision, next_step=nxt,
            metrics=dict(lr=lr_of(name, cfg), max_norm=cfg.max_norm if name == "high_lr_clip" else None,
                         weight_decay=cfg.weight_decay, timed_steps=cfg.timed, summary=s, trace=rows,
                         updates_by_run=by_run, step_samples_s=st and st.timing.samples,
                         interleaved=st and st.timing.interleaved, time_baseline=TIME_BASELINE.get(name),
                         time_ratio=st.timing.median_s / base.timing.median_s if st and base else None,
                         p95_ratio=st.timing.p95_s / base.timing.p95_s if st and base else None,
                         rule=dict(spike_max=SPIKE_MAX)),
        ))
    return recs


def plan(ctx) -> dict:
    """LRs, updates and, per mode, a planning estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, modes = ctx.workload, {}
    for mode, dev in (("real_gpu", "cuda"), ("cpu", "cpu")):
        cfg = config_for(w.arch, dev, ctx.smoke)
        passes = cfg.updates + 1 + cfg.warmup + cfg.timed + (dev == "cpu")  # traced + warm + timed (+ tracked)
        extra = cfg.updates * 0.05 + 2 * 0.5 if dev == "cuda" else 0.0  # snapshots + ratios, 2 loads from the host
        est = PLAN_BUILD_S[dev] + len(CANDIDATES) * (plan_seconds(w.arch, w.batch * w.seq, passes, dev) + extra)
        modes[mode] = dict(lrs={c: lr_of(c, cfg) for c in CANDIDATES}, traced_updates=cfg.updates,
                           timed_steps=cfg.timed, warmup_excluded=cfg.warmup, interleaved=dev == "cpu",
                           threads=CPU_TIMING_THREADS if dev == "cpu" else None, estimated_seconds=round(est, 1))
    return dict(max_norm=DynamicsConfig.max_norm, weight_decay=DynamicsConfig.weight_decay, optimizer="AdamW",
                groups=list(GROUPS), params=param_count(w.arch), modes=modes, rule=dict(spike_max=SPIKE_MAX),
                estimate_basis=PLAN_BASIS + "; + 0.05 s per traced update and 1 s of state loads per candidate (cuda)")


def conformance():
    """``clip_by_global_norm_`` vs ``torch.nn.utils.clip_grad_norm_`` on a tiny Qwen2's gradients."""
    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    model(**make_batches(w, 1)[0]).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    worst = 0.0
    for max_norm in (0.1, 1.0, 1e6):  # clipping hard, mildly, not at all
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        ours_n = clip_by_global_norm_(model.parameters(), max_norm)
        ours = [p.grad.clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        ref_n = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        errs = [abs(ours_n.item() - ref_n.item()) / ref_n.item()]
        errs += [((a - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                 for a, p in zip(ours, model.parameters())]
        worst = max(worst, *errs)
    return ConformanceRow("Part 02 · 55", "TRAIN-UPDATE-DYNAMICS", "torch.nn.utils.clip_grad_norm_",
                          worst <= 1e-6, f"total norm and clipped gradients at max_norm 0.1, 1, 1e6: max rel. "
                          f"difference {worst:.2e} (tol 1e-6, float32)")
