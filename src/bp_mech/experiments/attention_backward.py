"""Part 02 · 10 — TRAIN-ATTENTION-BACKWARD, the experiment: the hand-written attention backwards of
``bp_mech.attention_backward`` against autograd, SDPA and transformers'
``Qwen2Attention``.

Four candidates: ``autograd`` (the reference), the two hand-written strategies
(``saved_probs``, ``recompute``) and ``sdpa``. For each: its errors (float64 vs
autograd, float32 vs SDPA, the whole layer vs ``Qwen2Attention``), the bytes it saves
for the backward over a sweep of lengths, the time of its backward alone (the CPU timing
protocol of ``bp_mech.bench.timing``: interleaved, one intra-op thread,
``experiments.dry_run.schedule`` rounds) and the peak of one forward and backward. The
decision rule is ``decide``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict

import torch

from bp_mech import attention_backward, attention_framework, attention_rope, attention_strategies
from bp_mech.attention_framework import attention_fn
from bp_mech.attention_strategies import STRATEGIES
from bp_mech.attention_config import AttnConfig
from bp_mech.experiments.dry_run import per_mode, schedule
from bp_mech.bench.compare import all_finite, relative_error
from bp_mech.bench.oom import release_memory
from bp_mech.bench.timing import time_interleaved
from bp_mech.instruments.peak import PeakMemory
from bp_mech.records.decision import Decision

CANDIDATES = ("autograd", *STRATEGIES, "sdpa")  # autograd is the reference
SWEEP_T = (128, 256, 512, 1024, 2048)  # sequence lengths of the saved-state sweep

# Decision rule for a checked candidate: accept when its float64 output and dQ/dK/dV are within
# TOL64 of float64 autograd, its float32 ones within TOL32 of float32 SDPA, the whole hand-written
# layer within TOL_MODULE of transformers' Qwen2Attention, and the growth exponent of its saved
# bytes (log-log slope over the last two sweep lengths) is at most LINEAR_MAX when it claims linear
# state (recompute, sdpa); otherwise reject. autograd is the reference and gets no decision.
TOL64 = 1e-10  # float64 rounding is near 1e-16: more than this is a different formula
TOL32 = 1e-5  # float32: two correct implementations differ by ~1e-7 relative, summed over T terms
TOL_MODULE = 1e-5  # float32: the whole layer vs Qwen2Attention (SDPA, causal)
LINEAR_MAX = 1.1  # growth exponent of saved bytes that still counts as linear in T
CLAIMS_LINEAR = ("recompute", "sdpa")  # the candidates that claim saved state linear in T


# --- inputs, gradients ----------------------------------------------------------------

def make_inputs(cfg: AttnConfig, T: int, dtype=torch.float64, seed=0, device="cpu"):
    """((q, k, v, cos, sin), dO) with q, dO (B, H, T, d) and k, v (B, Hkv, T, d)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    B, H, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    q, k, v, dO = r(B, H, T, d), r(B, Hkv, T, d), r(B, Hkv, T, d), r(B, H, T, d)
    return (q, k, v, *attention_rope.rope_cos_sin(T, d, cfg.rope_theta, dtype, device)), dO


def grads(fn, inputs, dO):
    """(O, (dq, dk, dv)) of ``fn`` under autograd, with fresh leaves q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    o = fn(*leaves, *inputs[3:])
    return o.detach(), torch.autograd.grad(o, leaves, dO)


# --- the measurements -----------------------------------------------------------------

def errors(cfg: AttnConfig, T: int, names=CANDIDATES, device="cpu") -> dict:
    """{candidate: {"float64_vs_autograd": {...}, "float32_vs_sdpa": {...}, "finite": bool}}, errors
    of the output, dq, dk, dv."""
    out = {n: {"finite": True} for n in names}
    for dtype, ref, key in ((torch.float64, "autograd", "float64_vs_autograd"),
                            (torch.float32, "sdpa", "float32_vs_sdpa")):
        inputs, dO = make_inputs(cfg, T, dtype, 0, device)
        o_ref, g_ref = grads(attention_fn(ref), inputs, dO)
        for n in names:
            o, g = grads(attention_fn(n, cfg.block), inputs, dO)
            out[n][key] = {"output": relative_error(o, o_ref),
                           **{f"d{c}": relative_error(a, b) for c, a, b in zip("qkv", g, g_ref)}}
            out[n]["finite"] &= all_finite([o, *g])
    return out


def qwen2_module_error(strategy: str, arch: str = "tiny", B: int = 2, T: int = 48, block: int = 16,
                       seed: int = 0, device="cpu") -> float:
    """Max relative error (float32) of the hand-written layer (``qwen2_attention_backward``) vs
    transformers' Qwen2Attention (SDPA, causal) under autograd, over the output, dx and
    the 7 parameter gradients."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

    from bp_mech.instruments.workload import qwen2_config

    cfg = qwen2_config(arch)
    torch.manual_seed(seed)
    attn = Qwen2Attention(cfg, layer_idx=0).to(device)
    x = torch.randn(B, T, cfg.hidden_size, device=device, requires_grad=True)
    cos, sin = Qwen2RotaryEmbedding(cfg).to(device)(x, torch.arange(T, device=device)[None].expand(B, T))
    y_ref, _ = attn(x, (cos, sin), None)  # attention_mask=None: transformers' SDPA path is causal
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    with torch.no_grad():
        y, dx, g = attention_framework.qwen2_attention_backward(x, attn, cos, sin, dy, strategy, block)
    ref = dict(attn.named_parameters())
    return max([relative_error(y, y_ref), relative_error(dx, x.grad)]
               + [relative_error(g[n], ref[n].grad) for n in g])


