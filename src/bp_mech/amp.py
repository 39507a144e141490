"""Mixed-precision backward (TRAIN-AMP-BACKWARD): autocast, dynamic loss scaling, unscale before clip.

Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training") keeps float32 master
weights and runs the matmuls of forward and backward in 16 bits under ``torch.autocast``.
FP16 has a 5-bit exponent: its largest value is 65504; below 6.1e-5 values are subnormal (fewer
significant bits), down to 6e-8 (2^-24); below about half of that they round to zero. Dynamic loss
scaling multiplies the loss by S before ``backward()`` (so small gradients survive), divides the
gradients by S before the update (``unscale_``), and

* skips ``optimizer.step()`` when any unscaled gradient is inf/NaN, and backs off S *= 0.5;
* after ``growth_interval`` consecutive finite steps grows S *= 2 (if the result is finite).

``DynamicLossScaler`` is that rule in plain Python (``bp_mech.loss_scaling``). Clipping comes *after*
``unscale_``: the threshold is in the units of the true gradient
(``unscale_and_clip_``, with Part 02 · 55's global norm); ``clipping_order`` shows what clipping the
still-scaled gradients does to AdamW's updates. BF16 has float32's 8-bit exponent, so it needs no scaler;
it rounds harder (8-bit significand). A skipped step changes no parameter and must not advance the LR
clock (Part 02 · 12, ``UpdateClock``). The book's one training step (``bench.step.train_step``, and
``bench.trainer.Trainer`` for a loop) puts the pieces together with the framework's tools: autocast and
the GradScaler of the ``fp16`` strategy, ``unscale_`` before ``clip_grad_norm_``, the clock after the
scaler's step; a mechanism module sits below it and trains nothing itself, except ``clipping_order``'s
demonstration of the mistake. The experiment (FP32 against FP16 and BF16, the overflow sample, records,
decision) is ``bp_mech.experiments.amp``.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from bp_mech.scheduler import scaler_step
from bp_mech.update_dynamics import clip_coefficient, global_grad_norm
from bp_mech.instruments.adamw import make_adamw



def _clip_coef(norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """Part 02 · 55's clip coefficient min(1, max_norm / (norm + eps)) of a norm that is a Python float."""
    return float(clip_coefficient(torch.tensor(norm, dtype=torch.float64), max_norm, eps))


def unscale_and_clip_(grads: list[torch.Tensor], scale: float, max_norm: float,
                      eps: float = 1e-6):
    """In place: g <- g / S, then clip by the *unscaled* total norm, as clip_grad_norm_.

    Nothing is clipped when a gradient is inf/NaN: that step is skipped anyway.

    Args:
        grads: the gradients of a step, scaled by S; modified in place.
        scale: S, the loss scale of that step.
        max_norm: the clip threshold, in the units of the true (unscaled) gradient.
        eps: added to the norm in the clip coefficient, as ``clip_grad_norm_``.

    Returns:
        ``(total_norm, clip_coef, found_inf)`` with
        total_norm = ||(g_1/S, ..., g_n/S)||_2 (a float),
        clip_coef = min(1, max_norm / (total_norm + eps)) (1.0 when found_inf) and
        found_inf True when the norm is inf/NaN.

    Example:
        >>> g = [torch.tensor([300.0, 400.0])]  # S = 100: the true (3, 4) has norm 5
        >>> total, coef, found_inf = unscale_and_clip_(g, scale=100.0, max_norm=1.0)
        >>> unscaled = [round(x, 4) for x in g[0].tolist()]
        >>> round(total, 4), round(coef, 4), found_inf, unscaled
        (5.0, 0.2, False, [0.6, 0.8])
    """
    for g in grads:
        g.mul_(1.0 / scale)
    total = global_grad_norm(grads).item()
    found_inf = not math.isfinite(total)
    coef = 1.0 if found_inf else _clip_coef(total, max_norm, eps)
    if not found_inf:
        for g in grads:
            g.mul_(coef)
    return total, coef, found_inf


