"""Part 02 · 55's conformance row: ``update_dynamics.clip_by_global_norm_`` against
``torch.nn.utils.clip_grad_norm_`` on a tiny Qwen2's gradients, clipping hard, mildly and not at all."""

from __future__ import annotations

import torch

from bp_mech import update_dynamics
from bp_mech.instruments.workload import build_model, make_batches

CONFORMANCE_TOL = 1e-6  # float32: our clipping against clip_grad_norm_, norm and clipped gradients, relative


def conformance():
    """The conformance row: total norm and clipped gradients at max_norm 0.1, 1 and 1e6 (float32)."""
    from bp_mech.records.registry import ConformanceRow
    from bp_mech.instruments.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    model(**make_batches(w, 1)[0]).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    worst = 0.0
    for max_norm in (0.1, 1.0, 1e6):  # clipping hard, mildly, not at all
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        ours_norm = update_dynamics.clip_by_global_norm_(model.parameters(), max_norm)
        ours = [p.grad.clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        errors = [abs(ours_norm.item() - ref_norm.item()) / ref_norm.item()]
        errors += [((a - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                   for a, p in zip(ours, model.parameters())]
        worst = max(worst, *errors)
    return ConformanceRow("Part 02 · 55", "TRAIN-UPDATE-DYNAMICS", "torch.nn.utils.clip_grad_norm_",
                          worst <= CONFORMANCE_TOL, f"total norm and clipped gradients at max_norm 0.1, 1, 1e6: max "
                          f"rel. difference {worst:.2e} (tol {CONFORMANCE_TOL:g}, float32)")