def sweep_saved_bytes(cfg: AttnConfig, Ts=SWEEP_T, names=CANDIDATES, device="cpu") -> dict:
    """{candidate: {T: saved bytes}} in float32, measured through saved-tensor hooks."""
    out = {n: {} for n in names}
    for T in Ts:
        inputs, _ = make_inputs(cfg, T, torch.float32, 0, device)
        for n in names:
            out[n][T] = attention_strategies.saved_bytes(attention_fn(n, cfg.block), inputs)
    return out


def growth_exponent(by_T: dict) -> float:
    """log-log slope of saved bytes between the two largest lengths (1 linear, 2 quadratic)."""
    (t0, b0), (t1, b1) = sorted(by_T.items())[-2:]
    return math.log(b1 / b0) / math.log(t1 / t0)


def backward_times(names, cfg: AttnConfig, T: int, rounds: int, warmup: int, device="cpu", progress=None) -> dict:
    """Backward time per candidate (float32) by the timing protocol (``measure.time_interleaved``):
    candidates interleaved round by round, one intra-op thread on the CPU. Each
    candidate's forward runs untimed as it enters its round (the ``around`` context);
    the timed step is the backward alone."""
    inputs, dO = make_inputs(cfg, T, torch.float32, 1, device)
    outputs = {}  # candidate -> the output of its untimed forward, whose graph the timed step runs backward

    @contextlib.contextmanager
    def forward(name):
        leaves = [t.clone().requires_grad_() for t in inputs[:3]]
        outputs[name] = attention_fn(name, cfg.block)(*leaves, *inputs[3:])
        try:
            yield
        finally:
            outputs.pop(name, None)

    return time_interleaved({n: lambda i, n=n: outputs[n].backward(dO) for n in names}, rounds, warmup, device,
                            around={n: lambda n=n: forward(n) for n in names}, progress=progress)


# --- the decision, the run ------------------------------------------------------------

def decide(name: str, error64: float, error32: float, module_error: float | None,
           growth: float) -> Decision:
    """A candidate's decision by the rule above (none for the reference, autograd).

    Args:
        name: the candidate.
        error64: its worst float64 error against autograd.
        error32: its worst float32 error against SDPA.
        module_error: the layer's error against Qwen2Attention (None: no layer).
        growth: the exponent of its saved bytes' growth in T.

    Returns:
        The ``Decision``: reject names every failed check with its number.

    Example:
        >>> decide("sdpa", 0.0, 2e-5, None, 1.0).reason
        'float32 error 2e-05 > TOL32 1e-05'
    """
    if name == "autograd":
        return Decision(None, "the reference: every candidate is compared with it")
    linear = name in CLAIMS_LINEAR
    checks = (
        ("float64", f"float64 error {error64:.2g}", error64, "TOL64", TOL64),
        ("float32", f"float32 error {error32:.2g}", error32, "TOL32", TOL32),
        ("qwen2_module", f"layer error {module_error or 0.0:.2g}",
         module_error if module_error is not None else 0.0, "TOL_MODULE", TOL_MODULE),
        ("linear_state", f"saved bytes grow as T^{growth:.2f}",
         growth if linear else 0.0, "T^LINEAR_MAX", LINEAR_MAX))
    failed = [(check, f"{what} > {bound} {tol:g}")
              for check, what, value, bound, tol in checks if value > tol]
    if failed:
        return Decision("reject", "; ".join(why for _, why in failed),
                        "inspect the backward: failed checks: "
                        + ", ".join(check for check, _ in failed))
    shown = checks[:2] + (checks[3:] if linear else ())
    return Decision("accept", ", ".join(
        f"{what} <= {bound} {tol:g}" for _, what, _, bound, tol in shown))


def _tolerances() -> dict:
    return dict(float64=TOL64, float32_vs_sdpa=TOL32, qwen2_module=TOL_MODULE)


