"""Mutant tests of Part 02 · 55's variant and prediction checks (``clip_per_group_``, ``predict_first_update_norm``;
``bp_mech.checks.ex55``'s declarations): each wrong solution breaks one documented property, and is otherwise right."""

import functools
import math
import operator

import pytest
import torch
from conftest import mutant

from bp_mech import update_dynamics as ud
from bp_mech.checks import ex55 as c
from checks.mutants import rejects

pytestmark = pytest.mark.ch55
NAME = "ex55_update_dynamics"


_check = functools.partial(rejects, NAME)  # (check, match, **functions replaced)


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
    (drops_none_in_place, c.check_clip_per_group_, "groups was modified"),
    (norms_as_floats, c.check_clip_per_group_, r"the norms\['layer0'\] is a float, expected a tensor"),
    (skips_all_on_overflow, c.check_clip_per_group_, "differs from clip_grad_norm_ on each group"),
], ids=["global", "one-threshold", "per-tensor", "groups-modified", "floats", "overflow-skips-all"])
def test_clip_per_group_checks(fn, check, match):
    _check(check, match, clip_per_group_=fn)


def groups_pop_thresholds(groups, max_norms, eps=1e-6):  # each threshold popped from the caller's dict
    if isinstance(max_norms, dict):
        return {k: ud.clip_by_global_norm_(ps, max_norms.pop(k), eps) for k, ps in groups.items()}
    return mutant(NAME).clip_per_group_(groups, max_norms, eps)


def groups_sorted_by_norm(groups, max_norms, eps=1e-6):  # the dict in order of the norms, not of groups
    out = mutant(NAME).clip_per_group_(groups, max_norms, eps)
    return dict(sorted(out.items(), key=lambda kv: float(kv[1])))


def groups_clipped_norms(groups, max_norms, eps=1e-6):  # each group's norm after clipping
    mutant(NAME).clip_per_group_(groups, max_norms, eps)
    return {k: ud.global_grad_norm(p.grad for p in ps) for k, ps in groups.items()}


@pytest.mark.parametrize("over, match", [
    (dict(clip_per_group_=lambda g, m, eps=1e-4: mutant(NAME).clip_per_group_(g, m, eps)), "eps left out"),
    (dict(clip_per_group_=groups_pop_thresholds), "max_norms was modified"),
    (dict(clip_per_group_=groups_sorted_by_norm), "expected the group names"),
    (dict(clip_per_group_=groups_clipped_norms), r"the norms\['layer0'\] differs"),
], ids=["default-eps", "pops-thresholds", "order", "clipped-norms"])
def test_clip_per_group_derived_and_outsider_mistakes(over, match):
    _check(c.check_clip_per_group_, match, **over)


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
    (lambda o, n, g, m, lr: lr * math.sqrt(n) if operator.is_(o, "adamw") else lr * g * _coef(g, m),
     "AdamW step"),  # identity, not equality: true only for the interned literal
], ids=["adamw-clipped", "sgd-unclipped", "sgd-uncapped", "adamw-as-sgd", "tensor", "is-not-equals"])
def test_prediction_check(fn, match):
    _check(c.check_predict_first_update_norm, match, predict_first_update_norm=fn)