def autocast(device_type: str, low: torch.dtype | None):
    """``torch.autocast`` to ``low``, or ``nullcontext()`` for plain FP32.

    Args:
        device_type: "cpu" or "cuda" (``torch.device(device).type``).
        low: the 16-bit dtype (``torch.float16`` or ``torch.bfloat16``), or None for FP32.

    Returns:
        A context manager.

    Example:
        >>> with autocast("cpu", torch.bfloat16):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    return contextlib.nullcontext() if low is None else torch.autocast(device_type, dtype=low)


def autocast_dtypes(model, batch: dict, device_type: str, low: torch.dtype | None) -> dict[str, str]:
    """Output dtype per module type in one forward under ``autocast`` (what runs in 16 bits).

    Args:
        model: a Transformers model; ``model(**batch)`` returns ``.logits`` and ``.loss``.
        batch: its inputs (``input_ids`` and ``labels``).
        device_type: "cpu" or "cuda".
        low: the autocast dtype, or None for FP32.

    Returns:
        Module class name (plus "(logits)" and "(loss)") -> the dtypes its outputs had,
        without "torch." and joined by "/" when several.

    Example:
        >>> from bp_mech.instruments.workload import (build_model, make_batches,
        ...                                           parse_workload)
        >>> w = parse_workload("tiny-b1s8")
        >>> d = autocast_dtypes(build_model(w), make_batches(w, 1)[0], "cpu", torch.bfloat16)
        >>> d["Linear"], d["Qwen2RMSNorm"], d["(loss)"]
        ('bfloat16', 'float32', 'float32')
    """
    seen: dict[str, set] = {}

    def hook(mod, args, out):
        out = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(out):
            seen.setdefault(type(mod).__name__, set()).add(str(out.dtype).removeprefix("torch."))

    hooks = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad(), autocast(device_type, low):
            out = model(**batch)
    finally:
        for h in hooks:
            h.remove()
    seen["(logits)"], seen["(loss)"] = {str(out.logits.dtype)[6:]}, {str(out.loss.dtype)[6:]}
    return {k: "/".join(sorted(v)) for k, v in seen.items()}


# clipping_order on the page: tiny-b2s64, lr 1e-3. Its gradient norm starts near 3 and settles near 2
# within a few updates, so at this max_norm the correct run clips only its first updates.
CLIP_DEMO_MAX_NORM = 2.25
CLIP_DEMO_UPDATES = 10


def clipping_order(base, batches: list[dict], max_norm: float, scale: float = 2.0**16,
                   lr: float = 1e-3, adam_eps: float = 1e-8,
                   device: str = "cpu") -> list[dict]:
    """The clipping bug, measured: clip after ``unscale_`` (correct) against before it.

    Two AdamW runs (constant ``lr``, ``eps=adam_eps``) from the same weights on the same
    batches, FP16 autocast and a GradScaler held at ``scale``: (a) unscale, then clip at
    ``max_norm`` (correct); (b) clip the still-scaled gradients, and let ``scaler.step``
    unscale them afterwards (the bug). A loop of its own, not the book's one training
    step (``bench.step.train_step`` always unscales before it clips): (b) is the
    mistake being shown, which no strategy should carry, and (a) runs beside it the
    same way, so the two differ only in where the clip sits. AdamW: ``make_adamw``'s.

    Args:
        base: the model both runs copy (``copy.deepcopy``; ``base`` itself is not
            trained).
        batches: one batch per update (``input_ids`` and ``labels``).
        max_norm: the clip threshold.
        scale: the loss scale, held fixed (the scaler never grows).
        lr: AdamW's constant learning rate.
        adam_eps: AdamW's eps.
        device: where the runs train.

    Returns:
        One dict per update, with key suffix _a / _b per run: ``loss``, ``norm`` (as
        ``clip_grad_norm_`` saw it: b's is ``scale`` times the true one), ``clipped``,
        ``clip_coef`` (min(1, max_norm / (norm + 1e-6))), ``applied``, ``grad_median``
        (the median |gradient| element AdamW received), and
        ``update_rel_diff`` = ||Δp_b - Δp_a|| / ||Δp_a||.

    Example:
        >>> from bp_mech.instruments.workload import (build_model, make_batches,
        ...                                           parse_workload)
        >>> w = parse_workload("tiny-b1s8")
        >>> model, batches = build_model(w), make_batches(w, 1)
        >>> row = clipping_order(model, batches, max_norm=1.0, scale=2.0**10)[0]
        >>> ratio = round(row["norm_b"] / row["norm_a"])
        >>> ratio, row["clipped_b"], row["update_rel_diff"] > 0
        (1024, True, True)
    """
    runs = []
    for clip_scaled in (False, True):
        model = copy.deepcopy(base).to(device)
        opt = make_adamw(model.parameters(), lr, device, eps=adam_eps)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=scale,
                                      growth_interval=2**30)
        runs.append((model, opt, scaler, clip_scaled))
    rows = []
    for b in batches:
        row, deltas = {}, []
        for model, opt, scaler, clip_scaled in runs:
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            with autocast(torch.device(device).type, torch.float16):
                loss = model(**b).loss
            scaler.scale(loss).backward()
            if not clip_scaled:
                scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            coef, key = _clip_coef(norm, max_norm), "b" if clip_scaled else "a"
            row.update({f"loss_{key}": loss.item(), f"norm_{key}": norm,
                        f"clipped_{key}": coef < 1.0, f"clip_coef_{key}": coef,
                        f"applied_{key}": scaler_step(scaler, opt),  # unscales (b) too
                        f"grad_median_{key}": torch.cat([p.grad.reshape(-1)
                                                         for p in model.parameters()])
                        .abs().median().item()})  # what AdamW saw, per element
            deltas.append([p.detach() - q for p, q in zip(model.parameters(), before)])
        diff = global_grad_norm([x - y for x, y in zip(*deltas)],
                                dtype=torch.float64).item()
        size = global_grad_norm(deltas[0], dtype=torch.float64).item()
        rows.append(dict(row, update_rel_diff=diff / size if size > 0 else math.nan))
    return rows
