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

from bp_mech.instruments.adamw import make_adamw

EPS = 1e-6  # the eps of clip_grad_norm_'s coefficient
GROUPS = ("embedding", "attention", "mlp", "norm_bias")  # parameter groups, by role


def group_of(name: str) -> str:
    """The role of a Qwen2 parameter, from its name.

    Embedding and ``lm_head`` first, then norms and every bias, then attention; the rest is MLP.

    Args:
        name: a parameter name as ``model.named_parameters()`` gives it.

    Returns:
        One of ``GROUPS``: "embedding", "attention", "mlp" or "norm_bias".

    Example:
        >>> [group_of(f"model.layers.0.self_attn.q_proj.{k}") for k in ("weight", "bias")]
        ['attention', 'norm_bias']
        >>> group_of("lm_head.weight"), group_of("model.layers.0.mlp.up_proj.weight")
        ('embedding', 'mlp')
    """
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name or name.endswith(".bias"):
        return "norm_bias"
    return "attention" if "self_attn" in name else "mlp"


def param_groups(model) -> dict[str, list[torch.nn.Parameter]]:
    """The parameters of ``model`` split by role (``group_of``); a tied weight appears once.

    Args:
        model: an ``nn.Module`` with Qwen2-style parameter names.

    Returns:
        A dict from each name in ``GROUPS`` (all present, in that order) to its list of parameters.

    Example:
        >>> m = torch.nn.ModuleDict(dict(embed_tokens=torch.nn.Embedding(10, 4), self_attn=torch.nn.Linear(4, 4)))
        >>> {k: len(v) for k, v in param_groups(m).items()}
        {'embedding': 1, 'attention': 1, 'mlp': 0, 'norm_bias': 1}
    """
    groups: dict[str, list] = {g: [] for g in GROUPS}
    for n, p in model.named_parameters():  # tied weights appear once
        groups[group_of(n)].append(p)
    return groups


def grouped_adamw(model, lr: float, weight_decay: float, device):
    """AdamW with one parameter group per role (``param_groups``).

    ``weight_decay`` on the embedding, attention and MLP matrices, none on norms and biases.

    Args:
        model: the model whose parameters are split by ``param_groups``; empty groups are left out.
        lr: learning rate of every group.
        weight_decay: decoupled weight decay of the embedding, attention and MLP groups.
        device: where the parameters live: fused AdamW on CUDA, foreach elsewhere.

    Returns:
        A ``torch.optim.AdamW`` whose param groups carry a ``name`` (the role).

    Example:
        >>> m = torch.nn.ModuleDict(dict(embed_tokens=torch.nn.Embedding(10, 4), norm=torch.nn.LayerNorm(4)))
        >>> opt = grouped_adamw(m, lr=1e-3, weight_decay=0.1, device="cpu")
        >>> [(g["name"], g["weight_decay"]) for g in opt.param_groups]
        [('embedding', 0.1), ('norm_bias', 0.0)]
    """
    g = param_groups(model)
    return make_adamw([dict(params=g[k], weight_decay=0.0 if k == "norm_bias" else weight_decay, name=k)
                       for k in GROUPS if g[k]], lr, device)


# --- from scratch: the global norm, the clip coefficient, the update ratio -----------------

def global_grad_norm(tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """sqrt(sum_i ||g_i||_2^2) over all tensors (None skipped): the book's global norm.

    Args:
        tensors: an iterable (a generator is fine) of tensors or None; detached before
            the norm.
        dtype: the dtype to compute the norms in, e.g. float64 to compare norms across
            runs; None keeps the tensors' dtype.

    Returns:
        A 0-dim tensor in the tensors' dtype (or in ``dtype``); ``torch.zeros(())`` when
        there are none.

    Example:
        >>> global_grad_norm([torch.tensor([3.0]), None, torch.tensor([4.0])]).item()
        5.0
    """
    # one norm per tensor, then the norm of those norms
    norms = [torch.linalg.vector_norm(g.detach(), dtype=dtype)
             for g in tensors if g is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_coefficient(total_norm, max_norm: float, eps: float = EPS):
    """c = min(1, max_norm / (total_norm + eps)): gradients are only scaled down.

    Args:
        total_norm: the global gradient norm, a 0-dim tensor (``global_grad_norm``).
        max_norm: the largest total norm allowed after clipping.
        eps: added to the norm, as in ``torch.nn.utils.clip_grad_norm_``.

    Returns:
        c, a 0-dim tensor in (0, 1].

    Example:
        >>> round(clip_coefficient(torch.tensor(10.0), 1.0).item(), 4)  # 1 / (10 + eps)
        0.1
        >>> clip_coefficient(torch.tensor(0.5), 1.0).item()  # never scales up
        1.0
    """
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def clip_by_global_norm_(params, max_norm: float, eps: float = EPS) -> torch.Tensor:
    """Scale every gradient in place by one global coefficient; return the prior norm.

    Args:
        params: an iterable of parameters; those whose ``grad`` is None are skipped.
        max_norm: the largest total norm allowed after clipping.
        eps: as in ``clip_coefficient``.

    Returns:
        The total gradient norm before clipping, a 0-dim tensor (``global_grad_norm``).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
        >>> clip_by_global_norm_([p], max_norm=1.0).item()
        5.0
        >>> [round(g, 4) for g in p.grad.tolist()]
        [0.6, 0.8]
    """
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(p.grad for p in params)
    c = clip_coefficient(total, max_norm, eps)
    for p in params:
        p.grad.mul_(c.to(p.grad.device))
    return total


def update_ratio(before, after) -> tuple[float, float, float]:
    """(||after - before||, ||before||, ratio) of a group (global L2, float64).

    Args:
        before: an iterable of tensors, the group's parameters before the update.
        after: the same tensors after the update, in the same order and shapes.

    Returns:
        (update norm, parameter norm, update norm / parameter norm) as floats; the ratio
        is ``math.inf`` when the parameter norm is 0.

    Example:
        >>> update_ratio([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.5])])
        (0.5, 5.0, 0.1)
    """
    before = list(before)
    du = global_grad_norm(a.detach().double() - b.double()
                          for b, a in zip(before, after)).item()
    pn = global_grad_norm(before, dtype=torch.float64).item()
    return du, pn, du / pn if pn > 0 else math.inf
