"""Part 02 · 09 — TRAIN-LOCAL-BACKWARD: hand-written local backward passes.

Each operation of a Qwen2 MLP half-block has a forward and, beside it, a backward that maps
the upstream gradient ``dy`` to the gradients of its inputs and parameters. The backward
functions take the forward's inputs (what autograd would save) and ``dy``; nothing else.
``mlp_block_backward`` composes them: the chain rule written as code.

Every op is checked three ways (``compare_op``): against autograd in float64 (tight),
against central finite differences along a random direction in float64, and the same
hand-written code in float32 against the float64 reference (the rounding a real run sees).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# --- forward and backward, side by side --------------------------------------------


def linear_forward(x, W, b=None):
    """y = x W^T + b. x (..., in), W (out, in), b (out,) -> y (..., out)."""
    y = x @ W.T
    return y if b is None else y + b


def linear_backward(x, W, dy):
    """Returns (dx, dW, db): dx = dy W (..., in); dW = dy^T x (out, in); db = sum dy (out,)."""
    dx = dy @ W  # (..., out) @ (out, in)
    dW = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, N) @ (N, in)
    db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dx, dW, db


def silu_forward(x):
    """y = x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def silu_backward(x, dy):
    """dy/dx = s (1 + x (1 - s)), s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s))


def gelu_forward(x):
    """Exact GELU: y = x Phi(x), Phi the standard normal CDF."""
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_backward(x, dy):
    """dy/dx = Phi(x) + x phi(x)."""
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return dy * (cdf + x * pdf)


def rmsnorm_forward(x, w, eps=1e-6):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim (Zhang & Sennrich 2019)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return w * (x * r)


def rmsnorm_backward(x, w, dy, eps=1e-6):
    """Returns (dx, dw).

    With r = (mean(x^2) + eps)^(-1/2), xhat = x r and g = dy * w:
    dx = r (g - xhat * mean(g * xhat));  dw = sum over rows of dy * xhat.
    The second term of dx is the one that flows through r; dropping it is the classic bug.
    """
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * r
    g = dy * w
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def swiglu_mlp_forward(x, Wg, Wu, Wd):
    """Qwen2MLP: y = down(silu(gate(x)) * up(x)); no biases. Wg, Wu (I, C), Wd (C, I)."""
    return linear_forward(silu_forward(linear_forward(x, Wg)) * linear_forward(x, Wu), Wd)


def swiglu_mlp_backward(x, Wg, Wu, Wd, dy):
    """Returns (dx, dWg, dWu, dWd), composed from the local backwards above."""
    g, u = linear_forward(x, Wg), linear_forward(x, Wu)  # (..., I) each, recomputed
    a = silu_forward(g)
    dh, dWd, _ = linear_backward(a * u, Wd, dy)  # through down_proj
    dg = silu_backward(g, dh * u)  # through the gate's SiLU
    du = dh * a
    dx_g, dWg, _ = linear_backward(x, Wg, dg)
    dx_u, dWu, _ = linear_backward(x, Wu, du)
    return dx_g + dx_u, dWg, dWu, dWd  # x feeds two branches: their gradients add


def cross_entropy_forward(logits, targets, ignore_index=-100):
    """Mean token loss over non-ignored targets. logits (N, V), targets (N,)."""
    valid = targets != ignore_index
    lse = torch.logsumexp(logits, -1)  # (N,)
    picked = logits.gather(-1, targets.clamp_min(0)[:, None])[:, 0]
    return ((lse - picked) * valid).sum() / valid.sum()


def cross_entropy_backward(logits, targets, ignore_index=-100):
    """d loss / d logits = (softmax(logits) - onehot(target)) / n_valid on valid rows, 0 elsewhere."""
    valid = (targets != ignore_index)
    d = torch.softmax(logits, -1)
    d[torch.arange(len(targets)), targets.clamp_min(0)] -= 1
    return d * valid[:, None] / valid.sum()


def mlp_block_forward(x, w_norm, Wg, Wu, Wd, eps=1e-6):
    """The MLP half of a Qwen2 decoder layer: y = x + MLP(RMSNorm(x))."""
    return x + swiglu_mlp_forward(rmsnorm_forward(x, w_norm, eps), Wg, Wu, Wd)


def mlp_block_backward(x, w_norm, Wg, Wu, Wd, dy, eps=1e-6):
    """The chain rule as code: residual, then MLP, then RMSNorm. Returns (dx, dw_norm, dWg, dWu, dWd)."""
    h = rmsnorm_forward(x, w_norm, eps)
    dh, dWg, dWu, dWd = swiglu_mlp_backward(h, Wg, Wu, Wd, dy)
    dx_norm, dw_norm = rmsnorm_backward(x, w_norm, dh, eps)
    return dy + dx_norm, dw_norm, dWg, dWu, dWd  # the residual adds dy unchanged


# --- the op table: inputs, hand-written pair, independent reference ------------------

def _ref_mlp(x, Wg, Wu, Wd):
    return F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)


def _ref_block(x, w, Wg, Wu, Wd):
    return x + _ref_mlp(F.rms_norm(x, (x.shape[-1],), w, 1e-6), Wg, Wu, Wd)


def _lin_bw(x, W, b, dy):
    return linear_backward(x, W, dy)


# name -> (argument names, parameter names, hand forward, hand backward, torch reference)
OPS = {
    "linear": (("x", "W", "b"), ("W", "b"), linear_forward, _lin_bw, F.linear),
    "silu": (("x",), (), silu_forward, lambda x, dy: (silu_backward(x, dy),), F.silu),
    "gelu": (("x",), (), gelu_forward, lambda x, dy: (gelu_backward(x, dy),), F.gelu),
    "rmsnorm": (("x", "w"), ("w",), rmsnorm_forward, rmsnorm_backward,
                lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    "swiglu_mlp": (("x", "Wg", "Wu", "Wd"), ("Wg", "Wu", "Wd"), swiglu_mlp_forward, swiglu_mlp_backward, _ref_mlp),
    "cross_entropy": (("logits",), (), cross_entropy_forward, None, F.cross_entropy),
    "mlp_block": (("x", "w", "Wg", "Wu", "Wd"), ("w", "Wg", "Wu", "Wd"), mlp_block_forward, mlp_block_backward,
                  _ref_block),
}


def make_inputs(op: str, shape: tuple[int, int, int], inter: int, vocab: int, dtype=torch.float64, seed=0):
    """Random inputs of an op. shape = (B, T, C); inter = MLP width; vocab for the loss."""
    g = torch.Generator().manual_seed(seed)
    B, T, C = shape
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    x = r(B, T, C)
    return {
        "linear": lambda: [x, r(inter, C, scale=C ** -0.5), r(inter)],
        "silu": lambda: [x], "gelu": lambda: [x],
        "rmsnorm": lambda: [x, 1 + 0.1 * r(C)],
        "swiglu_mlp": lambda: [x, r(inter, C, scale=C ** -0.5), r(inter, C, scale=C ** -0.5),
                               r(C, inter, scale=inter ** -0.5)],
        "cross_entropy": lambda: [r(B * T, vocab, scale=2.0)],
        "mlp_block": lambda: [x, 1 + 0.1 * r(C), r(inter, C, scale=C ** -0.5), r(inter, C, scale=C ** -0.5),
                              r(C, inter, scale=inter ** -0.5)],
    }[op]()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# --- the checks -----------------------------------------------------------------------

def _targets(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100  # ignored positions (padding)
    return t


def _bind(op: str, n: int, vocab: int, seed: int):
    """(forward, backward, reference) with every non-differentiable argument bound."""
    _, _, fwd, bwd, ref = OPS[op]
    if op != "cross_entropy":
        return fwd, bwd, ref
    t = _targets(n, vocab, seed)
    return (lambda z: fwd(z, t), lambda z, dy: (dy * cross_entropy_backward(z, t),),
            lambda z: F.cross_entropy(z, t, ignore_index=-100))


def _autograd(ref, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = ref(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, dy)


def compare_op(op: str, shape=(2, 8, 16), inter=40, vocab=50, seed=0, fd_eps=1e-6) -> dict:
    """Errors of one op's hand-written forward/backward, per argument.

    Returns ``output_error``, ``grad_errors`` (float64, vs autograd float64), ``fd_errors``
    (float64 hand backward vs central finite differences of the hand forward along a random
    direction), ``fp32_hand`` and ``fp32_autograd`` (float32 results vs the float64 reference).
    """
    names = OPS[op][0]
    x64 = make_inputs(op, shape, inter, vocab, torch.float64, seed)
    fwd, bwd, ref = _bind(op, x64[0].shape[0], vocab, seed)
    g = torch.Generator().manual_seed(seed + 2)
    out_ref = ref(*x64)
    dy = torch.randn(out_ref.shape, generator=g, dtype=torch.float64) if out_ref.dim() else torch.ones((), dtype=torch.float64)
    out_ref, g_ref = _autograd(ref, x64, dy)
    out64, g64 = fwd(*x64), bwd(*x64, dy)
    x32 = [t.float() for t in x64]
    out32, g32 = fwd(*x32), bwd(*x32, dy.float())
    out_ag32, g_ag32 = _autograd(ref, x32, dy.float())

    fd = {}
    for i, name in enumerate(names):
        u = torch.randn(x64[i].shape, generator=g, dtype=torch.float64)
        plus = [t + fd_eps * u if j == i else t for j, t in enumerate(x64)]
        minus = [t - fd_eps * u if j == i else t for j, t in enumerate(x64)]
        numeric = ((fwd(*plus) - fwd(*minus)) * dy).sum() / (2 * fd_eps)
        analytic = (g64[i] * u).sum()
        fd[name] = abs(numeric.item() - analytic.item()) / max(abs(analytic.item()), 1e-30)
    return dict(
        op=op,
        output_error=rel_err(out64, out_ref),
        grad_errors={n: rel_err(a, b) for n, a, b in zip(names, g64, g_ref)},
        fd_errors=fd,
        fp32_hand={"output": rel_err(out32, out_ref), **{n: rel_err(a, b) for n, a, b in zip(names, g32, g_ref)}},
        fp32_autograd={"output": rel_err(out_ag32, out_ref),
                       **{n: rel_err(a, b) for n, a, b in zip(names, g_ag32, g_ref)}},
    )


# Decision rule: accept when every float64 error is at most TOL64 and every
# finite-difference error at most TOL_FD; otherwise reject.
TOL64, TOL_FD = 1e-10, 1e-6
CANDIDATES = tuple(OPS)


def run(ctx) -> list:
    from bp_mech.workload import ARCHITECTURES

    arch = ARCHITECTURES[ctx.workload.arch]
    shape = (ctx.workload.batch, ctx.workload.seq, arch["hidden_size"])
    recs = []
    for op in ctx.progress(CANDIDATES, desc="ops"):
        c = compare_op(op, shape, arch["intermediate_size"], arch["vocab_size"], seed=ctx.workload.seed)
        worst = max(c["grad_errors"].values())
        ok = c["output_error"] <= TOL64 and worst <= TOL64 and max(c["fd_errors"].values()) <= TOL_FD
        recs.append(ctx.record(
            op, dtype="float64", output_error=c["output_error"], grad_error=worst, all_finite=True,
            decision="accept" if ok else "reject",
            next_step=None if ok else f"inspect the backward of {op}",
            metrics={k: c[k] for k in ("grad_errors", "fd_errors", "fp32_hand", "fp32_autograd")}
            | {"tolerances": {"float64": TOL64, "finite_difference": TOL_FD}},
        ))
    return recs


def conformance():
    """Hand-written MLP half-block vs transformers' Qwen2RMSNorm + Qwen2MLP (float32)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import qwen2_config

    cfg = qwen2_config("tiny")
    torch.manual_seed(0)
    norm, mlp = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), Qwen2MLP(cfg)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
    y = x + mlp(norm(x))
    dy = torch.randn_like(y)
    y.backward(dy)
    ws = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    with torch.no_grad():
        ours = mlp_block_backward(x, *ws, dy, eps=cfg.rms_norm_eps)
        errs = [rel_err(mlp_block_forward(x, *ws, eps=cfg.rms_norm_eps), y)]
    errs += [rel_err(a, b.grad) for a, b in zip(ours, [x] + ws)]
    worst = max(errs)
    return ConformanceRow("Part 02 · 09", "TRAIN-LOCAL-BACKWARD", "transformers Qwen2RMSNorm + Qwen2MLP (autograd)",
                          worst <= 1e-5, f"max rel. error {worst:.2e} over output and 5 gradients (tol 1e-5, float32)")
