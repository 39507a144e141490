"""Part 02 · 10 — TRAIN-ATTENTION-BACKWARD: Qwen2 attention backward by hand, two ways.

The attention of a Qwen2 layer: rotary position embedding (RoPE, Su et al. 2021) on Q and K,
grouped-query attention (GQA, Ainslie et al. 2023: H query heads share Hkv KV heads), a
causal mask and a softmax with scale 1/sqrt(d) (Vaswani et al. 2017). Its backward, with
S = scale Q K^T (masked), P = softmax(S), O = P V and upstream dO:

    dV = P^T dO,   dP = dO V^T,   dS = P ⊙ (dP − rowsum(dP ⊙ P)),
    dQ = scale dS K,   dK = scale dS^T Q,

then dK, dV summed over the query heads of each KV group and RoPE's backward on dQ, dK.
Two hand-written strategies differ only in what the forward keeps for the backward:

* ``saved_probs``: P itself, B·H·T·T numbers;
* ``recompute``: Q, K, V, O and the row log-sum-exp L (B·H·T); the backward rebuilds P one
  tile at a time as exp(S − L) and uses rowsum(dP ⊙ P) = rowsum(dO ⊙ O) (FlashAttention,
  Dao et al. 2022), so no T×T matrix ever exists.

Both run inside one ``torch.autograd.Function`` whose forward calls ``ctx.save_for_backward``
on exactly what the strategy keeps, so ``saved_bytes`` can count it with saved-tensor hooks.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bp_mech.local_backward import linear_backward, linear_forward, rel_err
from bp_mech.measure import PeakMemory, all_finite, free, summarize


@dataclass(frozen=True)
class AttnConfig:
    batch: int  # B, sequences
    heads: int  # H, query heads
    kv_heads: int  # Hkv, key/value heads; query head h reads KV head h // (H // Hkv)
    head_dim: int  # d, width of one head
    rope_theta: float  # RoPE base
    block: int = 64  # tile edge of the recompute strategy

    @classmethod
    def from_arch(cls, arch: str, batch: int, block: int = 64) -> "AttnConfig":
        from bp_mech.workload import ARCHITECTURES

        a = ARCHITECTURES[arch]
        return cls(batch, a["num_attention_heads"], a["num_key_value_heads"],
                   a["hidden_size"] // a["num_attention_heads"], a["rope_theta"], block)


# --- the pieces: RoPE, mask, softmax, GQA ---------------------------------------------

def rope_cos_sin(T: int, d: int, theta: float, dtype=torch.float32, device="cpu"):
    """cos, sin (T, d) as in Qwen2RotaryEmbedding: angle t·theta^(−2i/d), each frequency twice."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, d/2)
    emb = torch.cat([ang, ang], -1)  # (T, d)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_half(x):
    """R x = (−x2, x1) for x = (x1, x2) split in halves of the last dim."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rope_forward(x, cos, sin):
    """y = x ⊙ cos + (R x) ⊙ sin. x (..., T, d); cos, sin broadcast to it."""
    return x * cos + rotate_half(x) * sin


def rope_backward(dy, cos, sin):
    """dx = dy ⊙ cos + R^T (dy ⊙ sin) = dy ⊙ cos − R (dy ⊙ sin), because R^T = −R."""
    return dy * cos - rotate_half(dy * sin)


def causal_mask(n_q: int, n_k: int, q0: int = 0, k0: int = 0, device="cpu"):
    """(n_q, n_k) bool, True where key position k0+j <= query position q0+i (visible)."""
    return torch.arange(k0, k0 + n_k, device=device)[None, :] <= torch.arange(q0, q0 + n_q, device=device)[:, None]


def softmax_backward(P, dP):
    """dS = P ⊙ (dP − rowsum(dP ⊙ P)): the softmax Jacobian diag(p) − p p^T applied per row."""
    return P * (dP - (dP * P).sum(-1, keepdim=True))


def gqa_expand(x, heads: int):
    """(B, Hkv, T, d) -> (B, H, T, d): each KV head repeated for its H/Hkv query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def gqa_reduce(dx, kv_heads: int):
    """(B, H, T, d) -> (B, Hkv, T, d): the backward of gqa_expand sums each group of H/Hkv heads."""
    return dx.unflatten(1, (kv_heads, -1)).sum(2)


# --- strategy 1: save P ---------------------------------------------------------------

