"""``experiments.decision``: counted work and the memory strategies' records, on hand-made measured arms.

The rule itself (``decide``, each branch and its boundaries) is held by ``tests/records/test_decision.py``
and ``tests/book/test_rules.py``; here: ``work``, ``more_work`` and what ``strategy_records`` computes from
the arms (ratios against the baseline by hand, failures, foreign arms, strict JSON).
"""

import math
from types import SimpleNamespace

import pytest

from bp_mech.bench.compare import Comparison
from bp_mech.bench.oom import Failed
from bp_mech.bench.step import Probe
from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.bench.timing import Timing
from bp_mech.experiments.decision import decide, more_work, strategy_records, work
from bp_mech.experiments.harness import Measured
from bp_mech.instruments.peak import Peak


def _arm(name, strategy, peak, samples, *, recomputes=0, d2h=0, loss=2.0, equal=True):
    probe = Probe(loss=loss, grads=[], grad_norm=1.0, finite=math.isfinite(loss), calls={}, recomputes=recomputes,
                  held_after_forward=0, saved_bytes=0, saved_tensors=0)
    return Measured(name, Timing(samples, clock="thread_time"), Peak(peak, None, "tracked-cpu"), 0, 3, 0,
                    probe=probe, comparison=Comparison(0.0, 0.0, 0.0, True), equal=equal, strategy=strategy,
                    d2h_bytes=d2h)


def _ctx():
    return SimpleNamespace(device="cpu", memory_source="tracked-cpu",
                           record=lambda candidate, **fields: dict(candidate=candidate, **fields))


def test_work_counts_recomputes_offloaded_bytes_and_the_chunked_loss():
    assert work(_arm("x", parse("checkpoint-all"), 1, [1.0], recomputes=4, d2h=96)) == (4, 96, 0)
    assert work(_arm("y", parse("chunked-loss"), 1, [1.0])) == (0, 0, 1)


@pytest.mark.parametrize("a, b, more", [
    ((2, 0, 0), (0, 0, 0), True),   # more of one kind, no less of any
    ((0, 0, 0), (0, 0, 0), False),  # the same work is not more
    ((2, 0, 0), (0, 8, 0), False),  # more of one kind, less of another: not comparable
    ((2, 8, 1), (1, 8, 0), True),
])
def test_more_work_is_the_componentwise_order_strict_somewhere(a, b, more):
    def arm(w):
        return _arm("x", parse("chunked-loss") if w[2] else PLAIN, 1, [1.0], recomputes=w[0], d2h=w[1])
    assert more_work(arm(a), arm(b)) is more


def test_records_hold_the_ratios_against_plain_and_the_rule_s_decision():
    plain = _arm("plain", PLAIN, 1000, [1.0, 1.0, 1.2])
    ckpt = _arm("checkpoint-all", parse("checkpoint-all"), 600, [1.2, 1.3, 1.5], recomputes=2)
    recs = strategy_records(_ctx(), {"plain": plain, "checkpoint-all": ckpt},
                            {"plain": PLAIN, "checkpoint-all": parse("checkpoint-all")})
    base, rec = recs
    assert base["decision"] is None and "peak_saving" not in base["metrics"]  # the baseline decides nothing
    m = rec["metrics"]
    assert m["peak_saving"] == pytest.approx(1 - 600 / 1000)
    assert m["time_ratio"] == pytest.approx(1.3 / 1.0)  # medians
    assert m["more_work"] is True and rec["recompute_count"] == 2 and rec["transfer_bytes"] is None
    assert rec["decision"] == decide(True, 0.4, 1.3, rec["timing_noise"]).verdict == "accept"
    assert rec["peak_allocated"] == 600 and rec["strategy"] == "checkpoint-all"


def test_a_failed_arm_a_foreign_arm_and_a_non_finite_loss():
    plain = _arm("plain", PLAIN, 1000, [1.0])
    mine = _arm("save_on_cpu", parse("offload"), 500, [2.0], d2h=64, loss=math.inf, equal=False)
    recs = strategy_records(_ctx(), {"plain": plain, "oom": Failed("out of memory: CUDA", "oom"), "save_on_cpu": mine},
                            {"plain": PLAIN, "oom": parse("offload"), "save_on_cpu": parse("offload")})
    _, oom, own = recs
    assert oom["failure"] == "out of memory: CUDA" and oom["strategy"] is None  # its name is not the strategy's
    assert own["strategy"] is None and own["all_finite"] is False and own["decision"] == "reject"
    assert own["metrics"]["loss"] is None  # inf: stored as null in strict JSON
    assert own["transfer_bytes"] == {"d2h": 64, "h2d": 0}


def test_without_a_measured_baseline_nothing_is_decided():
    ckpt = _arm("checkpoint-all", parse("checkpoint-all"), 600, [1.2])
    recs = strategy_records(_ctx(), {"plain": Failed("out of memory", "plain"), "checkpoint-all": ckpt},
                            {"plain": PLAIN, "checkpoint-all": parse("checkpoint-all")})
    assert recs[1]["decision"] is None and "time_ratio" not in recs[1]["metrics"]
