"""The mixed-precision mechanism (``bp_mech.amp``): the scaler model vs GradScaler, clipping after
unscale, clipping the scaled gradients measured (``clipping_order``), and mutants for the exercise
checks. The experiment's tests are in tests/experiments/test_amp.py."""

import math
import types

import pytest
import torch

from bp_mech import amp
from bp_mech.loss_scaling import DynamicLossScaler
from bp_mech.amp import unscale_and_clip_
from bp_mech.checks import ex_amp
from checks.mutants import caught_by
from conftest import mutant


def test_scaler_model_matches_gradscaler():
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    ref = ex_amp.GradScalerReference(init_scale=2.0**16, growth_interval=3)
    ours = DynamicLossScaler(2.0**16, growth_interval=3)
    trace = []
    for f in pattern:
        skipped, scale, tracker = ref.step(f)
        assert ours.update(f) == skipped and ours.scale == scale and ours.growth_tracker == tracker
        trace.append(scale)
    assert trace[:6] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16]  # backoff, then growth after 3


def test_scaler_model_stops_where_gradscalers_float32_scale_does():
    """GradScaler keeps S in float32: 2^127 * 2 is inf there, so S stays at 2^127 (a Python float would
    take 2^128); a factor of 1.5 still fits once (1.5 * 2^127 < 3.4e38), then no more."""
    for kw, top in ((dict(init_scale=2.0**126, growth_interval=1), 2.0**127),
                    (dict(init_scale=2.0**127, growth_factor=1.5, growth_interval=1), 1.5 * 2.0**127)):
        ours, ref = DynamicLossScaler(**kw), ex_amp.GradScalerReference(**kw)
        for _ in range(3):
            skipped, scale, tracker = ref.step(False)
            assert ours.update(False) is skipped is False and ours.scale == scale and ours.growth_tracker == tracker
        assert ours.scale == top and math.isfinite(ours.scale)


def test_unscale_then_clip_equals_torch():
    g = torch.Generator().manual_seed(0)
    true = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    params = [torch.zeros_like(t, requires_grad=True) for t in true]
    for p, t in zip(params, true):
        p.grad = t.clone()
    norm_ref = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    grads = [t * 1024.0 for t in true]
    norm, coef, found_inf = unscale_and_clip_(grads, 1024.0, 0.5)
    assert not found_inf and norm == pytest.approx(norm_ref, rel=1e-6) and coef < 1
    for a, p in zip(grads, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=0)


def test_unscale_and_clip_uses_the_global_norm():
    """unscale_and_clip_'s norm is update_dynamics.global_grad_norm of the unscaled gradients, bit for bit."""
    from bp_mech.update_dynamics import global_grad_norm

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(7, 5, generator=g) * 512.0, torch.randn(3, generator=g) * 512.0]
    want = global_grad_norm([t / 512.0 for t in grads]).item()
    norm, coef, found_inf = unscale_and_clip_([t.clone() for t in grads], 512.0, 1e9)
    assert norm == want and coef == 1.0 and not found_inf
    _, coef, found_inf = unscale_and_clip_([grads[0].clone(), torch.full((2,), math.inf)], 512.0, 0.1)
    assert found_inf and coef == 1.0  # nothing is clipped on an overflow step: it is skipped anyway


def test_autocast_is_off_for_fp32_and_casts_linear_outputs():
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b1s16")
    model, batch = build_model(w), make_batches(w, 1)[0]
    assert amp.autocast_dtypes(model, batch, "cpu", None)["Linear"] == "float32"
    seen = amp.autocast_dtypes(model, batch, "cpu", torch.bfloat16)
    assert seen["Linear"] == "bfloat16" and seen["(loss)"] == "float32"


# --- the exercise checks catch the classic mistakes ------------------------------------

class GrowsOnOverflowStep(DynamicLossScaler):
    """Counts the step and grows before looking at found_inf."""

    def update(self, found_inf):
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        return bool(found_inf)


