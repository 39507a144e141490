"""Part 02 · 09, the experiment: one accepted record per op, the decision rule, and the
conformance row against transformers' modules."""

import pytest

from bp_mech.experiments import local_backward as experiment
from bp_mech.records.registry import make_context

pytestmark = pytest.mark.ch09


def test_run_gives_one_accepted_record_per_op():
    recs = experiment.run(make_context("TRAIN-LOCAL-BACKWARD", "cpu", "tiny-b1s16"))
    assert [r.candidate for r in recs] == list(experiment.OPS)
    assert all(r.decision == "accept" and r.grad_error <= experiment.TOL64 for r in recs)
    assert all(r.metrics["fp32_hand"] and r.metrics["fd_errors"] for r in recs)


def test_decide_rejects_any_error_beyond_its_tolerance():
    ok = dict(op="rmsnorm", output_error=1e-16, grad_errors={"x": 1e-15, "w": 1e-14}, fd_errors={"x": 1e-9})
    assert experiment.decide(ok) == ("accept", None)
    for key, bad in (("output_error", 1e-8), ("grad_errors", {"x": 1e-15, "w": 1e-8}), ("fd_errors", {"x": 1e-4})):
        decision, next_step = experiment.decide(dict(ok, **{key: bad}))
        assert decision == "reject" and "rmsnorm" in next_step


def test_conformance_against_transformers_modules():
    row = experiment.conformance()
    assert row.passed, row.detail
