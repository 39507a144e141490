"""The CPU timing protocol (``bp_mech.bench.timing``): one intra-op thread, candidates interleaved,
ratios that contradict counted work marked as noise — and a run beside a busy process."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from bp_mech.bench.timing import (MAX_RATIO_SPREAD, Timing, clock_for, median_interval, percentile, summarize,
                                   time_interleaved, time_steps, timing_noise)
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import configured, parse
from bp_mech.experiments import decision
from bp_mech.experiments.harness import Run
from bp_mech.instruments.adamw import make_adamw
from bp_mech.instruments.workload import build_model, make_batches, parse_workload
from bp_mech.records import registry


def test_percentile_and_warmup_exclusion():
    samples = [10.0] + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 100.0]
    t = summarize(samples, warmup=1)
    assert t.warmup_excluded == 1 and len(t.samples) == 10
    assert t.median_s == 5.5 and t.p95_s == 100.0
    assert percentile([3, 1, 2], 50) == 2
    with pytest.raises(ValueError):
        summarize([1.0], warmup=1)
    with pytest.raises(ValueError):
        Timing([1.0], clock="sundial")


def test_time_steps_counts_every_call_by_both_clocks():
    calls = []
    t = time_steps(calls.append, steps=5, warmup=2)
    assert calls == [0, 1, 2, 3, 4] and len(t.samples) == len(t.wall_samples) == 3 and t.p95_s >= t.median_s > 0
    assert t.clock == clock_for("cpu") == "thread_time" and clock_for("cuda") == "wall"


def test_cpu_time_leaves_out_the_time_the_thread_waits():
    """A step that sleeps takes wall time but (almost) no CPU time of its thread: the CPU clock counts
    only what the thread itself computed, which is why it holds when other processes take the cores."""
    out = time_interleaved({"sleeps": lambda i: time.sleep(0.02)}, rounds=3, warmup=0)["sleeps"]
    assert out.clock == "thread_time" and out.wall_median_s >= 0.02 > 10 * out.median_s
    fields = out.record_fields()
    assert fields["step_median_s"] == out.median_s and fields["wall_median_s"] == out.wall_median_s
    assert fields["step_clock"] == "thread_time" and fields["threads"] == 1


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
    return Timing([median, median, p95] * 7, warmup_excluded=2)  # median ``median``, P95 (the 20th of 21) ``p95``


def test_noise_rule():
    base = _t(1.0, 1.1)
    assert timing_noise(_t(1.5, 1.6), base, more_work=True) is None
    assert "more work" in timing_noise(_t(0.1, 0.12), base, more_work=True)  # recomputes, yet faster
    assert timing_noise(_t(0.95, 1.0), base, more_work=False) is None  # same work: faster is possible
    wide = timing_noise(_t(1.2, 1.1 * 1.2 * MAX_RATIO_SPREAD * 1.1), base, more_work=False)
    assert wide and "P95" in wide
    assert timing_noise(_t(1.2, 1.1 * 1.2 * MAX_RATIO_SPREAD * 0.9), base, more_work=False) is None


def test_a_noisy_ratio_gives_no_decision_from_time():
    assert decision.decide(True, 0.30, 1.1).record_fields() == dict(decision="accept", next_step=None)
    d = decision.decide(True, 0.30, 1.1, noise="P95 ratio differs")
    assert d.verdict is None and "is noise (P95 ratio differs)" in d.reason and "quiet machine" in d.next_step
    assert decision.decide(True, 0.08, 1.1, noise="x").verdict == "tune"  # saves too little: memory decides, not time
    assert decision.decide(False, 0.30, 1.1, noise="x").verdict == "reject"  # correctness decides, not time


@pytest.fixture
def busy_cores():
    """One process spinning per core beside the test, paused (SIGSTOP) until a step resumes them: with
    them running, the cores are oversubscribed as on a shared machine."""
    ps = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 2))]
    for p in ps:
        p.send_signal(signal.SIGSTOP)
    try:
        yield ps
    finally:
        for p in ps:
            p.kill()
            p.wait()


@contextlib.contextmanager
def spinning(ps):
    """The spinners run inside the block (resumed a few scheduler slices before it), paused after it."""
    for p in ps:
        p.send_signal(signal.SIGCONT)
    time.sleep(0.02)
    try:
        yield
    finally:
        for p in ps:
            p.send_signal(signal.SIGSTOP)


def per_round(a: Timing, b: Timing, wall: bool = False, across: bool = False) -> list[float]:
    """Per timed round, ``a``'s step time over ``b``'s (both timed in that round), by CPU time, by wall
    time, or ``across``: ``a``'s wall time over ``b``'s CPU time."""
    xs, ys = ((a.wall_samples, b.samples) if across else (a.wall_samples, b.wall_samples) if wall
              else (a.samples, b.samples))
    return [x / y for x, y in zip(xs, ys)]


def test_beside_busy_processes_a_step_waits_in_wall_time_not_in_cpu_time(busy_cores):
    """Why decisions read CPU time: beside processes that take the cores, a step's wall time grows with the
    time it waits for a core, its CPU time much less. One model and its AdamW (one memory layout), four
    candidates interleaved round by round: plain and checkpoint-all, each with the cores to itself and each
    beside one spinning process per core. Beside the spinners the plain step's wall time over its CPU time
    rises (measured here: about 2x), and checkpoint-all, which recomputes every layer, costs more CPU time
    than plain in both loads. Its CPU-time ratio is not asserted equal in both loads: beside the spinners it
    measured a few percent lower in 19 of 20 runs of this test (why is not pinned down; a preempted step
    refilling its caches is one candidate), more than the rounds' own spread covers, so an equality test of the
    two would fail now and then."""
    w = parse_workload("tiny-b2s64")
    model, batches = build_model(w), make_batches(w, 4)
    opt = make_adamw(model.parameters(), 1e-4, "cpu")
    train_step(model, opt, batches[0])  # AdamW's moments exist from here on
    steps, around = {}, {}
    for name in ("plain", "checkpoint-all"):
        run = Run.of(model, opt, batches, parse(name))
        for load in ("quiet", "busy"):
            steps[name, load] = run.step

            @contextlib.contextmanager
            def setup(s=parse(name), busy=load == "busy"):
                with configured(model, s), (spinning(busy_cores) if busy else contextlib.nullcontext()):
                    yield
            around[name, load] = setup
    t = time_interleaved(steps, rounds=30, warmup=3, around=around)
    waits = {load: percentile(per_round(t["plain", load], t["plain", load], across=True), 50)
             for load in ("quiet", "busy")}
    assert waits["busy"] > 1.2 * waits["quiet"], waits  # the spinners took the cores
    for load in ("quiet", "busy"):
        assert percentile(per_round(t["checkpoint-all", load], t["plain", load]), 50) > 1.0, load


def test_a_run_beside_busy_processes_reads_its_ratio_by_cpu_time(busy_cores):
    """The experiment itself, beside the spinners: CPU time, one thread, recomputes counted, and its ratio
    above 1, never marked as a contradiction of the counted work."""
    with spinning(busy_cores):
        recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-CHECKPOINT", "cpu"))}
    r = recs["checkpoint-all"]
    assert r.threads == 1 and r.recompute_count > 0 and r.step_clock == "thread_time"
    assert r.metrics["time_ratio"] == r.step_median_s / recs["plain"].step_median_s > 1.0, recs
    assert r.timing_noise is None or "more work" not in r.timing_noise


def test_the_median_interval_covers_the_median_as_often_as_it_says():
    """Of 2000 samples of 15 draws from a skewed distribution, the 90 % interval misses the true median
    (ln 2 for Exp(1)) in about 10 %, and never more than the binomial coverage allows."""
    import random

    rng, n, misses = random.Random(0), 15, 0
    for _ in range(2000):
        lo, hi = median_interval([rng.expovariate(1.0) for _ in range(n)], confidence=0.90)
        misses += not (lo <= 0.6931 <= hi)
    assert 0.02 < misses / 2000 <= 0.10 + 0.02  # (order statistics give coverage >= 90 %)