class KeepsTrackerOnOverflow(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            return True
        return super().update(False)


class NeverSkips(DynamicLossScaler):
    def update(self, found_inf):
        super().update(found_inf)
        return False


class GrowsOneLate(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            return super().update(True)
        self.growth_tracker += 1
        if self.growth_tracker > self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        return False


class NoBackoff(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            return True
        return super().update(False)


class GrowsPastFloat32(DynamicLossScaler):
    """The scale as a Python float: 2^128 is finite there, so the growth is taken."""

    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            if math.isfinite(self.scale * self.growth_factor):
                self.scale *= self.growth_factor
            self.growth_tracker = 0
        return False


class ClampsToFloat32Max(GrowsPastFloat32):
    """Caps S at float32's largest value instead of refusing the growth."""

    def update(self, found_inf):
        skip = super().update(found_inf)
        self.scale = min(self.scale, torch.finfo(torch.float32).max)
        return skip


class KeepsTrackerWhenGrowthRefused(DynamicLossScaler):
    """Resets the tracker only after a growth that happened."""

    def update(self, found_inf):
        if found_inf:
            return super().update(True)
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            grown = torch.tensor(self.scale * self.growth_factor, dtype=torch.float32).item()
            if math.isfinite(grown):
                self.scale, self.growth_tracker = grown, 0
        return False


SCALER_MUTANTS = [GrowsOnOverflowStep, KeepsTrackerOnOverflow, NeverSkips, GrowsOneLate, NoBackoff]
TOP_OF_RANGE_MUTANTS = [GrowsPastFloat32, ClampsToFloat32Max, KeepsTrackerWhenGrowthRefused]


@pytest.mark.parametrize("cls", SCALER_MUTANTS, ids=lambda c: c.__name__)
def test_scaler_check_catches(cls):
    with pytest.raises(AssertionError, match="^DynamicLossScaler: "):
        ex_amp.check_DynamicLossScaler(types.SimpleNamespace(DynamicLossScaler=cls))


@pytest.mark.parametrize("cls", TOP_OF_RANGE_MUTANTS, ids=lambda c: c.__name__)
def test_top_of_range_check_catches(cls):
    answer = mutant("ex_amp_backward").DynamicLossScaler  # its state_dict: the main check's drawn cases save and load
    m = types.SimpleNamespace(DynamicLossScaler=type(cls.__name__, (cls, answer), {}))
    ex_amp.check_DynamicLossScaler(m)  # right away from the top of the range ...
    with pytest.raises(AssertionError, match="^DynamicLossScaler: "):  # ... wrong at it
        ex_amp.check_DynamicLossScaler__top_of_range(m)


def clip_scaled_then_unscale(grads, scale, max_norm, eps=1e-6):
    """The classic bug: clip the scaled gradients, unscale afterwards."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = min(1.0, max_norm / (total + eps))
    for g in grads:
        g.mul_(coef / scale)
    return total, coef, not math.isfinite(total)


def clip_before_unscale_reporting_true_norm(grads, scale, max_norm, eps=1e-6):
    """Subtler: reports the unscaled norm but clips with the scaled one."""
    total, coef, found = clip_scaled_then_unscale(grads, scale, max_norm, eps)
    return total / scale, coef, found


def clips_on_overflow(grads, scale, max_norm, eps=1e-6):
    for g in grads:
        g.mul_(1.0 / scale)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = max_norm / (total + eps)
    for g in grads:
        g.mul_(min(1.0, coef))
    return total, min(1.0, coef), not math.isfinite(total)


@pytest.mark.parametrize("fn", [clip_scaled_then_unscale, clip_before_unscale_reporting_true_norm, clips_on_overflow],
                         ids=lambda f: f.__name__)
def test_clip_checks_catch(fn):
    m = types.SimpleNamespace(unscale_and_clip_=fn)
    assert caught_by((ex_amp.check_unscale_and_clip_, ex_amp.check_unscale_and_clip___overflow), m,
                     "unscale_and_clip_") >= 1


def _clip_only_above(grads, scale, max_norm, eps=1e-6):
    """Clips only when the norm exceeds max_norm, by max_norm / norm: no eps at all."""
    for g in grads:
        g.mul_(1.0 / scale)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = max_norm / total if total > max_norm else 1.0
    for g in grads:
        g.mul_(coef)
    return total, coef, not math.isfinite(total)


def _ignores_eps_argument(grads, scale, max_norm, eps=1e-6):
    return unscale_and_clip_(grads, scale, max_norm)


def _python_division(grads, scale, max_norm, eps=1e-6):
    """max_norm / norm in Python: ZeroDivisionError on zero gradients."""
    for g in grads:
        g.mul_(1.0 / scale)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = min(1.0, max_norm / total * total / (total + eps))
    for g in grads:
        g.mul_(coef)
    return total, coef, not math.isfinite(total)


def _isinf_only(grads, scale, max_norm, eps=1e-6):
    """Looks for inf only: a NaN gradient is not an overflow to it."""
    found = any(bool(torch.isinf(g).any()) for g in grads)
    total, coef, _ = unscale_and_clip_(grads, scale, max_norm, eps)
    return total, coef, found


@pytest.mark.parametrize("fn, check", [(_clip_only_above, ex_amp.check_unscale_and_clip___eps),
                                       (_ignores_eps_argument, ex_amp.check_unscale_and_clip___eps),
                                       (_python_division, ex_amp.check_unscale_and_clip___eps),
                                       (_isinf_only, ex_amp.check_unscale_and_clip___overflow)],
                         ids=["no-eps", "eps-argument-ignored", "zero-norm-division", "nan-not-found"])
def test_clip_edge_checks_catch(fn, check):
    m = types.SimpleNamespace(unscale_and_clip_=fn)
    with pytest.raises(AssertionError, match="^unscale_and_clip_: "):
        check(m)
