"""Mutant tests of Part 02 · 55's checks (``bp_mech.checks.ex55``'s declarations, derived by ``checks.engine``):
each wrong solution breaks one documented property, and is otherwise right."""

import functools
import math

import pytest
import torch
from conftest import mutant

from bp_mech import update_dynamics as ud
from bp_mech.checks import ex55 as c
from checks.mutants import leaks, rejects

pytestmark = pytest.mark.ch55
NAME = "ex55_update_dynamics"


_check = functools.partial(rejects, NAME)  # (check, match, **functions replaced)


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
    (norm_skips_nonfinite, "the norm differs .*holding"),
    (norm_nan_as_inf, r"the norm differs .*holding \[nan\]"),
    (norm_storage_order, "the norm"),
    (norm_squares_in_place, r"grads\[0\] was modified in place"),
    (norm_as_python_float, "the norm is a float, expected a tensor"),
], ids=["attached", "skips-nonfinite", "nan-as-inf", "storage-order", "in-place", "python-float"])
def test_global_grad_norm_contract(fn, match):
    _check(c.check_global_grad_norm, match, global_grad_norm=fn)


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
    (coef_hides_nonfinite, "c differs .*total_norm (nan|inf)"),
    (coef_in_float32, "c has dtype torch.float32, expected torch.(float64|bfloat16|float16)"),
    (coef_returns_input, "total_norm was modified in place|shares its storage"),
], ids=["eps-in-place", "nonfinite-hidden", "float32", "returns-input"])
def test_clip_coefficient_contract(fn, match):
    _check(c.check_clip_coefficient, match, clip_coefficient=fn)


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
    (clip_skips_nonfinite, r"the gradients\[0\] differs from .*clip_grad_norm_.* holding"),
], ids=["replaces-grad", "contiguous-only", "steps-too", "skips-nonfinite"])
def test_clip_by_global_norm_contract(fn, match):
    _check(c.check_clip_by_global_norm_, match, clip_by_global_norm_=fn)


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
    (ratio_hides_nan, "update_norm is 0, .* gives -1 .*NaN read as -1"),
    (ratio_zero_division, "raised ZeroDivisionError"),
    (ratio_storage_order, "differs from|update_norm is|param_norm is|ratio is"),
], ids=["in-place", "tensors", "nan-hidden", "zero-division", "storage-order"])
def test_update_ratio_contract(fn, match):
    _check(c.check_update_ratio, match, update_ratio=fn)


def test_contract_checks_pass_on_the_answers():
    for check in c.CHECKS:
        check(mutant(NAME))


# --- the properties the engine derives, and the outsider's wrong solutions ---------------------------------



def norm_cat_view(grads):  # one flat vector through .view(-1): raises on a transposed gradient
    flat = [g.detach().view(-1) for g in grads if g is not None]
    return torch.linalg.vector_norm(torch.cat(flat)) if flat else torch.zeros(())


def norm_in_float64(grads):  # accumulated in float64 and left there
    return ud.global_grad_norm(grads, dtype=torch.float64)


def coef_eps_outside(total_norm, max_norm, eps=1e-6):  # max_norm / norm + eps
    return torch.clamp(max_norm / total_norm + eps, max=1.0)


def coef_float32_max_norm(total_norm, max_norm, eps=1e-6):  # torch.tensor(max_norm): float32, promotes 16 bits
    return torch.clamp(torch.tensor(max_norm) / (total_norm + eps), max=1.0)


def clip_returns_clipped_norm(params, max_norm, eps=1e-6):  # the norm after clipping
    params = list(params)
    ud.clip_by_global_norm_(params, max_norm, eps)
    return ud.global_grad_norm(p.grad for p in params)


def clip_float32_coefficient(params, max_norm, eps=1e-6):  # c rounded to float32 before the product
    params = [p for p in params if p.grad is not None]
    total = ud.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad.mul_(ud.clip_coefficient(total, max_norm, eps).float())
    return total


@pytest.mark.parametrize("check, over, match", [
    (c.check_clip_coefficient, dict(clip_coefficient=lambda n, m, eps=1e-5: ud.clip_coefficient(n, m, eps)),
     r"c differs .*eps left out \(default 1e-06\)"),
    (c.check_clip_by_global_norm_, dict(clip_by_global_norm_=lambda ps, m, eps=1e-8: ud.clip_by_global_norm_(
        ps, m, eps)), "eps left out"),
    (c.check_global_grad_norm, dict(global_grad_norm=leaks(ud.global_grad_norm, lambda: torch.set_grad_enabled(
        False))), "left the grad mode changed"),
    (c.check_update_ratio, dict(update_ratio=leaks(ud.update_ratio, lambda: torch.set_default_dtype(
        torch.float64))), "left the default dtype changed"),
    (c.check_global_grad_norm, dict(global_grad_norm=norm_cat_view), "raised RuntimeError at .*non-contiguous"),
    (c.check_global_grad_norm, dict(global_grad_norm=norm_in_float64), "dtype torch.float64, expected torch.float32"),
    (c.check_clip_coefficient, dict(clip_coefficient=coef_eps_outside), "c differs"),
    (c.check_clip_coefficient, dict(clip_coefficient=coef_float32_max_norm), "dtype torch.float32, expected torch"),
    (c.check_clip_by_global_norm_, dict(clip_by_global_norm_=clip_returns_clipped_norm), "the norm differs"),
    (c.check_clip_by_global_norm_, dict(clip_by_global_norm_=clip_float32_coefficient), "gradients.* differs"),
], ids=["coef-default-eps", "clip-default-eps", "norm-grad-mode", "ratio-default-dtype", "norm-view",
        "norm-float64", "coef-eps-outside", "coef-float32", "clip-clipped-norm", "clip-float32-c"])
def test_derived_properties_and_outsider_mistakes(check, over, match):
    _check(check, match, **over)
