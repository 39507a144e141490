"""Part 02 · 55 — update dynamics: how big is each update, and does clipping bound it?

Per update, what a training log needs to see a bad step before the loss curve does:

* the total gradient norm  ||g|| = sqrt(sum_i ||g_i||^2)  over all parameters, before clipping
  (``global_grad_norm``: the book's one global norm, used wherever a global L2 norm is taken);
* the clip coefficient  c = min(1, max_norm / (||g|| + eps))  (eps = 1e-6, as in
  ``torch.nn.utils.clip_grad_norm_``); global-norm clipping (Pascanu et al. 2013, "On the
  difficulty of training recurrent neural networks") scales every gradient by the same c;
* per parameter group (``param_groups``: embedding, attention, MLP, norms and biases): the update
  norm ||p_after - p_before|| and the update-to-parameter ratio ||p_after - p_before|| / ||p_before||.

The experiment (base LR, high LR, high LR with clipping; traces, timing, decision) is
``bp_mech.experiments.update_dynamics``.
"""

from __future__ import annotations

import math

import torch

from bp_mech.bench.workload import make_adamw

EPS = 1e-6  # the eps of clip_grad_norm_'s coefficient
GROUPS = ("embedding", "attention", "mlp", "norm_bias")  # parameter groups, by role


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


def make_optimizer(model, lr: float, weight_decay: float, device):
    """AdamW with one group per role: ``weight_decay`` on the embedding, attention and MLP matrices, none
    on norms and biases."""
    g = param_groups(model)
    return make_adamw([dict(params=g[k], weight_decay=0.0 if k == "norm_bias" else weight_decay, name=k)
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
    before = list(before)
    du = global_grad_norm(a.detach().double() - b.double() for b, a in zip(before, after)).item()
    pn = global_grad_norm(before, dtype=torch.float64).item()
    return du, pn, du / pn if pn > 0 else math.inf