def attention_forward(q, k, v, scale=None):
    """Causal attention, q, k, v (..., T, d) -> (O (..., T, d), P (..., T, T), L (..., T))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale  # (..., T, T)
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (..., T)
    P = torch.exp(s - lse[..., None])
    return P @ v, P, lse


def attention_backward(q, k, v, P, dO, scale=None):
    """(dq, dk, dv) from the saved probabilities P (..., T, T)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dv = P.transpose(-2, -1) @ dO  # (..., T, d)
    dS = softmax_backward(P, dO @ v.transpose(-2, -1)) * scale  # (..., T, T), masked entries stay 0
    return dS @ k, dS.transpose(-2, -1) @ q, dv


# --- strategy 2: save L, recompute P tile by tile ---------------------------------------

def _tiles(T: int, block: int):
    return [(i, min(i + block, T)) for i in range(0, T, block)]


def blockwise_forward(q, k, v, block: int, scale=None):
    """O and L = logsumexp of each score row, one (block × block) tile at a time (online softmax)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for i0, i1 in _tiles(T, block):
        qi = q[..., i0:i1, :]
        m = q.new_full(qi.shape[:-1], float("-inf"))  # running row max   (..., b)
        l = q.new_zeros(qi.shape[:-1])  # running sum of exp(s − m)        (..., b)
        acc = torch.zeros_like(qi)  # running (unnormalised) output        (..., b, d)
        for j0, j1 in _tiles(min(T, i1), block):  # key tiles past the query tile are fully masked
            s = (qi @ k[..., j0:j1, :].transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l, acc, m = l * c + p.sum(-1), acc * c[..., None] + p @ v[..., j0:j1, :], m_new
        o[..., i0:i1, :] = acc / l[..., None]
        lse[..., i0:i1] = m + torch.log(l)
    return o, lse


def blockwise_backward(q, k, v, o, lse, dO, block: int, scale=None):
    """(dq, dk, dv) with P recomputed per tile as exp(S − L); rowsum(dP ⊙ P) = rowsum(dO ⊙ O)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[-2]
    D = (dO * o).sum(-1)  # (..., T)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1 in _tiles(T, block):
        qi, doi = q[..., i0:i1, :], dO[..., i0:i1, :]
        for j0, j1 in _tiles(min(T, i1), block):
            kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
            s = (qi @ kj.transpose(-2, -1)) * scale  # (..., b, b)
            s = s.masked_fill(~causal_mask(i1 - i0, j1 - j0, i0, j0, q.device), float("-inf"))
            p = torch.exp(s - lse[..., i0:i1, None])  # the tile of P, recomputed
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ doi
            ds = p * (doi @ vj.transpose(-2, -1) - D[..., i0:i1, None]) * scale
            dq[..., i0:i1, :] += ds @ kj
            dk[..., j0:j1, :] += ds.transpose(-2, -1) @ qi
    return dq, dk, dv


def n_recomputed_tiles(T: int, block: int) -> int:
    """Score tiles the recompute backward rebuilds (the causal lower triangle of tiles)."""
    n = math.ceil(T / block)
    return n * (n + 1) // 2


# --- the two strategies with RoPE and GQA: forward -> (O, saved), backward(saved) --------
# q (B, H, T, d) and k, v (B, Hkv, T, d) before RoPE; cos, sin broadcast to (B, H, T, d).

def saved_probs_forward(q, k, v, cos, sin, block=None):
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, P, _ = attention_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]))
    return o, (qr, kr, v, P, cos, sin)


def saved_probs_backward(saved, dO, block=None):
    qr, kr, v, P, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = attention_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), P, dO)
    return rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin), gqa_reduce(dv, Hkv)


def recompute_forward(q, k, v, cos, sin, block=64):
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, lse = blockwise_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]), block)
    return o, (qr, kr, v, o, lse, cos, sin)


def recompute_backward(saved, dO, block=64):
    qr, kr, v, o, lse, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = blockwise_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), o, lse, dO, block)
    return rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin), gqa_reduce(dv, Hkv)


STRATEGIES = {"saved_probs": (saved_probs_forward, saved_probs_backward),
              "recompute": (recompute_forward, recompute_backward)}


