"""Checks of exercises/ex_amp_backward.py against torch.amp.GradScaler and clip_grad_norm_.

The loss-scaler checks drive a real ``torch.amp.GradScaler("cpu")`` with the same pattern of
overflow steps (a gradient that is inf or finite) and compare, step by step, its scale, its growth
tracker (``state_dict()["_growth_tracker"]``) and whether it skipped ``optimizer.step()`` (the
parameter did not move) with the solution's. The patterns put an overflow exactly on the step where
the growth interval would complete, so growing the scale on an overflow step is caught; others start
near float32's largest value, where GradScaler (a float32 scale) refuses a growth that a Python float
would take. The clipping checks compare with ``torch.nn.utils.clip_grad_norm_`` applied, in float64,
to the unscaled gradients, also where its eps decides (tiny and zero gradients) and at a non-default
eps (then with the documented formula on float64 norms).
"""

import math
import random

import torch

from bp_mech.checks import ex_amp_contract as _contract
from bp_mech.checks import ex_amp_variant as _variant
from bp_mech.checks.common import assert_close, assert_value, call, describe
from bp_mech.checks.ex_amp_contract import GradScalerReference

SCALE_TOL = 1e-6  # GradScaler keeps S in a float32 tensor; a float32-rounded S differs by < 6e-8
GRAD_TOL = 1e-5  # float32 gradients against a float64 reference


# (GradScaler kwargs, found_inf pattern)
PATTERNS = [
    (dict(init_scale=2.0**16, growth_interval=3), [False, False, True, False, False, False, False, False, False,
                                                   True, True, False, False, False]),
    (dict(init_scale=2.0**10, growth_interval=1), [False, False, True, False, True, True, False]),
    (dict(init_scale=2.0**16), [True, True, True, False, False]),  # torch's defaults
    (dict(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2),
     [False, True, False, False, False, True, False, False, False, False]),
]
TOP_OF_RANGE = [  # growths that would pass float32's largest value (about 3.4e38 = 2^128 - 2^104)
    (dict(init_scale=2.0**125, growth_interval=1), [False] * 5 + [True] + [False] * 4),
    (dict(init_scale=2.0**126, growth_interval=2), [False] * 6 + [True, False, False, False, False]),
    (dict(init_scale=2.0**127, growth_factor=1.5, growth_interval=1), [False] * 4 + [True] + [False] * 3),
]


def _random_patterns():
    rng = random.Random(7)
    for interval in (2, 4, 5):
        yield dict(init_scale=2.0**12, growth_interval=interval), [rng.random() < 0.25 for _ in range(30)]


def _drive(m, kw, pattern, label):
    fn = "DynamicLossScaler"
    ref = GradScalerReference(**kw)
    ours = call(fn, m.DynamicLossScaler, **kw, at=f"DynamicLossScaler({kw})")
    for i, found_inf in enumerate(pattern):
        skipped, scale, tracker = ref.step(found_inf)
        at = f"step {i} ({'overflow' if found_inf else 'finite'}) of {label}, pattern {pattern}"
        got = call(fn, ours.update, found_inf, at=at)
        if not isinstance(got, bool):
            raise AssertionError(f"{fn}: update() returned {describe(got)}, expected a bool at {at}")
        assert got == skipped, (f"{fn}: update() says skip={got}, torch.amp.GradScaler "
                                f"{'skipped' if skipped else 'stepped'} at {at}")
        if not isinstance(ours.scale, float):
            raise AssertionError(f"{fn}: scale is {describe(ours.scale)}, expected a Python float at {at}")
        assert_value(fn, "scale", ours.scale, scale, tol=SCALE_TOL, ref="torch.amp.GradScaler (a float32 scale)",
                     at=at)
        assert ours.growth_tracker == tracker, (f"{fn}: growth_tracker is {ours.growth_tracker}, "
                                                f"torch.amp.GradScaler has {tracker} at {at}")


def check_DynamicLossScaler(m):
    for i, (kw, pattern) in enumerate(PATTERNS):
        _drive(m, kw, pattern, f"pattern #{i} {kw}")


def check_DynamicLossScaler__random_patterns(m):
    for i, (kw, pattern) in enumerate(_random_patterns()):
        _drive(m, kw, pattern, f"random pattern #{i} {kw}")


def check_DynamicLossScaler__top_of_range(m):
    for i, (kw, pattern) in enumerate(TOP_OF_RANGE):
        _drive(m, kw, pattern, f"top-of-range pattern #{i} {kw} (a growth past float32's largest value is refused)")


SHAPES = [(4, 5), (7,), (3, 2, 2)]


