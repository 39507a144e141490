"""Checks of the variant and the prediction of exercises/ex_amp_backward.py, explored by hypothesis.

``cast_report`` against rounding thresholds computed in float64 from ``torch.finfo`` (half the
smallest subnormal; the largest value plus half a unit in its last place), independent of
``.to(dtype)``, on drawn float32 gradients in non-contiguous views with the edge values planted among
them; ``predict_recovery_step`` against a real ``torch.amp.GradScaler("cpu")`` driven through the steps.
"""

import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import call, describe
from bp_mech.checks.ex_amp_contract import SHAPES, GradScalerReference
from bp_mech.checks.properties import assert_type, call_unmodified, explore, strided

# --- cast_report (variant) ----------------------------------------------------------------

def _limits(dtype):
    """(half the smallest subnormal, the smallest float32 magnitude that rounds to inf), from finfo in float64."""
    fi = torch.finfo(dtype)
    emax = math.floor(math.log2(fi.max))
    return fi.smallest_normal * fi.eps / 2, fi.max + fi.eps * 2.0**emax / 2


def _report64(grads, dtype):
    tiny, huge = _limits(dtype)
    found, under, over = False, 0, 0
    for g in grads:
        x = g.double()
        fin = torch.isfinite(x)
        under += int((fin & (x != 0) & (x.abs() <= tiny)).sum())
        over += int((fin & (x.abs() >= huge)).sum())
        found = found or bool((~fin).any()) or bool((fin & (x.abs() >= huge)).any())
    return found, under, over


def _edges(dtype):
    tiny, huge = _limits(dtype)
    up = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(math.inf)).item()
    down = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item()
    return [tiny, up(tiny), down(tiny), 2 * tiny, huge, down(huge), -huge, torch.finfo(torch.float32).max,
            0.0, -0.0, math.inf, -math.inf, math.nan]


def _report_case(fn, m, grads, dtype, at):
    got = call_unmodified(fn, m.cast_report, grads, dtype, names=("grads", "dtype"), at=at)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise AssertionError(f"{fn}: returned {describe(got)}, expected (found_inf, underflow, overflow) at {at}")
    for what, v, kind in zip(("found_inf", "underflow", "overflow"), got, (bool, int, int)):
        assert_type(fn, what, v, kind, at)
    want = _report64(grads, dtype)
    for what, v, w in zip(("found_inf", "underflow", "overflow"), got, want):
        assert v == w, f"{fn}: {what} is {v}, float64 rounding thresholds give {w} at {at}"


def check_cast_report(m):
    fn = "cast_report"
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype)[6:]
        edges = torch.tensor(_edges(dtype), dtype=torch.float32)
        _report_case(fn, m, [edges[:-3]], dtype, f"{name}: the finite edges {edges[:-3].tolist()}")
        _report_case(fn, m, [edges[-1:], torch.ones(3)], dtype, f"{name}: a NaN gradient")
        _report_case(fn, m, [edges[-3:-1]], dtype, f"{name}: inf and -inf gradients")
        _report_case(fn, m, [], dtype, f"{name}: no gradients")


def check_cast_report__contract(m):
    fn = "cast_report"

    def body(case):
        seed, dtype, shapes, how, log10, planted = case
        g = torch.Generator().manual_seed(seed)
        grads = [(torch.randn(s, generator=g, dtype=torch.float64) * 10.0**log10).float() for s in shapes]
        edges = _edges(dtype)
        for j, k in enumerate(planted):
            flat = grads[j % len(grads)].view(-1)
            flat[(5 * j) % flat.numel()] = edges[k]
        views = [strided(t.clone(), how) for t in grads]
        at = (f"{str(dtype)[6:]}, float32 gradients of shapes {shapes} (|g| ~ 1e{log10}) as {how} views, "
              f"planted {[edges[k] for k in planted]}")
        _report_case(fn, m, views, dtype, at)

    explore(st.tuples(st.integers(0, 2**16), st.sampled_from([torch.bfloat16, torch.float16]), SHAPES,
                      st.sampled_from(["slice", "transpose"]), st.sampled_from([-45, -40, -8, -6, 0, 4, 38]),
                      st.lists(st.integers(0, 12), max_size=3)), body)


# --- predict_recovery_step (predict, then measure) ---------------------------------------

def _measured_recovery(k, n, backoff, growth):
    kw = {"init_scale": 2.0**16, "growth_interval": n, "backoff_factor": backoff, "growth_factor": growth}
    ref = GradScalerReference(**kw)
    for step in range(10_000):
        _, scale, _ = ref.step(step < k)
        if step >= k - 1 and scale >= 2.0**16:
            return step
    raise RuntimeError("no recovery")


def check_predict_recovery_step(m):
    fn = "predict_recovery_step"

    def body(case):
        k, n, backoff, growth = case
        at = f"{k} overflows, growth_interval {n}, backoff_factor {backoff}, growth_factor {growth}"
        got = call(fn, m.predict_recovery_step, k, n, backoff, growth, at=at)
        assert_type(fn, "the step", got, int, at)
        want = _measured_recovery(k, n, backoff, growth)
        assert got == want, (f"{fn}: predicted step {got}, a real torch.amp.GradScaler is back at S0 after step "
                             f"{want} at {at}")

    explore(st.tuples(st.integers(1, 5), st.integers(1, 4), st.sampled_from([0.5, 0.25]), st.sampled_from([2.0, 4.0])),
            body)


CHECKS = [check_cast_report, check_cast_report__contract, check_predict_recovery_step]
