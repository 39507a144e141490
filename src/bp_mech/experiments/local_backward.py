"""Part 02 · 09 — TRAIN-LOCAL-BACKWARD, the experiment: every hand-written op of
``bp_mech.local_backward`` against an independent reference.

Every op is checked three ways (``compare_op``): against autograd in float64 (tight), against
central finite differences along a random direction in float64, and the same hand-written code
in float32 against the float64 reference (the rounding a real run sees). One record per op; the
decision rule is ``decide``. Nothing is timed: a local backward has no benchmark of its own.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from bp_mech import local_backward, local_backward_gelu
from bp_mech.bench.compare import relative_error
from bp_mech.instruments.workload import ARCHITECTURES
from bp_mech.records.decision import Decision

# --- the op table: inputs, hand-written pair, independent reference ------------------


def _reference_mlp(x, Wg, Wu, Wd):
    return F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)


def _reference_block(x, w, Wg, Wu, Wd):
    return x + _reference_mlp(F.rms_norm(x, (x.shape[-1],), w, 1e-6), Wg, Wu, Wd)


def _linear_backward_with_bias(x, W, b, dy):
    return local_backward.linear_backward(x, W, dy)


class Op(NamedTuple):
    """One op as the checks call it."""

    args: tuple[str, ...]  # argument names, in call order; the backward returns their gradients in this order
    forward: Callable  # hand-written forward(*args)
    backward: Callable | None  # hand-written backward(*args, dy) -> gradients (None: bound in ``_bind``)
    reference: Callable  # the torch op (F.*), differentiated by autograd


OPS = {
    "linear": Op(("x", "W", "b"), local_backward.linear_forward, _linear_backward_with_bias, F.linear),
    "silu": Op(("x",), local_backward.silu_forward, lambda x, dy: (local_backward.silu_backward(x, dy),), F.silu),
    "gelu": Op(("x",), local_backward_gelu.gelu_forward, lambda x, dy: (local_backward_gelu.gelu_backward(x, dy),), F.gelu),
    "rmsnorm": Op(("x", "w"), local_backward.rmsnorm_forward, local_backward.rmsnorm_backward,
                  lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    "swiglu_mlp": Op(("x", "Wg", "Wu", "Wd"), local_backward.swiglu_mlp_forward, local_backward.swiglu_mlp_backward,
                     _reference_mlp),
    "cross_entropy": Op(("logits",), local_backward.cross_entropy_forward, None, F.cross_entropy),
    "mlp_block": Op(("x", "w", "Wg", "Wu", "Wd"), local_backward.mlp_block_forward, local_backward.mlp_block_backward,
                    _reference_block),
}
CANDIDATES = tuple(OPS)


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


# --- the checks -----------------------------------------------------------------------

def _targets(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100  # ignored positions (padding)
    return t


def _bind(op: str, n: int, vocab: int, seed: int):
    """(forward, backward, reference) with every non-differentiable argument bound."""
    _, fwd, bwd, ref = OPS[op]
    if op != "cross_entropy":
        return fwd, bwd, ref
    t = _targets(n, vocab, seed)
    return (lambda z: fwd(z, t), lambda z, dy: (dy * local_backward.cross_entropy_backward(z, t),),
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
    names = OPS[op].args
    x64 = make_inputs(op, shape, inter, vocab, torch.float64, seed)
    fwd, bwd, ref = _bind(op, x64[0].shape[0], vocab, seed)
    g = torch.Generator().manual_seed(seed + 2)
    out_ref = ref(*x64)
    dy = (torch.randn(out_ref.shape, generator=g, dtype=torch.float64) if out_ref.dim()
          else torch.ones((), dtype=torch.float64))  # a scalar loss: dL/dL = 1
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
        output_error=relative_error(out64, out_ref),
        grad_errors={n: relative_error(a, b) for n, a, b in zip(names, g64, g_ref)},
        fd_errors=fd,
        fp32_hand={"output": relative_error(out32, out_ref),
                   **{n: relative_error(a, b) for n, a, b in zip(names, g32, g_ref)}},
        fp32_autograd={"output": relative_error(out_ag32, out_ref),
                       **{n: relative_error(a, b) for n, a, b in zip(names, g_ag32, g_ref)}},
    )


# --- the decision, the run ------------------------------------------------------------

# Decision rule: accept when every float64 error (output and gradients, vs float64 autograd) is at
# most TOL64 and every finite-difference error at most TOL_FD; otherwise reject.
TOL64 = 1e-10  # float64 rounding is near 1e-16: more than this is a different formula
TOL_FD = 1e-6  # central differences at eps 1e-6: truncation O(eps^2) and cancellation O(u/eps) stay far below


def decide(op: str, output_error: float, grad_error: float,
           fd_error: float) -> Decision:
    """One op's decision from its worst errors (``compare_op``), by the rule above.

    Args:
        op: the op checked.
        output_error: its float64 output's relative error (vs float64 autograd).
        grad_error: its worst float64 gradient's relative error (likewise).
        fd_error: its worst finite-difference error.

    Returns:
        The ``Decision``; its reason names the errors and their bounds.

    Example:
        >>> decide("rmsnorm", 1e-16, 1e-8, 1e-9).reason
        'rmsnorm: gradient error 1e-08 > TOL64 1e-10'
    """
    checks = ((f"output error {output_error:.2g}", output_error, "TOL64", TOL64),
              (f"gradient error {grad_error:.2g}", grad_error, "TOL64", TOL64),
              (f"finite-difference error {fd_error:.2g}", fd_error, "TOL_FD", TOL_FD))
    why = [f"{what} > {name} {tol:g}" for what, err, name, tol in checks
           if not err <= tol]  # NaN fails
    if why:
        return Decision("reject", f"{op}: " + "; ".join(why),
                        f"inspect the backward of {op}")
    return Decision("accept", f"{op}: " + ", ".join(
        f"{what} <= {name} {tol:g}" for what, _, name, tol in checks))


def _shapes(w) -> tuple[tuple[int, int, int], int, int]:
    """((B, T, C), MLP width, vocabulary) of workload ``w``: the inputs every op is checked on."""
    arch = ARCHITECTURES[w.arch]
    return (w.batch, w.seq, arch["hidden_size"]), arch["intermediate_size"], arch["vocab_size"]


def dry_run(ctx) -> dict:
    shape, inter, vocab = _shapes(ctx.workload)
    return dict(input_shape=list(shape), mlp_width=inter, vocab=vocab,
                checks="float64 vs autograd, float64 finite differences, float32 rounding vs the float64 reference",
                tolerances={"float64": TOL64, "finite_difference": TOL_FD},
                note="values only, nothing timed; computed on the CPU in every mode")


def run(ctx) -> list:
    shape, inter, vocab = _shapes(ctx.workload)
    recs = []
    for op in ctx.progress(CANDIDATES, desc="ops"):
        c = compare_op(op, shape, inter, vocab, seed=ctx.workload.seed)
        decided = decide(op, c["output_error"], max(c["grad_errors"].values()), max(c["fd_errors"].values()))
        recs.append(ctx.record(
            op, dtype="float64", output_error=c["output_error"], grad_error=max(c["grad_errors"].values()),
            all_finite=True, **decided.record_fields(),
            metrics={k: c[k] for k in ("grad_errors", "fd_errors", "fp32_hand", "fp32_autograd")}
            | {"tolerances": {"float64": TOL64, "finite_difference": TOL_FD}},
        ))
    return recs


CONFORMANCE_TOL = 1e-5  # float32: the hand-written block and transformers' modules differ by rounding only


def conformance():
    """Hand-written MLP half-block vs transformers' Qwen2RMSNorm + Qwen2MLP (float32)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    from bp_mech.records.registry import ConformanceRow
    from bp_mech.instruments.workload import qwen2_config

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
        ours = local_backward.mlp_block_backward(x, *ws, dy, eps=cfg.rms_norm_eps)
        errs = [relative_error(local_backward.mlp_block_forward(x, *ws, eps=cfg.rms_norm_eps), y)]
    errs += [relative_error(a, b.grad) for a, b in zip(ours, [x] + ws)]
    worst = max(errs)
    return ConformanceRow("Part 02 · 09", "TRAIN-LOCAL-BACKWARD", "transformers Qwen2RMSNorm + Qwen2MLP (autograd)",
                          worst <= CONFORMANCE_TOL, f"max rel. error {worst:.2e} over output and 5 gradients "
                          f"(tol {CONFORMANCE_TOL:g}, float32)")
