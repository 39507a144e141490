"""``bench.rates``: the dry run's seconds, by hand from the assumed rates and the model's own parameter count."""

import pytest

from bp_mech.bench.rates import ASSUMED_FLOPS, ASSUMED_PASS_S, dry_run_seconds
from bp_mech.instruments.workload import build_model, parse_workload


def test_seconds_are_six_n_tokens_flops_at_the_assumed_rate_plus_a_fixed_cost_per_pass():
    n = sum(p.numel() for p in build_model(parse_workload("tiny-b1s8")).parameters())  # tied: counted once
    for device, low in (("cpu", False), ("cuda", False), ("cuda", True)):
        rate = ASSUMED_FLOPS[device]["low" if low else "float32"]
        want = 3 * (6 * n * 512 / rate + ASSUMED_PASS_S[device])
        assert dry_run_seconds("tiny", 512, 3, device, low) == pytest.approx(want, rel=1e-12)


def test_no_pass_costs_nothing_and_the_cost_grows_linearly():
    assert dry_run_seconds("tiny", 64, 0, "cpu") == 0.0
    assert dry_run_seconds("tiny", 64, 4, "cpu") == pytest.approx(2 * dry_run_seconds("tiny", 64, 2, "cpu"))
