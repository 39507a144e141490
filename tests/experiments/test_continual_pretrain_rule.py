"""``experiments.continual_pretrain_rule``: the rule at its bounds (a bound itself passes) and on NaN, which
never passes. Each verdict with its reason's numbers: ``tests/records/test_decision.py``."""

import math

import pytest

from bp_mech.experiments.continual_pretrain_rule import (MAX_HOLDOUT_DRIFT_REL, MIN_DOMAIN_GAIN_REL, RESUME_TOL,
                                                         decide_domain, decide_resume)


@pytest.mark.parametrize("gain, drift, verdict", [
    (MIN_DOMAIN_GAIN_REL, MAX_HOLDOUT_DRIFT_REL, "accept"),  # both at their bounds
    (math.nextafter(MIN_DOMAIN_GAIN_REL, 0), 0.0, "reject"),
    (MIN_DOMAIN_GAIN_REL, math.nextafter(MAX_HOLDOUT_DRIFT_REL, 1), "tune"),
    (0.5, -0.3, "accept"),  # the holdout improved
    (-0.1, 0.5, "reject"),  # no gain: the drift is not even looked at
])
def test_the_domain_rule_at_its_bounds(gain, drift, verdict):
    assert decide_domain(gain, drift, True).verdict == verdict


def test_a_non_finite_run_or_a_nan_difference_never_passes():
    assert decide_domain(0.5, 0.0, False).verdict == "reject"  # a NaN gain comes with all_finite False
    for gain, drift in ((math.nan, 0.0), (0.5, math.nan), (math.inf, 0.0), (math.nan, math.nan)):
        assert decide_domain(gain, drift, True).verdict == "reject"  # even when all_finite says otherwise
    for loss, weight in ((math.nan, 0.0), (0.0, math.nan)):
        assert decide_resume(loss, weight, "cuda").verdict == "reject"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_resume_rule_is_the_device_s_tolerance_inclusive(device):
    tol = RESUME_TOL[device]
    assert decide_resume(tol, tol, device).verdict == "accept"
    assert decide_resume(math.nextafter(tol, 1), 0.0, device).verdict == "reject"
    assert decide_resume(0.0, math.nextafter(tol, 1), device).verdict == "reject"
