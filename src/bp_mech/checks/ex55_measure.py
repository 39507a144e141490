"""Checks of exercises/ex55_update_dynamics.py, the prediction: against a real optimizer step (``engine.Contract``).

``predict_first_update_norm`` is held to ``torch.optim.SGD`` (within 1e-9: the update is linear in g, a
``promise``) and ``torch.optim.AdamW`` (within 1e-3: its eps against gradient elements far larger than it),
one float64 parameter, clipped by ``clip_grad_norm_``, one first step; never the answer file.
"""

import torch
from hypothesis import strategies as st

from bp_mech.checks.engine import Contract


def measured_first_update_norm(optimizer, numel, grad_norm, max_norm, lr) -> float:
    """||p_1 - p_0|| of a real first step: a float64 parameter, a gradient of norm ``grad_norm`` whose every
    element is far from zero, ``clip_grad_norm_(max_norm)``, then ``torch.optim.SGD`` or ``AdamW`` (weight
    decay 0).

    Args:
        optimizer: "sgd" or "adamw".
        numel, grad_norm, max_norm, lr: as ``predict_first_update_norm``'s.

    Returns:
        the measured update norm, a float.

    Example:
        >>> round(measured_first_update_norm("sgd", 4, 2.0, 1.0, 0.1), 6)
        0.1
    """
    g = torch.Generator().manual_seed(numel)
    p = torch.nn.Parameter(torch.randn(numel, generator=g, dtype=torch.float64))
    grad = torch.sign(torch.randn(numel, generator=g, dtype=torch.float64)) * (
        0.5 + torch.rand(numel, generator=g, dtype=torch.float64))
    p.grad = grad * (grad_norm / grad.norm())
    torch.nn.utils.clip_grad_norm_([p], max_norm)
    opt = torch.optim.SGD([p], lr=lr) if optimizer == "sgd" else torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    before = p.detach().clone()
    opt.step()
    return (p.detach() - before).norm().item()


def _sgd_exact(case, call, at):
    """SGD's update is linear in g: the prediction within 1e-9 (AdamW's: 1e-3, its eps against |g|)."""
    if case["optimizer"] == "sgd":
        got, want = call(), measured_first_update_norm(**{k: v for k, v in case.items() if k != "seed"})
        if isinstance(got, float) and not abs(got - want) <= 1e-9 * abs(want):
            raise AssertionError(f"predict_first_update_norm: the prediction is {got:.12g}, a real torch.optim.SGD "
                                 f"step gives {want:.12g} (rel error > 1e-09: SGD's update is linear in g) at {at}")


NAMES = {"sgd": "SGD", "adamw": "AdamW"}


def _predict(optimizer, numel, grad_norm, max_norm, lr):
    return {"optimizer": optimizer, "numel": numel, "grad_norm": grad_norm, "max_norm": max_norm, "lr": lr}


PREDICT = Contract(
    "predict_first_update_norm", lambda c: {**c, "optimizer": "".join(c["optimizer"])},  # a str built at run time
    lambda **a: (measured_first_update_norm(**a),),
    ("the prediction",), returns=float, tol=1e-3, promise=_sgd_exact,
    ref_name="a real torch.optim step (float64)", note=lambda c: f"a real torch.optim.{NAMES[c['optimizer']]} step",
    draw=st.builds(_predict, st.sampled_from(["sgd", "adamw"]), st.integers(1, 400), st.sampled_from([0.3, 2.0, 50.0]),
                   st.sampled_from([0.1, 1.0, 10.0]), st.sampled_from([1e-4, 1e-2, 0.5])),
    examples={"": [_predict("sgd", 10, 2.0, 1.0, 0.1), _predict("sgd", 7, 0.3, 1.0, 0.01),
                   _predict("adamw", 100, 50.0, 1.0, 1e-3), _predict("adamw", 1, 0.3, 10.0, 0.5)]})
