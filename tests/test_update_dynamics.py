"""Part 02 · 55, the mechanism (``bp_mech.update_dynamics``): parameter groups, the global norm, the
clip coefficient and clipping against torch, the update ratio, and the exercise checks (mutants). The
experiment's tests are in tests/experiments/test_update_dynamics.py."""

import pytest
import torch

from bp_mech import update_dynamics
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.checks import ex55


def test_groups_cover_every_parameter_once():
    model = build_model(parse_workload("tiny-b2s16"))
    groups = update_dynamics.param_groups(model)
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(groups[g] for g in update_dynamics.GROUPS)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: counted once, in "embedding"
    opt = update_dynamics.grouped_adamw(model, 1e-3, 0.1, "cpu")
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {
        "embedding": 0.1, "attention": 0.1, "mlp": 0.1, "norm_bias": 0.0}


def test_global_norm_and_clipping_match_torch():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g) * 10, None]
    params = [torch.zeros(5, 3, requires_grad=True), torch.zeros(7, requires_grad=True)]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, 0.5)
    norm = update_dynamics.global_grad_norm(grads)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(ref.item(), rel=1e-6)
    exact = sum(t.double().pow(2).sum() for t in grads[:2]).sqrt().item()
    assert update_dynamics.global_grad_norm(grads, dtype=torch.float64).item() == pytest.approx(exact, rel=1e-14)
    ours = [torch.zeros_like(t, requires_grad=True) for t in grads[:2]]
    for p, t in zip(ours, grads):
        p.grad = t.clone()
    assert update_dynamics.clip_by_global_norm_(ours, 0.5).item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(ours, params):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert update_dynamics.clip_coefficient(norm, 1e9).item() == 1.0  # never scales up
    assert update_dynamics.global_grad_norm([None]).item() == 0.0


def test_update_ratio_is_one_global_ratio():
    before = [torch.ones(4), torch.full((2,), 2.0)]
    after = [torch.ones(4) * 1.5, torch.full((2,), 2.0)]
    du, pn, r = update_dynamics.update_ratio(before, after)
    assert du == pytest.approx(1.0, rel=1e-15) and pn == pytest.approx(12 ** 0.5, rel=1e-15) and r == du / pn
    assert update_dynamics.update_ratio([torch.zeros(2)], [torch.ones(2)])[2] == float("inf")


# --- mutants: the checks catch the classic mistakes --------------------------------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex55_update_dynamics", **over)


def _per_tensor_clip(params, max_norm, eps=1e-6):  # clips each tensor to max_norm on its own
    params = [p for p in params if p.grad is not None]
    total = update_dynamics.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad.mul_(torch.clamp(max_norm / (p.grad.norm() + eps), max=1.0))
    return total


def _uncapped_clip(params, max_norm, eps=1e-6):  # scales up small gradients too
    params = [p for p in params if p.grad is not None]
    total = update_dynamics.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad.mul_(max_norm / (total + eps))
    return total


def _mean_ratio(before, after):  # mean of per-tensor ratios
    rs = [(a - b).norm().item() / b.norm().item() for b, a in zip(before, after)]
    du, pn, _ = update_dynamics.update_ratio(before, after)
    return du, pn, sum(rs) / len(rs)


def _after_ratio(before, after):  # divides by the parameters after the update
    du = sum((a - b).pow(2).sum().item() for b, a in zip(before, after)) ** 0.5
    pa = sum(a.pow(2).sum().item() for a in after) ** 0.5
    return du, pa, du / pa


def _norm_two_passes(grads):  # one pass for the dtype, one for the sum: a generator is spent by the first
    dtype = next(g.dtype for g in grads if g is not None)
    return torch.sqrt(sum(g.double().pow(2).sum() for g in grads if g is not None)).to(dtype)


def _norm_sum_of_squares(grads):  # squares summed in the gradients' dtype: float16 overflows
    return torch.sqrt(sum(g.pow(2).sum() for g in grads if g is not None))


def _clip_iterates_twice(params, max_norm, eps=1e-6):  # a generator is empty at the second loop
    total = update_dynamics.global_grad_norm(p.grad for p in params if p.grad is not None)
    c = update_dynamics.clip_coefficient(total, max_norm, eps)
    for p in params:
        p.grad.mul_(c)
    return total


def _clip_no_none_check(params, max_norm, eps=1e-6):
    params = list(params)
    total = update_dynamics.global_grad_norm([p.grad for p in params])
    for p in params:
        p.grad.mul_(update_dynamics.clip_coefficient(total, max_norm, eps))
    return total


def _clip_only_above(params, max_norm, eps=1e-6):  # clips by max_norm / norm, only above the threshold
    params = [p for p in params if p.grad is not None]
    total = update_dynamics.global_grad_norm(p.grad for p in params)
    if total > max_norm:
        for p in params:
            p.grad.mul_(max_norm / total)
    return total


def _clip_default_eps(params, max_norm, eps=1e-6):  # the eps argument is not passed on
    return update_dynamics.clip_by_global_norm_(params, max_norm)


def _ratio_in_input_dtype(before, after):  # norms in bfloat16 / float16, not float64
    du = update_dynamics.global_grad_norm([a.detach() - b for b, a in zip(before, after)]).item()
    pn = update_dynamics.global_grad_norm(before).item()
    return du, pn, du / pn


@pytest.mark.parametrize("check,over", [
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_per_tensor_clip)),
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_uncapped_clip)),
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_clip_iterates_twice)),
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_clip_no_none_check)),
    (ex55.check_clip_by_global_norm___eps, dict(clip_by_global_norm_=_clip_only_above)),
    (ex55.check_clip_by_global_norm___eps, dict(clip_by_global_norm_=_clip_default_eps)),
    (ex55.check_clip_coefficient, dict(clip_coefficient=lambda n, m, eps=1e-6: m / (n + eps))),
    (ex55.check_clip_coefficient, dict(clip_coefficient=lambda n, m, eps=1e-6: torch.clamp(m / n, max=1.0))),
    (ex55.check_clip_coefficient__eps,
     dict(clip_coefficient=lambda n, m, eps=1e-6: torch.clamp(m / (n + 1e-6), max=1.0))),  # eps ignored
    (ex55.check_clip_coefficient__eps, dict(clip_coefficient=lambda n, m, eps=1e-6: min(1.0, m / (n + eps)))),
    (ex55.check_global_grad_norm, dict(global_grad_norm=lambda gs: sum(g.norm() for g in gs if g is not None))),
    (ex55.check_global_grad_norm, dict(global_grad_norm=_norm_two_passes)),
    (ex55.check_global_grad_norm__half_precision, dict(global_grad_norm=_norm_sum_of_squares)),
    (ex55.check_update_ratio, dict(update_ratio=_mean_ratio)),
    (ex55.check_update_ratio, dict(update_ratio=_after_ratio)),
    (ex55.check_update_ratio, dict(update_ratio=_ratio_in_input_dtype)),
], ids=["per-tensor-clip", "uncapped-clip", "clip-iterates-twice", "clip-none-grad", "clip-only-above-no-eps",
        "clip-eps-not-passed", "coef-uncapped", "coef-no-eps", "coef-eps-ignored", "coef-python-min",
        "norm-sum-of-norms", "norm-generator-two-passes", "norm-16-bit-squares", "ratio-mean-per-tensor",
        "ratio-after-norm", "ratio-in-16-bit"])
def test_checks_catch_mistakes(check, over):
    function = check.__name__.removeprefix("check_").rpartition("__")[0] or check.__name__.removeprefix("check_")
    with pytest.raises(AssertionError, match=f"^{function}: "):
        check(_solution(**over))
