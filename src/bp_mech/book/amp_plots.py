"""Mixed-precision backward: the fp16 range against the gradients of a real tiny step.

Under autocast every ``nn.Linear`` (the projections, the MLP, the LM head) computes in float16, so
the gradient its backward receives, the gradient of the loss with respect to its output, is held
in float16. ``matmul_output_gradients`` records those gradients in a plain float32 step (their
true values); ``StepGradients`` says what float16 would make of them, unscaled and scaled by a
loss scale; ``plot_fp16_range`` draws their histogram against the format's range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bp_mech.book.plots import figure


@dataclass(frozen=True)
class Fp16Range:
    """The float16 landmarks, from ``torch.finfo`` and the bit pattern 0...01."""

    subnormal: float  # smallest positive subnormal, 2^-24: below half of it a value rounds to 0
    normal: float  # smallest positive normal, 2^-14: below it, fewer significant bits
    max: float  # largest finite value: above it (after rounding) a value becomes inf


def fp16_range() -> Fp16Range:
    """The float16 range.

    Returns:
        an ``Fp16Range``.

    Example:
        >>> r = fp16_range()
        >>> r.subnormal == 2.0**-24, r.normal == 2.0**-14, r.max
        (True, True, 65504.0)
    """
    fi = torch.finfo(torch.float16)
    sub = torch.tensor(1, dtype=torch.int16).view(torch.float16).item()
    return Fp16Range(sub, fi.smallest_normal, fi.max)


@dataclass(frozen=True)
class StepGradients:
    """The magnitudes of the gradients 16-bit matmuls receive in one step, float32, nonzero."""

    values: torch.Tensor  # |g|, 1-D float32, every nonzero element
    zeros: int  # elements that were exactly 0 already in float32
    workload: str

    def underflow(self, scale: float = 1.0) -> float:
        """Share of ``values`` that float16 rounds to 0 once multiplied by ``scale``."""
        return ((self.values * scale).half() == 0).float().mean().item()

    def subnormal(self, scale: float = 1.0) -> float:
        """Share stored as a nonzero float16 subnormal (fewer significant bits)."""
        h = (self.values * scale).half()
        return ((h != 0) & (h.abs() < fp16_range().normal)).float().mean().item()

    def overflow(self, scale: float = 1.0) -> float:
        """Share that becomes inf in float16 once multiplied by ``scale``."""
        return torch.isinf((self.values * scale).half()).float().mean().item()


def matmul_output_gradients(workload: str = "tiny-b2s64") -> StepGradients:
    """One float32 forward and backward of the workload's model on its first batch, recording the
    gradient of the loss with respect to the output of every ``nn.Linear``.

    Args:
        workload: a workload id (``instruments.workload.parse_workload``).

    Returns:
        a ``StepGradients`` of their magnitudes.
    """
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload

    w = parse_workload(workload)
    model, batch = build_model(w), make_batches(w, 1)[0]
    grads: list[torch.Tensor] = []

    def keep(module, grad_in, grad_out):
        grads.append(grad_out[0].detach().float().flatten())

    hooks = [m.register_full_backward_hook(keep) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        model(**batch).loss.backward()
    finally:
        for h in hooks:
            h.remove()
    g = torch.cat(grads).abs()
    return StepGradients(g[g > 0], int((g == 0).sum()), w.workload_id)


def plot_fp16_range(grads: StepGradients, scale: float, title: str):
    """Histogram of log2 |g|, unscaled and times ``scale``, against float16's range: the share below
    half the smallest subnormal (rounds to 0), subnormal, and above the largest finite value (inf)."""
    import math

    r = fp16_range()
    fig, ax = figure(7.0, 4.6)
    lo = math.floor(math.log2(grads.values.min().item())) - 1
    hi = max(math.ceil(math.log2(grads.values.max().item() * scale)), math.ceil(math.log2(r.max))) + 2
    bins = torch.arange(lo, hi + 0.25, 0.25).tolist()
    for label, s, color in (("unscaled", 1.0, "C0"), (f"scaled by S = {scale:g}", scale, "C1")):
        x = torch.log2(grads.values * s).numpy()
        ax.hist(x, bins=bins, color=color, alpha=0.55,
                label=f"{label}: {grads.underflow(s):.2%} → 0, {grads.subnormal(s):.0%} subnormal, "
                      f"{grads.overflow(s):.2%} → inf")
    zero = math.log2(r.subnormal / 2)
    ax.axvspan(lo, zero, color="C3", alpha=0.12, label="rounds to 0 in fp16")
    ax.axvspan(zero, math.log2(r.normal), color="grey", alpha=0.12, label="fp16 subnormal")
    ax.axvspan(math.log2(r.max), hi, color="C3", alpha=0.25, label="inf in fp16")
    for v, name, side, down in ((r.subnormal, "smallest subnormal", "right", 4), (r.normal, "smallest normal", "left", 4),
                                (r.max, "largest finite", "right", 28)):  # away from its neighbours, in the frame
        ax.axvline(math.log2(v), color="k", lw=0.8, ls="--")
        ax.annotate(f"{name}\n{v:.3g}", (math.log2(v), 1), xycoords=("data", "axes fraction"), ha=side,
                    xytext=(-3 if side == "right" else 3, -down), textcoords="offset points", va="top", fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_yscale("log")
    ax.set_xlabel("log2 |gradient element|")
    ax.set_ylabel("elements")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return fig
