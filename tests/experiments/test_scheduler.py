"""Part 02 · 12, the experiment: a real GradScaler run with injected skips moves the naive clock's
boundaries by the skips before them and leaves the update clock on time; the decision rule; the
dry-run plan; the conformance row."""

import pytest

from bp_mech.records import registry, results
from bp_mech.experiments import scheduler as experiment
from bp_mech.experiments.scheduler import ClockRun
from bp_mech.scheduler import WSDConfig


def test_run_boundary_shifts_and_records(tmp_path):
    ctx = registry.make_context("TRAIN-SCHEDULER-CLOCK", "cpu", "tiny-b1s16")
    recs = {r.candidate: r for r in registry.run(ctx)}
    run_cfg = ClockRun()
    n_skips = len(run_cfg.overflow_calls) + len(run_cfg.explicit_skip_calls)
    for r in recs.values():
        results.load_record(results.save_record(r, tmp_path))
        assert r.updates == run_cfg.schedule.total and r.skipped_updates == n_skips
        assert r.metrics["skipped_calls"] == sorted(run_cfg.overflow_calls + run_cfg.explicit_skip_calls)
        assert r.metrics["params_unchanged_on_skip"] and r.metrics["transformers_max_abs_diff"] == 0.0
        assert r.all_finite
    good, naive = recs["update-clock"].metrics, recs["naive-clock"].metrics
    assert good["shifts"] == {"warmup_end": 0, "decay_start": 0, "end": 0} and good["lr_error_max"] == 0.0
    # skips (2, 3) before warmup end, 11 before decay start, 22 before the end: shifts of 2, 3, 4
    assert naive["shifts"] == {"warmup_end": -2, "decay_start": -3, "end": -4}
    assert good["boundaries_calls"] == {"warmup_end": 8, "decay_start": 19, "end": 28}
    assert naive["updates_past_end"] == 4 and good["updates_past_end"] == 0 and naive["lr_error_max"] > 0
    assert (recs["update-clock"].decision, recs["naive-clock"].decision) == ("accept", "reject")
    assert good["final_lr"] == pytest.approx(run_cfg.schedule.base_lr * run_cfg.schedule.min_lr_ratio)


def test_naive_trace_matches_transformers_stepped_every_call():
    ctx = registry.make_context("TRAIN-SCHEDULER-CLOCK", "cpu", "tiny-b1s16")
    run_cfg = ClockRun(schedule=WSDConfig(warmup=3, stable=2, decay=3, decay_type="linear"), overflow_calls=(1,),
                       explicit_skip_calls=(5,))
    t = experiment.train_with_clock("naive-clock", ctx, run_cfg)
    s = experiment.trace_summary(t, run_cfg.schedule)
    # call 5 (the skip) is the naive decay-start call itself, so only call 1 precedes that boundary
    assert s["transformers_max_abs_diff"] == 0.0 and s["shifts"] == {"warmup_end": -1, "decay_start": -1, "end": -2}


def test_decide_accepts_only_an_on_time_exact_clock():
    on_time = {"warmup_end": 0, "decay_start": 0, "end": 0}
    assert experiment.decide(on_time, 0.0).record_fields() == dict(decision="accept", next_step=None)
    late = experiment.decide(on_time, 1e-18)  # exact, no tolerance
    assert late.verdict == "reject" and late.reason == "a rate off wsd_lr at its true index by 1e-18"
    early = experiment.decide(dict(on_time, decay_start=-1, end=None), 0.0)
    assert early.reason == "boundaries off their nominal update: decay_start by -1, end never reached"


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail


def test_dry_run():
    p = registry.dry_run(registry.make_context("TRAIN-SCHEDULER-CLOCK", "dry_run"))
    assert p["candidates"] == ["naive-clock", "update-clock"] and p["optimizer_calls"] == 28 == ClockRun().optimizer_calls
