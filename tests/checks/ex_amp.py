"""Checks of exercises/ex_amp_backward.py against torch.amp.GradScaler and clip_grad_norm_.

The loss-scaler checks drive a real ``torch.amp.GradScaler("cpu")`` with the same pattern of
overflow steps (a gradient that is inf or finite) and compare, step by step, its scale and
whether it skipped ``optimizer.step()`` (the parameter did not move) with the solution's.
The patterns put an overflow exactly on the step where the growth interval would complete,
so growing the scale on an overflow step is caught. The clipping check compares with
``torch.nn.utils.clip_grad_norm_`` applied, in float64, to the unscaled gradients.
"""

import math
import random

import torch

SCALE_TOL = 1e-6  # GradScaler keeps S in a float32 tensor; every S used here is exact in float32
GRAD_TOL = 1e-5  # float32 gradients against a float64 reference


class GradScalerReference:
    """A one-parameter SGD under torch's GradScaler; ``step(found_inf)`` -> (skipped, scale)."""

    def __init__(self, **kw) -> None:
        self.p = torch.zeros(1, requires_grad=True)
        self.opt = torch.optim.SGD([self.p], lr=1.0)
        self.scaler = torch.amp.GradScaler("cpu", **kw)

    def step(self, found_inf: bool):
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(self.p.sum() * (math.inf if found_inf else 1.0)).backward()
        before = self.p.detach().clone()
        self.scaler.step(self.opt)
        self.scaler.update()
        return torch.equal(before, self.p.detach()), self.scaler.get_scale()


# (GradScaler kwargs, found_inf pattern)
PATTERNS = [
    (dict(init_scale=2.0**16, growth_interval=3), [False, False, True, False, False, False, False, False, False,
                                                   True, True, False, False, False]),
    (dict(init_scale=2.0**10, growth_interval=1), [False, False, True, False, True, True, False]),
    (dict(init_scale=2.0**16), [True, True, True, False, False]),  # torch's defaults
    (dict(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2),
     [False, True, False, False, False, True, False, False, False, False]),
]


def _random_patterns():
    rng = random.Random(7)
    for interval in (2, 4, 5):
        yield dict(init_scale=2.0**12, growth_interval=interval), [rng.random() < 0.25 for _ in range(30)]


def _drive(m, kw, pattern, label):
    ref = GradScalerReference(**kw)
    ours = m.DynamicLossScaler(**kw)
    for i, found_inf in enumerate(pattern):
        skipped, scale = ref.step(found_inf)
        got = ours.update(found_inf)
        where = f"{label}, step {i} ({'overflow' if found_inf else 'finite'}), pattern {pattern}"
        assert isinstance(got, bool), f"{where}: update() must return a bool, got {type(got).__name__}"
        assert got == skipped, f"{where}: update() says skip={got}, GradScaler {'skipped' if skipped else 'stepped'}"
        assert abs(ours.scale - scale) <= SCALE_TOL * scale, f"{where}: scale {ours.scale}, GradScaler has {scale}"


def check_scaler_patterns(m):
    for i, (kw, pattern) in enumerate(PATTERNS):
        _drive(m, kw, pattern, f"pattern #{i} {kw}")


def check_scaler_random(m):
    for i, (kw, pattern) in enumerate(_random_patterns()):
        _drive(m, kw, pattern, f"random pattern #{i} {kw}")


SHAPES = [(4, 5), (7,), (3, 2, 2)]


def _reference(scaled: list[torch.Tensor], scale: float, max_norm: float):
    """clip_grad_norm_ on float64 copies of the unscaled gradients -> (norm, coef, grads)."""
    params = [torch.zeros(s.shape, dtype=torch.float64, requires_grad=True) for s in scaled]
    for p, g in zip(params, scaled):
        p.grad = g.double() / scale
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return norm, min(1.0, max_norm / (norm + 1e-6)), [p.grad for p in params]


def _grads(seed: int, spread: float, scale: float):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * spread * scale).float() for s in SHAPES]


def check_unscale_and_clip(m):
    # (seed, true-gradient spread, loss scale, max_norm): clipped, unclipped, a huge scale
    for seed, spread, scale, max_norm in ((1, 1.0, 2.0**16, 1.0), (2, 0.01, 2.0**16, 1.0), (3, 3.0, 2.0**24, 0.5),
                                          (4, 0.5, 1.0, 2.0)):
        scaled = _grads(seed, spread, scale)
        norm, coef, want = _reference(scaled, scale, max_norm)
        grads = [t.clone() for t in scaled]
        out = m.unscale_and_clip_(grads, scale, max_norm)
        assert isinstance(out, tuple) and len(out) == 3, "return (total_norm, clip_coef, found_inf)"
        got_norm, got_coef, found_inf = out
        label = f"seed {seed}, scale {scale:g}, max_norm {max_norm}"
        assert not found_inf, f"{label}: found_inf is True for finite gradients"
        assert abs(got_norm - norm) <= GRAD_TOL * norm, (
            f"{label}: total_norm {got_norm:.6g}, expected the UNSCALED norm {norm:.6g} (unscale before clipping)")
        assert abs(got_coef - coef) <= GRAD_TOL * coef, f"{label}: clip_coef {got_coef:.6g}, expected {coef:.6g}"
        for i, (a, b) in enumerate(zip(grads, want)):
            err = (a.double() - b).abs().max().item() / b.abs().max().item()
            assert err <= GRAD_TOL, f"{label}: gradient {i} off by {err:.2e} relative to clip_grad_norm_ after unscale"


def check_unscale_and_clip_overflow(m):
    scale = 2.0**16
    scaled = _grads(5, 1.0, scale)
    scaled[1][3] = math.inf
    grads = [t.clone() for t in scaled]
    norm, coef, found_inf = m.unscale_and_clip_(grads, scale, 1.0)
    assert found_inf, "an inf gradient must give found_inf=True"
    assert coef == 1.0, f"clip_coef must be 1.0 (nothing clipped) on an overflow step, got {coef}"
    for i, (a, s) in enumerate(zip(grads, scaled)):
        fin = torch.isfinite(s)
        assert torch.allclose(a[fin].double(), s[fin].double() / scale, rtol=GRAD_TOL, atol=0), (
            f"gradient {i}: on an overflow step the gradients must be unscaled but not clipped")


CHECKS = [check_scaler_patterns, check_scaler_random, check_unscale_and_clip, check_unscale_and_clip_overflow]
