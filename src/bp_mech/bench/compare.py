"""Numbers compared: relative errors, finiteness, and a strategy's step against the plain one.

* ``relative_error``: max |a - b| / max |b| (elementwise, float64), the error of one tensor;
* ``relative_l2``: ||a - b|| / ||b - base|| over a list of tensors (the global L2 norm, float64), the
  error of a whole gradient or of an update;
* ``all_finite``;
* ``compare``: a strategy's probe (loss and gradients from the same weights) against the plain probe,
  with ``tolerance(strategy, device)``: what the strategy changes in the arithmetic decides how close
  it must be. A NaN or inf difference is an infinite error: it never passes a tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

# Equality with the plain step, (loss, gradient) relative tolerances, by what a strategy changes:
EXACT_TOL = {"cpu": (0.0, 0.0),  # checkpointing, offload: the same operations (CPU kernels are deterministic)
             "cuda": (1e-6, 1e-4)}  # fp32 CUDA: a recompute may pick other kernels, backward may reassociate
REORDER_TOL = (1e-5, 1e-4)  # accumulation, chunked loss: float32 sums in another order (~1e-6 seen)
LOW_TOL = (1e-2, 5e-2)  # fp16/bf16 autocast: matmuls rounded to 11-bit (8-bit) significands, L layers deep


def tolerance(strategy, device) -> tuple[float, float]:
    """(loss, gradient) relative tolerance of ``strategy`` (a ``bench.strategy.Strategy``) against the
    plain step on ``device``: LOW_TOL under autocast, REORDER_TOL with micro-batches or the chunked loss,
    else EXACT_TOL of the device."""
    if strategy.amp is not None:
        return LOW_TOL
    if strategy.micro_batches > 1 or strategy.chunked_loss is not None:
        return REORDER_TOL
    return EXACT_TOL[torch.device(device).type]


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when every given tensor (None skipped) holds only finite values."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in float64 (absolute when b is all 0); NaN when either holds one."""
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if b.numel() == 0:
        return 0.0
    diff = (a.to(b.device) - b).abs()
    if torch.isnan(diff).any():
        return math.nan
    scale = b.abs().max().item()
    return diff.max().item() / (scale if scale > 0 else 1.0)


def relative_l2(tensors, ref, base=None) -> float:
    """||a - r|| / ||r - base|| over all tensors (the global L2 norm, float64, on a's device); base None:
    ||r||. With ``base`` the initial parameters, the error of the parameters relative to the update."""
    from bp_mech.update_dynamics import global_grad_norm

    ref = list(ref)
    pairs = list(zip(tensors, ref, base if base is not None else [None] * len(ref)))
    f64 = lambda t, a: t.detach().to(a.device, torch.float64)  # noqa: E731
    num = global_grad_norm(a.detach().double() - f64(r, a) for a, r, _ in pairs).item()
    den = global_grad_norm(f64(r, a) - (0 if b is None else f64(b, a)) for a, r, b in pairs).item()
    return num / den if den > 0 else num


@dataclass(frozen=True)
class Comparison:
    """A probe against the plain probe: relative errors (inf for a non-finite difference)."""

    loss_error: float  # |loss - plain loss| / |plain loss|
    grad_error: float  # max over parameters of ``relative_error`` (inf when one side has no gradient)
    grad_norm_error: float  # |norm - plain norm| / plain norm
    bitwise: bool  # loss and every gradient bit for bit equal

    def within(self, tol: tuple[float, float]) -> bool:
        """Loss and gradient errors within (loss, gradient) tolerance ``tol``."""
        return self.loss_error <= tol[0] and self.grad_error <= tol[1]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def compare(ref, got) -> Comparison:
    """``got`` against ``ref`` (two ``bench.step.Probe``): loss, every gradient, the gradient norm."""
    loss_err = _finite(abs(got.loss - ref.loss) / max(abs(ref.loss), 1e-30))
    bitwise, grad_err = loss_err == 0.0, 0.0
    for a, b in zip(got.grads, ref.grads):
        if a is None or b is None:
            grad_err, bitwise = (grad_err, bitwise) if a is b else (math.inf, False)
            continue
        err = relative_error(a, b)
        bitwise = bitwise and err == 0.0
        grad_err = max(grad_err, _finite(err))
    norm_err = _finite(abs(got.grad_norm - ref.grad_norm) / max(ref.grad_norm, 1e-30))
    return Comparison(loss_err, grad_err, norm_err, bitwise)
