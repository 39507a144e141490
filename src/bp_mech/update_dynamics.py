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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bp_mech.measure import all_finite, free, guarded, measure_steps
from bp_mech.results import json_safe
from bp_mech.workload import PLAN_BASIS, PLAN_BUILD_S, build_model, make_adamw, make_batches, param_count, plan_seconds

CANDIDATES = ("base_lr", "high_lr", "high_lr_clip")
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
    steps: int = 12  # timed steps per candidate (separate run, no per-update snapshots)
    warmup: int = 2  # leading timed steps excluded from median/P95


def config_for(arch: str, device: str) -> DynamicsConfig:
    """qwen05 gets a base LR typical of pretraining a 0.5B model; the GPU times more steps."""
    base = 1e-4 if arch == "qwen05" else 1e-3
    gpu = torch.device(device).type == "cuda"
    return DynamicsConfig(base_lr=base, steps=8, warmup=2) if gpu else DynamicsConfig(base_lr=base)


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

def global_grad_norm(tensors) -> torch.Tensor:
    """sqrt(sum_i ||g_i||_2^2) over all tensors (None skipped), a 0-dim tensor in their dtype."""
    norms = [torch.linalg.vector_norm(g.detach()) for g in tensors if g is not None]  # one per tensor
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


def measure_candidate(model, init: dict, batches, name: str, cfg: DynamicsConfig, device):
    """Peak and step time of one plain update (forward, backward, clip if any, AdamW step)."""
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
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    free(device)  # the reserved peak is this candidate's own
    return measure_steps(step, cfg.steps, cfg.warmup, device, resident=[model.parameters(), state])


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
    cfg = config_for(ctx.workload.arch, ctx.device)
    dev = ctx.device
    model = build_model(ctx.workload, dev)
    init = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    batches = make_batches(ctx.workload, cfg.updates, device=dev)
    recs = []
    for name in ctx.progress(CANDIDATES, desc="candidates"):
        rows, fail = guarded(trace, model, init, batches, name, cfg, dev)
        st, fail2 = guarded(measure_candidate, model, init, batches, name, cfg, dev)
        fail = fail or fail2
        s = summarize(rows) if rows else None
        decision, nxt = decide(s) if s else ("reject", f"failed: {fail}")
        s, rows = json_safe(s), json_safe(rows)  # a diverged trace holds NaN/inf: null in the record
        if fail and s:
            decision, nxt = "reject", f"failed: {fail}"
        recs.append(ctx.record(
            name, updates=cfg.updates, update_count=len(rows) if rows else None,
            all_finite=s["all_finite"] if s else None, skipped_updates=0 if s else None,
            peak_allocated=st.peak_allocated if st else None, peak_reserved=st.peak_reserved if st else None,
            step_median_s=st.timing.median_s if st else None, step_p95_s=st.timing.p95_s if st else None,
            warmup_excluded=cfg.warmup if st else None, memory_source=ctx.memory_source if st else None,
            failure=fail, decision=decision, next_step=nxt,
            metrics=dict(lr=lr_of(name, cfg), max_norm=cfg.max_norm if name == "high_lr_clip" else None,
                         weight_decay=cfg.weight_decay, timed_steps=cfg.steps, summary=s, trace=rows,
                         step_samples_s=st.timing.samples if st else None,
                         rule=dict(spike_max=SPIKE_MAX)),
        ))
    return recs


def plan(ctx) -> dict:
    """LRs, updates and, per mode, a planning estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, modes = ctx.workload, {}
    for mode, dev in (("real_gpu", "cuda"), ("cpu", "cpu")):
        cfg = config_for(w.arch, dev)
        passes = cfg.updates + 1 + cfg.steps + (dev == "cpu")  # traced + warm + timed (+ tracked on the CPU)
        extra = cfg.updates * 0.05 + 2 * 0.5 if dev == "cuda" else 0.0  # snapshots + ratios, 2 loads from the host
        est = PLAN_BUILD_S[dev] + len(CANDIDATES) * (plan_seconds(w.arch, w.batch * w.seq, passes, dev) + extra)
        modes[mode] = dict(lrs={c: lr_of(c, cfg) for c in CANDIDATES}, traced_updates=cfg.updates,
                           timed_steps=cfg.steps, warmup_excluded=cfg.warmup, estimated_seconds=round(est, 1))
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
