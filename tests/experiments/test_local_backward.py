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
    ok = dict(output_error=1e-16, grad_error=1e-14, fd_error=1e-9)
    assert experiment.decide("rmsnorm", **ok).record_fields() == dict(decision="accept", next_step=None)
    for key, bad, why in (("output_error", 1e-8, "output error 1e-08 > TOL64 1e-10"),
                          ("grad_error", 1e-8, "gradient error 1e-08 > TOL64 1e-10"),
                          ("fd_error", 1e-4, "finite-difference error 0.0001 > TOL_FD 1e-06"),
                          ("grad_error", float("nan"), "gradient error nan > TOL64")):
        d = experiment.decide("rmsnorm", **dict(ok, **{key: bad}))
        assert d.verdict == "reject" and why in d.reason and d.next_step == "inspect the backward of rmsnorm"


def test_conformance_against_transformers_modules():
    row = experiment.conformance()
    assert row.passed, row.detail
