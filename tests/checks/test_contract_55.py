"""Mutant tests of Part 02 · 55's contract checks (``bp_mech.checks.ex55_contract``): each wrong solution
breaks one documented property, and is otherwise right."""

import math

import pytest
import torch
from conftest import mutant

from bp_mech import update_dynamics as ud
from bp_mech.checks import ex55_contract as c

pytestmark = pytest.mark.ch55
NAME = "ex55_update_dynamics"




def _check(check, match, **over):
    function = next(iter(over))
    with pytest.raises(AssertionError, match=f"^{function}: .*(?:{match})"):
        check(mutant(NAME, **over))


# --- global_grad_norm -------------------------------------------------------------------------

def norm_attached(grads):  # the graph kept: no detach
    norms = [torch.linalg.vector_norm(g) for g in grads if g is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def norm_skips_nonfinite(grads):  # "robust": non-finite tensors left out of the norm
    return ud.global_grad_norm(g for g in grads if g is not None and bool(torch.isfinite(g).all()))


def norm_nan_as_inf(grads):
    n = ud.global_grad_norm(grads)
    return torch.where(torch.isnan(n), torch.full_like(n, math.inf), n)


def norm_storage_order(grads):  # reads each tensor in storage order: wrong on a transposed view
    return ud.global_grad_norm(g.as_strided((g.numel(),), (1,)) for g in grads if g is not None)


def norm_squares_in_place(grads):  # squares the gradients in place
    grads = list(grads)
    total = ud.global_grad_norm(grads)
    for g in grads:
        if g is not None:
            with torch.no_grad():
                g.mul_(g)
    return total


def norm_as_python_float(grads):
    return ud.global_grad_norm(grads).item()


@pytest.mark.parametrize("fn, match", [
    (norm_attached, "attached to the autograd graph"),
    (norm_skips_nonfinite, "the norm is"),
    (norm_nan_as_inf, "the norm is inf, .* gives nan"),
    (norm_storage_order, "the norm"),
    (norm_squares_in_place, r"grads\[0\] was modified in place"),
    (norm_as_python_float, "is a float, expected a 0-dim tensor"),
], ids=["attached", "skips-nonfinite", "nan-as-inf", "storage-order", "in-place", "python-float"])
def test_global_grad_norm_contract(fn, match):
    _check(c.check_global_grad_norm__contract, match, global_grad_norm=fn)


# --- clip_coefficient ---------------------------------------------------------------------------

def coef_adds_eps_in_place(total_norm, max_norm, eps=1e-6):
    return torch.clamp(max_norm / total_norm.add_(eps), max=1.0)


def coef_hides_nonfinite(total_norm, max_norm, eps=1e-6):  # "no clipping on overflow": 1 for inf/NaN
    c = ud.clip_coefficient(total_norm, max_norm, eps)
    return c if bool(torch.isfinite(total_norm)) else torch.ones_like(total_norm)


def coef_in_float32(total_norm, max_norm, eps=1e-6):
    return ud.clip_coefficient(total_norm.float(), max_norm, eps)


def coef_returns_input(total_norm, max_norm, eps=1e-6):  # the coefficient written into the norm's tensor
    return total_norm.copy_(ud.clip_coefficient(total_norm, max_norm, eps))


@pytest.mark.parametrize("fn, match", [
    (coef_adds_eps_in_place, "total_norm was modified in place"),
    (coef_hides_nonfinite, "c is 1(.0)?, .* gives (nan|0)"),
    (coef_in_float32, "c is torch.float32, expected torch.(float64|bfloat16|float16)"),
    (coef_returns_input, "total_norm was modified in place|shares its storage"),
], ids=["eps-in-place", "nonfinite-hidden", "float32", "returns-input"])
def test_clip_coefficient_contract(fn, match):
    _check(c.check_clip_coefficient__contract, match, clip_coefficient=fn)


# --- clip_by_global_norm_ -------------------------------------------------------------------------

def clip_replaces_grad(params, max_norm, eps=1e-6):  # p.grad = p.grad * c: not in place
    params = [p for p in params if p.grad is not None]
    total = ud.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad = p.grad * ud.clip_coefficient(total, max_norm, eps)
    return total


def clip_views_flat(params, max_norm, eps=1e-6):  # p.grad.view(-1): raises on a non-contiguous .grad
    params = list(params)
    for p in params:
        p.grad.view(-1)
    return ud.clip_by_global_norm_(params, max_norm, eps)


def clip_and_step(params, max_norm, eps=1e-6):  # also applies the update to the parameters
    params = list(params)
    total = ud.clip_by_global_norm_(params, max_norm, eps)
    with torch.no_grad():
        for p in params:
            p.sub_(0.1 * p.grad.nan_to_num())
    return total


def clip_skips_nonfinite(params, max_norm, eps=1e-6):  # leaves the gradients alone on an overflow
    params = [p for p in params if p.grad is not None]
    total = ud.global_grad_norm(p.grad for p in params)
    return total if not bool(torch.isfinite(total)) else ud.clip_by_global_norm_(params, max_norm, eps)


@pytest.mark.parametrize("fn, match", [
    (clip_replaces_grad, "was replaced by a new tensor"),
    (clip_views_flat, "raised RuntimeError"),
    (clip_and_step, "the values of parameter 0 changed"),
    (clip_skips_nonfinite, "has NaN/inf where clip_grad_norm_"),
], ids=["replaces-grad", "contiguous-only", "steps-too", "skips-nonfinite"])
def test_clip_by_global_norm_contract(fn, match):
    _check(c.check_clip_by_global_norm___contract, match, clip_by_global_norm_=fn)


# --- update_ratio -----------------------------------------------------------------------------------

def ratio_subtracts_in_place(before, after):
    out = ud.update_ratio(before, after)
    with torch.no_grad():
        after[0].sub_(before[0])
    return out


def ratio_as_tensors(before, after):
    return tuple(torch.tensor(v, dtype=torch.float64) for v in ud.update_ratio(before, after))


def ratio_hides_nan(before, after):
    du, pn, r = ud.update_ratio(before, after)
    return (0.0, pn, 0.0) if math.isnan(du) else (du, pn, r)


def ratio_zero_division(before, after):
    du, pn, _ = ud.update_ratio(before, after)
    return du, pn, du / pn


def ratio_storage_order(before, after):
    flat = [[t.as_strided((t.numel(),), (1,)) for t in ts] for ts in (before, after)]
    return ud.update_ratio(*flat)


@pytest.mark.parametrize("fn, match", [
    (ratio_subtracts_in_place, r"after\[0\] was modified in place"),
    (ratio_as_tensors, "update_norm is a float64 tensor"),
    (ratio_hides_nan, "update_norm is 0.0, .* gives nan"),
    (ratio_zero_division, "raised ZeroDivisionError"),
    (ratio_storage_order, "differs from|update_norm is|param_norm is|ratio is"),
], ids=["in-place", "tensors", "nan-hidden", "zero-division", "storage-order"])
def test_update_ratio_contract(fn, match):
    _check(c.check_update_ratio__contract, match, update_ratio=fn)


# --- clip_per_group_ (variant) ------------------------------------------------------------------------

def global_clip(groups, max_norms, eps=1e-6):  # one coefficient for all groups: the classic
    limit = min(max_norms.values()) if isinstance(max_norms, dict) else max_norms
    total = ud.clip_by_global_norm_([p for ps in groups.values() for p in ps], limit, eps)
    return {k: total for k in groups}


def first_threshold_for_all(groups, max_norms, eps=1e-6):
    limit = next(iter(max_norms.values())) if isinstance(max_norms, dict) else max_norms
    return {k: ud.clip_by_global_norm_(ps, limit, eps) for k, ps in groups.items()}


def per_tensor(groups, max_norms, eps=1e-6):
    out = {}
    for k, ps in groups.items():
        limit = max_norms[k] if isinstance(max_norms, dict) else max_norms
        out[k] = ud.global_grad_norm(p.grad for p in ps)
        for p in ps:
            ud.clip_by_global_norm_([p], limit, eps)
    return out


def drops_none_in_place(groups, max_norms, eps=1e-6):  # "cleans" the caller's lists
    for k in groups:
        groups[k] = [p for p in groups[k] if p.grad is not None][::-1]
    return mutant(NAME).clip_per_group_(groups, max_norms, eps)


def norms_as_floats(groups, max_norms, eps=1e-6):
    return {k: v.item() for k, v in mutant(NAME).clip_per_group_(groups, max_norms, eps).items()}


def skips_all_on_overflow(groups, max_norms, eps=1e-6):  # an inf in one group leaves every group unclipped
    grads = [p.grad for ps in groups.values() for p in ps]
    if not bool(torch.isfinite(ud.global_grad_norm(grads))):
        return {k: ud.global_grad_norm(p.grad for p in ps) for k, ps in groups.items()}
    return mutant(NAME).clip_per_group_(groups, max_norms, eps)


@pytest.mark.parametrize("fn, check, match", [
    (global_clip, c.check_clip_per_group_, "the norm of group .* gives|differs from clip_grad_norm_"),
    (first_threshold_for_all, c.check_clip_per_group_, "differs from clip_grad_norm_"),
    (per_tensor, c.check_clip_per_group_, "differs from clip_grad_norm_"),
    (drops_none_in_place, c.check_clip_per_group___contract, "groups was modified"),
    (norms_as_floats, c.check_clip_per_group_, "is a float, expected a 0-dim tensor"),
    (skips_all_on_overflow, c.check_clip_per_group___contract, "has NaN/inf where clip_grad_norm_|differs from clip_grad_norm_"),
], ids=["global", "one-threshold", "per-tensor", "groups-modified", "floats", "overflow-skips-all"])
def test_clip_per_group_checks(fn, check, match):
    _check(check, match, clip_per_group_=fn)


# --- predict_first_update_norm (predict, then measure) -------------------------------------------------

def _coef(grad_norm, max_norm):
    return min(1.0, max_norm / (grad_norm + 1e-6))


@pytest.mark.parametrize("fn, match", [
    (lambda o, n, g, m, lr: lr * math.sqrt(n) * (_coef(g, m) if o == "adamw" else 1.0) if o == "adamw"
     else lr * g * _coef(g, m), "a real torch.optim.AdamW step"),  # clipping thought to bound AdamW's step
    (lambda o, n, g, m, lr: lr * math.sqrt(n) if o == "adamw" else lr * g, "a real torch.optim.SGD step"),  # no clip
    (lambda o, n, g, m, lr: lr * math.sqrt(n) if o == "adamw" else lr * g * m / (g + 1e-6), "SGD step"),  # uncapped
    (lambda o, n, g, m, lr: lr * min(g, m) if o == "adamw" else lr * g * _coef(g, m), "AdamW step"),  # AdamW as SGD
    (lambda o, n, g, m, lr: torch.tensor(lr * math.sqrt(n) if o == "adamw" else lr * g * _coef(g, m)),
     "the prediction is a float32 tensor"),
], ids=["adamw-clipped", "sgd-unclipped", "sgd-uncapped", "adamw-as-sgd", "tensor"])
def test_prediction_check(fn, match):
    _check(c.check_predict_first_update_norm, match, predict_first_update_norm=fn)


def test_contract_checks_pass_on_the_answers():
    for check in c.CHECKS:
        check(mutant(NAME))