def _reference(scaled: list[torch.Tensor], scale: float, max_norm: float, eps: float = 1e-6):
    """clip_grad_norm_ on float64 copies of the unscaled gradients -> (norm, coef, grads). clip_grad_norm_'s
    eps is 1e-6; for another eps, its total norm and the documented min(1, max_norm / (norm + eps))."""
    params = [torch.zeros(s.shape, dtype=torch.float64, requires_grad=True) for s in scaled]
    for p, g in zip(params, scaled):
        p.grad = g.double() / scale
    if eps == 1e-6:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return norm, min(1.0, max_norm / (norm + eps)), [p.grad for p in params]
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    coef = min(1.0, max_norm / (norm + eps))
    return norm, coef, [p.grad * coef for p in params]


def _grads(seed: int, spread: float, scale: float):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * spread * scale).float() for s in SHAPES]


def _clip_case(m, seed, spread, scale, max_norm, eps=None, zero=False):
    fn = "unscale_and_clip_"
    scaled = _grads(seed, spread, scale)
    if zero:
        scaled = [torch.zeros_like(t) for t in scaled]
    norm, coef, want = _reference(scaled, scale, max_norm, 1e-6 if eps is None else eps)
    grads = [t.clone() for t in scaled]
    at = (f"gradients of shapes {SHAPES}, true norm {norm:.3g}, scale {scale:g}, max_norm {max_norm:g}"
          + ("" if eps is None else f", eps {eps:g}"))
    args = (grads, scale, max_norm) + (() if eps is None else (eps,))
    out = call(fn, m.unscale_and_clip_, *args, at=at)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise AssertionError(f"{fn}: returned {describe(out)}, expected (total_norm, clip_coef, found_inf) at {at}")
    got_norm, got_coef, found_inf = out
    assert not found_inf, f"{fn}: found_inf is {found_inf!r} for finite gradients, expected False at {at}"
    ref = "clip_grad_norm_ after unscale_"
    assert_value(fn, "total_norm", got_norm, norm, tol=GRAD_TOL, ref=ref + " (the UNSCALED norm)", at=at)
    assert_value(fn, "clip_coef", got_coef, coef, tol=GRAD_TOL, ref="min(1, max_norm / (norm + eps))", at=at)
    for i, (a, b) in enumerate(zip(grads, want)):
        assert_close(fn, f"gradient {i}", a, b, tol=GRAD_TOL, ref=ref, at=at)


def check_unscale_and_clip_(m):
    # (seed, true-gradient spread, loss scale, max_norm): clipped, unclipped, a huge scale, no scale
    for seed, spread, scale, max_norm in ((1, 1.0, 2.0**16, 1.0), (2, 0.01, 2.0**16, 1.0), (3, 3.0, 2.0**24, 0.5),
                                          (4, 0.5, 1.0, 2.0)):
        _clip_case(m, seed, spread, scale, max_norm)


def check_unscale_and_clip___eps(m):
    _clip_case(m, 5, 1e-7, 2.0**16, 1e-6)  # norm ~ 4.7e-7 < max_norm, yet eps makes the coefficient ~0.68 < 1
    _clip_case(m, 6, 4e-7, 2.0**16, 1e-6)  # norm ~ 2.5e-6: max_norm / norm would be 0.4, with eps it is ~0.29
    _clip_case(m, 7, 0.2, 2.0**10, 0.5, eps=0.1)  # a non-default eps
    _clip_case(m, 8, 1.0, 2.0**16, 1.0, zero=True)  # all gradients zero: coefficient 1, nothing NaN


def check_unscale_and_clip___overflow(m):
    fn = "unscale_and_clip_"
    for seed, bad in ((5, math.inf), (6, math.nan), (7, -math.inf)):
        scale = 2.0**16
        scaled = _grads(seed, 1.0, scale)
        scaled[1][3] = bad
        grads = [t.clone() for t in scaled]
        at = f"gradients of shapes {SHAPES} with one {bad} element, scale {scale:g}, max_norm 1.0"
        out = call(fn, m.unscale_and_clip_, grads, scale, 1.0, at=at)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise AssertionError(f"{fn}: returned {describe(out)}, expected (total_norm, clip_coef, found_inf) at {at}")
        _, coef, found_inf = out
        assert found_inf, f"{fn}: found_inf is {found_inf!r}, expected True at {at}"
        assert coef == 1.0, f"{fn}: clip_coef is {coef!r}, expected 1.0 (nothing clipped on an overflow step) at {at}"
        for i, (a, s) in enumerate(zip(grads, scaled)):
            fin = torch.isfinite(s)
            assert_close(fn, f"gradient {i} (its finite elements)", a[fin], s[fin].double() / scale, tol=GRAD_TOL,
                         ref="the unscaled, unclipped gradient", at=at)


CHECKS = [check_DynamicLossScaler, check_DynamicLossScaler__random_patterns, check_DynamicLossScaler__top_of_range,
          _contract.check_DynamicLossScaler__contract, check_unscale_and_clip_, check_unscale_and_clip___eps,
          check_unscale_and_clip___overflow, *_contract.CHECKS[1:], *_variant.CHECKS]
