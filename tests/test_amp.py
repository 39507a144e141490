"""The mixed-precision mechanism (``bp_mech.amp``): the scaler model vs GradScaler, clipping after
unscale, clipping the scaled gradients measured (``clipping_order``), and mutants for the exercise
checks. The experiment's tests are in tests/experiments/test_amp.py."""

import math
import types

import pytest
import torch

from bp_mech import amp, registry
from bp_mech.amp import DynamicLossScaler, unscale_and_clip_
from checks import ex_amp


def test_scaler_model_matches_gradscaler():
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    ref = ex_amp.GradScalerReference(init_scale=2.0**16, growth_interval=3)
    ours = DynamicLossScaler(2.0**16, growth_interval=3)
    trace = []
    for f in pattern:
        skipped, scale = ref.step(f)
        assert ours.update(f) == skipped and ours.scale == scale
        trace.append(scale)
    assert trace[:6] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16]  # backoff, then growth after 3


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
    from bp_mech.workload import build_model, make_batches, parse_workload

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


SCALER_MUTANTS = [GrowsOnOverflowStep, KeepsTrackerOnOverflow, NeverSkips, GrowsOneLate, NoBackoff]


@pytest.mark.parametrize("cls", SCALER_MUTANTS, ids=lambda c: c.__name__)
def test_scaler_check_catches(cls):
    with pytest.raises(AssertionError):
        ex_amp.check_scaler_patterns(types.SimpleNamespace(DynamicLossScaler=cls))


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
    caught = 0
    for check in (ex_amp.check_unscale_and_clip, ex_amp.check_unscale_and_clip_overflow):
        try:
            check(m)
        except AssertionError:
            caught += 1
    assert caught >= 1


# --- clipping the scaled gradients, measured -----------------------------------------------

@pytest.fixture(scope="module")
def clip_setup():
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload(registry.get("TRAIN-AMP-BACKWARD").cpu_workload)  # the page's workload
    return build_model(w), make_batches(w, amp.CLIP_DEMO_UPDATES)


def _first_gradient(base, batch, scale):
    """The unscaled float32 gradient of the first update, as both runs compute it."""
    import copy

    model = copy.deepcopy(base)
    with amp.autocast("cpu", torch.float16):
        loss = model(**batch).loss
    (loss * scale).backward()
    return [p.grad / scale for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def test_clipping_order_fires_at_the_wrong_times(clip_setup):
    base, batches = clip_setup
    S, mn = 2.0**16, amp.CLIP_DEMO_MAX_NORM
    rows = amp.clipping_order(base, batches, mn, scale=S)
    assert len(rows) == amp.CLIP_DEMO_UPDATES and all(r["applied_a"] and r["applied_b"] for r in rows)
    for r in rows:
        assert r["clip_coef_a"] == pytest.approx(min(1.0, mn / (r["norm_a"] + 1e-6)), rel=1e-12)
        assert r["clipped_a"] == (r["clip_coef_a"] < 1.0) == (r["norm_a"] + 1e-6 > mn)
        # (b) compares max_norm with S x its true norm: clips every step, by a coefficient ~1/S too small
        assert r["clipped_b"] and r["clip_coef_b"] == pytest.approx(mn / (r["norm_b"] + 1e-6), rel=1e-12)
        assert r["clip_coef_b"] < 1e-3 * min(1.0, r["clip_coef_a"])
        # what AdamW receives in (b): the gradient rescaled to norm max_norm / S
        assert r["grad_median_b"] < 1e-3 * r["grad_median_a"]
    # the same weights at the first update: the same true norm, S times larger as (b) sees it
    assert rows[0]["norm_b"] == pytest.approx(S * rows[0]["norm_a"], rel=1e-5)
    assert rows[0]["loss_a"] == rows[0]["loss_b"]
    # at the page's max_norm the correct run clips some updates, not all
    assert 0 < sum(r["clipped_a"] for r in rows) < len(rows)


def test_clipping_order_update_difference_is_adams_epsilon(clip_setup):
    """The first AdamW update is -lr * (c g / (|c g| + eps) + wd p) per element (m_hat = c g,
    sqrt(v_hat) = |c g|): computed here in float64 from the first gradient, for c_a and c_b."""
    base, batches = clip_setup
    S, mn, lr = 2.0**16, amp.CLIP_DEMO_MAX_NORM, 1e-3
    grads, params = _first_gradient(base, batches[0], S)
    norm = sum(g.double().pow(2).sum() for g in grads).sqrt().item()
    c_a, c_b = min(1.0, mn / (norm + 1e-6)), mn / (S * norm + 1e-6)
    for eps in (1e-8, 1e-30):
        rows = amp.clipping_order(base, batches[:2], mn, scale=S, lr=lr, adam_eps=eps)
        step = [[c * g.double() / ((c * g.double()).abs() + eps) for g in grads] for c in (c_a, c_b)]
        diff = sum((a - b).pow(2).sum() for a, b in zip(*step)).sqrt().item()
        size = sum((a + 0.01 * p.double()).pow(2).sum() for a, p in zip(step[0], params)).sqrt().item()
        if eps == 1e-8:  # the rescaled gradient meets eps: the update shrinks by tens of percent
            assert rows[0]["update_rel_diff"] == pytest.approx(diff / size, rel=1e-3) and diff / size > 0.1
        else:  # eps plays no role: AdamW's first step ignores the rescale (float32 rounding of p_after - p)
            assert diff / size < 1e-6 and rows[0]["update_rel_diff"] < 1e-5
            assert rows[1]["update_rel_diff"] < 1e-2  # afterwards: the rescale only reweights the moments
