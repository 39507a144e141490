"""The CPU timing protocol (``bp_mech.bench.timing``): one intra-op thread, candidates interleaved,
ratios that contradict counted work marked as noise — and a run beside a busy process."""

import contextlib
import subprocess
import sys
import time

import pytest
import torch

from bp_mech.records import registry
from bp_mech.experiments import harness, strategies
from bp_mech.bench.timing import MAX_RATIO_SPREAD, Timing, time_interleaved, timing_noise


def test_interleaved_rounds_rotate_and_exclude_the_warm_up():
    order = []
    steps = {n: (lambda i, n=n: order.append((i, n))) for n in "abc"}
    out = time_interleaved(steps, rounds=4, warmup=2, device="cpu")
    assert len(order) == 3 * 6
    firsts = [order[3 * r][1] for r in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]  # each round starts with the next candidate
    for n in "abc":
        t = out[n]
        assert len(t.samples) == 4 and t.warmup_excluded == 2 and t.interleaved and t.threads == 1
        assert sorted(i for i, m in order if m == n) == list(range(6))


def test_one_thread_inside_the_timed_region_and_restored_after():
    before = torch.get_num_threads()
    seen = []
    time_interleaved({"a": lambda i: seen.append(torch.get_num_threads())}, rounds=2, warmup=0)
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_a_candidates_configuration_is_entered_outside_the_timed_region():
    @contextlib.contextmanager
    def slow_setup():
        time.sleep(0.05)
        yield
        time.sleep(0.05)

    out = time_interleaved({"a": lambda i: None}, rounds=3, warmup=0, around={"a": slow_setup})
    assert max(out["a"].samples) < 0.04


def _t(median, p95):
    return Timing(median, p95, 2, [median, p95])


def test_noise_rule():
    base = _t(1.0, 1.1)
    assert timing_noise(_t(1.5, 1.6), base, more_work=True) is None
    assert "more work" in timing_noise(_t(0.1, 0.12), base, more_work=True)  # recomputes, yet faster
    assert timing_noise(_t(0.95, 1.0), base, more_work=False) is None  # same work: faster is possible
    wide = timing_noise(_t(1.2, 1.1 * 1.2 * MAX_RATIO_SPREAD * 1.1), base, more_work=False)
    assert wide and "P95" in wide
    assert timing_noise(_t(1.2, 1.1 * 1.2 * MAX_RATIO_SPREAD * 0.9), base, more_work=False) is None


def test_a_noisy_ratio_gives_no_decision_from_time():
    assert strategies.decide(True, 0.30, 1.1) == ("accept", None)
    decision, nxt = strategies.decide(True, 0.30, 1.1, noise="P95 ratio differs")
    assert decision is None and "noise" in nxt
    assert strategies.decide(True, 0.10, 1.1, noise="x")[0] == "tune"  # saves too little: memory decides, not time
    assert strategies.decide(False, 0.30, 1.1, noise="x")[0] == "reject"  # correctness decides, not time


@pytest.fixture
def busy_core():
    """A process spinning on one core beside the test, as a neighbour on a shared machine."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_checkpointing_costs_time_even_beside_a_busy_process(busy_core):
    """Recomputing every layer does strictly more work: its time ratio must come out above 1, and two
    runs must agree within 20 %, with another process busy beside them."""
    ratios = []
    for _ in range(2):
        recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-CHECKPOINT", "cpu"))}
        r = recs["checkpoint-all"]
        assert r.threads == 1 and r.recompute_count > 0
        ratios.append(r.metrics["time_ratio"])
        assert r.metrics["time_ratio"] > 1.0, recs
        assert r.timing_noise is None or "more work" not in r.timing_noise
    assert abs(ratios[0] / ratios[1] - 1) < 0.20, ratios