def dry_run(ctx) -> dict:
    cfg = AttnConfig.from_arch(ctx.workload.arch, ctx.workload.batch)
    T = ctx.workload.seq
    timing = per_mode(lambda dev: dict(zip(("timed_rounds", "warmup_rounds"), schedule(dev, ctx.smoke))))
    return dict(attention=asdict(cfg), sweep_T=list(SWEEP_T), timed_T=T,
                timing="the backward alone, candidates interleaved round by round (1 intra-op thread on the CPU), "
                       "the forward untimed before it", rounds=timing, tolerances=_tolerances(),
                saved_bytes_formula_float32={s: attention_strategies.saved_bytes_formula(cfg, T, s) for s in STRATEGIES})


def run(ctx) -> list:
    """One record per candidate on ``ctx.device``; ``--mode real_gpu`` (not in the GPU suite) runs the
    same checks with CUDA kernels (float32 matmuls without TF32, torch's default) and allocator peaks."""
    cfg = AttnConfig.from_arch(ctx.workload.arch, ctx.workload.batch)
    T, dev = ctx.workload.seq, ctx.device
    errs = errors(cfg, T, device=dev)
    swept = sweep_saved_bytes(cfg, sorted(set(SWEEP_T) | {T}), device=dev)
    rounds, warmup = schedule(dev, ctx.smoke)
    times = backward_times(CANDIDATES, cfg, T, rounds, warmup, dev)
    ta, recs = times["autograd"], []
    for n in ctx.progress(CANDIDATES, desc="candidates"):
        inputs, dO = make_inputs(cfg, T, torch.float32, 2, dev)
        release_memory(dev)  # earlier candidates' cached blocks would count in this one's reserved peak
        with PeakMemory(dev, resident=[inputs, dO]) as pm:  # one forward + backward
            grads(attention_fn(n, cfg.block), inputs, dO)
        e64, e32 = (max(errs[n][k].values()) for k in ("float64_vs_autograd", "float32_vs_sdpa"))
        module = qwen2_module_error(n, ctx.workload.arch, device=dev) if n in STRATEGIES else None
        slope, t, ref = growth_exponent(swept[n]), times[n], n == "autograd"
        decided = decide(n, e64, e32, module, slope)
        recs.append(ctx.record(
            n, output_error=None if ref else errs[n]["float64_vs_autograd"]["output"],
            grad_error=None if ref else max(errs[n]["float64_vs_autograd"][g] for g in ("dq", "dk", "dv")),
            all_finite=errs[n]["finite"], **pm.peak.record_fields(), **t.record_fields(),
            recompute_count={"recompute": attention_backward.n_recomputed_tiles(T, cfg.block), "saved_probs": 0}.get(n),
            **decided.record_fields(),
            metrics=dict(
                errors=errs[n], error_note="output_error, grad_error: float64 vs float64 autograd (reference)",
                qwen2_module_error=module, attention=asdict(cfg),
                saved_bytes={str(k): v for k, v in swept[n].items()}, saved_bytes_at_T=swept[n][T],
                saved_ratio_vs_recompute={str(k): v / swept["recompute"][k] for k, v in swept[n].items()},
                saved_growth_exponent=slope,
                saved_bytes_formula={str(k): attention_strategies.saved_bytes_formula(cfg, k, n) for k in swept[n]}
                if n in STRATEGIES else None,
                backward_time_ratio_vs_autograd=t.median_s / ta.median_s,
                backward_p95_ratio_vs_autograd=t.p95_s / ta.p95_s, timed_T=T, timed_steps=rounds,
                step_samples_s=t.samples, wall_samples_s=t.wall_samples, tolerances=_tolerances()),
        ))
    return recs


def conformance():
    """Hand-written (both strategies) vs float64 autograd, vs float32 SDPA, vs transformers' Qwen2Attention."""
    from bp_mech.records.registry import ConformanceRow

    cfg = AttnConfig.from_arch("tiny", 2, block=16)
    errs = errors(cfg, 72, names=tuple(STRATEGIES))
    e64 = max(max(e["float64_vs_autograd"].values()) for e in errs.values())
    e32 = max(max(e["float32_vs_sdpa"].values()) for e in errs.values())
    em = max(qwen2_module_error(s) for s in STRATEGIES)
    ok = e64 <= TOL64 and e32 <= TOL32 and em <= TOL_MODULE
    return ConformanceRow("Part 02 · 10", "TRAIN-ATTENTION-BACKWARD",
                          "autograd (float64), F.scaled_dot_product_attention, transformers Qwen2Attention",
                          ok, f"max rel. error: {e64:.1e} vs autograd (tol {TOL64:g}), {e32:.1e} vs SDPA "
                          f"(tol {TOL32:g}, float32), {em:.1e} vs Qwen2Attention (tol {TOL_MODULE:g}, float32)")