class HandAttention(torch.autograd.Function):
    """A hand-written strategy under autograd; it saves exactly the strategy's ``saved`` tuple."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, strategy: str, block: int):
        fwd, ctx.bwd = STRATEGIES[strategy]
        o, saved = fwd(q, k, v, cos, sin, block)
        ctx.block = block
        ctx.save_for_backward(*saved)
        return o

    @staticmethod
    def backward(ctx, dO):
        return *ctx.bwd(ctx.saved_tensors, dO, ctx.block), None, None, None, None


# --- the framework's versions ---------------------------------------------------------

def autograd_attention(q, k, v, cos, sin):
    """The eager Qwen2 attention from transformers' own functions; autograd does the backward."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    H, T = q.shape[1], q.shape[2]
    qr, kr = apply_rotary_pos_emb(q, k, cos.expand(q.shape[0], T, -1), sin.expand(q.shape[0], T, -1))
    s = qr @ repeat_kv(kr, H // k.shape[1]).transpose(2, 3) * q.shape[-1] ** -0.5
    s = s.masked_fill(~causal_mask(T, T, device=q.device), float("-inf"))
    return torch.softmax(s, -1) @ repeat_kv(v, H // k.shape[1])


def sdpa_attention(q, k, v, cos, sin):
    """RoPE, then ``F.scaled_dot_product_attention`` (causal, GQA); the CPU uses its flash kernel."""
    return F.scaled_dot_product_attention(rope_forward(q, cos, sin), rope_forward(k, cos, sin), v,
                                          is_causal=True, enable_gqa=True)


CANDIDATES = ("autograd", "saved_probs", "recompute", "sdpa")


def attention_fn(name: str, block: int = 64):
    if name in STRATEGIES:
        return lambda q, k, v, cos, sin: HandAttention.apply(q, k, v, cos, sin, name, block)
    return {"autograd": autograd_attention, "sdpa": sdpa_attention}[name]


# --- measuring ------------------------------------------------------------------------

def make_inputs(cfg: AttnConfig, T: int, dtype=torch.float64, seed=0, device="cpu"):
    """((q, k, v, cos, sin), dO) with q, dO (B, H, T, d) and k, v (B, Hkv, T, d)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    B, H, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    q, k, v, dO = r(B, H, T, d), r(B, Hkv, T, d), r(B, Hkv, T, d), r(B, H, T, d)
    return (q, k, v, *rope_cos_sin(T, d, cfg.rope_theta, dtype, device)), dO


def grads(fn, inputs, dO):
    """(O, (dq, dk, dv)) of ``fn`` under autograd, with fresh leaves q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    o = fn(*leaves, *inputs[3:])
    return o.detach(), torch.autograd.grad(o, leaves, dO)


def saved_bytes(fn, inputs) -> int:
    """Bytes autograd keeps for the backward of ``fn``: the distinct storages its pack hook sees."""
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()  # views of one storage count once
        storages[st.data_ptr()] = st.nbytes()
        return t  # the graph keeps t alive, so no address is reused while we count

    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = fn(*leaves, *inputs[3:])
    del o
    return sum(storages.values())


def saved_bytes_formula(cfg: AttnConfig, T: int, strategy: str, itemsize: int = 4) -> int:
    """What each hand-written strategy saves, by formula (the cross-check of ``saved_bytes``)."""
    B, H, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    common = B * H * T * d + 2 * B * Hkv * T * d + 2 * T * d  # RoPE'd q, k; v; cos, sin
    extra = B * H * T * T if strategy == "saved_probs" else B * H * T * d + B * H * T  # P | O, L
    return (common + extra) * itemsize


def backward_times(names, cfg: AttnConfig, T: int, steps: int, warmup: int, device="cpu") -> dict:
    """Backward time per candidate (float32), interleaved step by step so all see the same load."""
    inputs, dO = make_inputs(cfg, T, torch.float32, 1, device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    samples = {n: [] for n in names}
    for _ in range(steps):
        for n in names:
            leaves = [t.clone().requires_grad_() for t in inputs[:3]]
            o = attention_fn(n, cfg.block)(*leaves, *inputs[3:])
            sync()
            t0 = time.perf_counter()
            o.backward(dO)
            sync()
            samples[n].append(time.perf_counter() - t0)
    return {n: summarize(s, warmup) for n, s in samples.items()}


def qwen2_attention_backward(x, attn, cos, sin, dy, strategy: str, block: int = 64):
    """A whole ``Qwen2Attention`` by hand: projections (chapter 09's linear pair), RoPE, GQA, softmax.

    x, dy (B, T, C); cos, sin (B, T, d) from ``Qwen2RotaryEmbedding``. Returns (y, dx, {param: grad}).
    """
    d, fwd, bwd = attn.head_dim, *STRATEGIES[strategy]
    heads = lambda t: t.unflatten(-1, (-1, d)).transpose(1, 2)  # noqa: E731  (B, T, n·d) -> (B, n, T, d)
    flat = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731            (B, n, T, d) -> (B, T, n·d)
    names = ("q_proj", "k_proj", "v_proj")
    q, k, v = (heads(linear_forward(x, getattr(attn, n).weight, getattr(attn, n).bias)) for n in names)
    o, saved = fwd(q, k, v, cos[:, None], sin[:, None], block)
    y = linear_forward(flat(o), attn.o_proj.weight)
    do, dWo, _ = linear_backward(flat(o), attn.o_proj.weight, dy)
    dx, out = 0, {"o_proj.weight": dWo}
    for n, g in zip(names, bwd(saved, heads(do), block)):
        dxn, out[f"{n}.weight"], out[f"{n}.bias"] = linear_backward(x, getattr(attn, n).weight, flat(g))
        dx = dx + dxn  # x feeds three projections: their gradients add
    return y, dx, out


def qwen2_module_error(strategy: str, arch: str = "tiny", B: int = 2, T: int = 48, block: int = 16,
                       seed: int = 0, device="cpu") -> float:
    """Max relative error (float32) of the hand-written layer vs transformers' Qwen2Attention (SDPA,
    causal) under autograd, over the output, dx and the 7 parameter gradients."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

    from bp_mech.workload import qwen2_config

    cfg = qwen2_config(arch)
    torch.manual_seed(seed)
    attn = Qwen2Attention(cfg, layer_idx=0).to(device)
    x = torch.randn(B, T, cfg.hidden_size, device=device, requires_grad=True)
    cos, sin = Qwen2RotaryEmbedding(cfg).to(device)(x, torch.arange(T, device=device)[None].expand(B, T))
    y_ref, _ = attn(x, (cos, sin), None)  # attention_mask=None: transformers' SDPA path is causal
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    with torch.no_grad():
        y, dx, g = qwen2_attention_backward(x, attn, cos, sin, dy, strategy, block)
    ref = dict(attn.named_parameters())
    return max([rel_err(y, y_ref), rel_err(dx, x.grad)] + [rel_err(g[n], ref[n].grad) for n in g])


# --- the experiment -------------------------------------------------------------------

# Decision rule for a checked candidate: accept when its float64 output and dQ/dK/dV are within
# TOL64 of float64 autograd, its float32 ones within TOL32 of float32 SDPA, the whole hand-written
# layer within TOL_MODULE of transformers' Qwen2Attention, and the growth exponent of its saved
# bytes (log-log slope over the last two sweep lengths) is below LINEAR_MAX when it claims linear
# state (recompute, sdpa); otherwise reject. autograd is the reference and gets no decision.
TOL64, TOL32, TOL_MODULE, LINEAR_MAX = 1e-10, 1e-5, 1e-5, 1.1
SWEEP_T = (128, 256, 512, 1024, 2048)  # sequence lengths of the saved-state sweep
TIME_STEPS, TIME_WARMUP = 20, 3  # timed backward passes per candidate, leading ones dropped


def sweep_saved_bytes(cfg: AttnConfig, Ts=SWEEP_T, names=CANDIDATES, device="cpu") -> dict:
    """{candidate: {T: saved bytes}} in float32, measured through saved-tensor hooks."""
    out = {n: {} for n in names}
    for T in Ts:
        inputs, _ = make_inputs(cfg, T, torch.float32, 0, device)
        for n in names:
            out[n][T] = saved_bytes(attention_fn(n, cfg.block), inputs)
    return out


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
            out[n][key] = {"output": rel_err(o, o_ref), **{f"d{c}": rel_err(a, b) for c, a, b in zip("qkv", g, g_ref)}}
            out[n]["finite"] &= all_finite([o, *g])
    return out


def growth_exponent(by_T: dict) -> float:
    """log-log slope of saved bytes between the two largest lengths (1 linear, 2 quadratic)."""
    (t0, b0), (t1, b1) = sorted(by_T.items())[-2:]
    return math.log(b1 / b0) / math.log(t1 / t0)


def plan(ctx) -> dict:
    cfg = AttnConfig.from_arch(ctx.workload.arch, ctx.workload.batch)
    T = ctx.workload.seq
    return dict(attention=asdict(cfg), sweep_T=list(SWEEP_T), timed_T=T,
                timing=f"{TIME_STEPS} backward passes per candidate, interleaved, first {TIME_WARMUP} dropped",
                tolerances=dict(float64=TOL64, float32_vs_sdpa=TOL32, qwen2_module=TOL_MODULE),
                saved_bytes_formula_float32={s: saved_bytes_formula(cfg, T, s) for s in STRATEGIES})


def run(ctx) -> list:
    """One record per candidate on ``ctx.device``; ``--mode real_gpu`` (not in the GPU suite) runs the
    same checks with CUDA kernels (float32 matmuls without TF32, torch's default) and allocator peaks."""
    cfg = AttnConfig.from_arch(ctx.workload.arch, ctx.workload.batch)
    T, dev = ctx.workload.seq, ctx.device
    errs = errors(cfg, T, device=dev)
    swept = sweep_saved_bytes(cfg, sorted(set(SWEEP_T) | {T}), device=dev)
    times = backward_times(CANDIDATES, cfg, T, TIME_STEPS, TIME_WARMUP, dev)
    ta, recs = times["autograd"], []
    for n in ctx.progress(CANDIDATES, desc="candidates"):
        inputs, dO = make_inputs(cfg, T, torch.float32, 2, dev)
        free(dev)  # earlier candidates' cached blocks would count in this one's reserved peak
        with PeakMemory(dev, resident=[inputs, dO]) as pm:  # one forward + backward
            grads(attention_fn(n, cfg.block), inputs, dO)
        e64, e32 = (max(errs[n][k].values()) for k in ("float64_vs_autograd", "float32_vs_sdpa"))
        module = qwen2_module_error(n, ctx.workload.arch, device=dev) if n in STRATEGIES else None
        slope, t, ref = growth_exponent(swept[n]), times[n], n == "autograd"
        failed = [k for k, bad in (("float64", e64 > TOL64), ("float32", e32 > TOL32),
                                   ("qwen2_module", module is not None and module > TOL_MODULE),
                                   ("linear_state", n in ("recompute", "sdpa") and slope > LINEAR_MAX)) if bad]
        recs.append(ctx.record(
            n, output_error=None if ref else errs[n]["float64_vs_autograd"]["output"],
            grad_error=None if ref else max(errs[n]["float64_vs_autograd"][g] for g in ("dq", "dk", "dv")),
            all_finite=errs[n]["finite"], peak_allocated=pm.peak_allocated, peak_reserved=pm.peak_reserved,
            memory_source=pm.memory_source, step_median_s=t.median_s, step_p95_s=t.p95_s,
            warmup_excluded=t.warmup_excluded,
            recompute_count={"recompute": n_recomputed_tiles(T, cfg.block), "saved_probs": 0}.get(n),
            decision=None if ref else ("reject" if failed else "accept"),
            next_step=f"failed checks: {', '.join(failed)}" if failed and not ref else None,
            metrics=dict(
                errors=errs[n], error_note="output_error, grad_error: float64 vs float64 autograd (reference)",
                qwen2_module_error=module, attention=asdict(cfg),
                saved_bytes={str(k): v for k, v in swept[n].items()}, saved_bytes_at_T=swept[n][T],
                saved_ratio_vs_recompute={str(k): v / swept["recompute"][k] for k, v in swept[n].items()},
                saved_growth_exponent=slope, saved_bytes_formula={str(k): saved_bytes_formula(cfg, k, n)
                                                                  for k in swept[n]} if n in STRATEGIES else None,
                backward_time_ratio_vs_autograd=t.median_s / ta.median_s,
                backward_p95_ratio_vs_autograd=t.p95_s / ta.p95_s, timed_T=T, timed_steps=TIME_STEPS,
                tolerances=dict(float64=TOL64, float32_vs_sdpa=TOL32, qwen2_module=TOL_MODULE)),
        ))
    return recs


def conformance():
    """Hand-written (both strategies) vs float64 autograd, vs float32 SDPA, vs transformers' Qwen2Attention."""
    from bp_mech.registry import ConformanceRow

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
