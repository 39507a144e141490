"""Part 02 · 55, the experiment (``bp_mech.experiments.update_dynamics``): the per-update trace, the
decision rule, the records, the measurement's paths (an out-of-memory candidate), diverged traces and
the conformance check."""

import dataclasses
import math

import pytest
import torch

from bp_mech.records import registry, results
from bp_mech import update_dynamics
from bp_mech.experiments import harness
from bp_mech.experiments import update_dynamics as experiment
from bp_mech.instruments.workload import build_model, make_batches, parse_workload

W = parse_workload("tiny-b2s16")
CFG = experiment.DynamicsConfig(updates=6, timed=3, warmup=1)


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    return model, {n: t.clone() for n, t in model.state_dict().items()}, make_batches(W, CFG.updates)


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail


def test_trace_values(setup):
    model, init, batches = setup
    rows = {n: experiment.trace(model, init, batches, n, CFG, "cpu") for n in experiment.CANDIDATES}
    for name, tr in rows.items():
        assert len(tr) == CFG.updates and all(r["finite"] for r in tr)
        for r in tr:
            want = min(1.0, CFG.max_norm / (r["grad_norm"] + update_dynamics.EPS))
            assert r["would_clip"] == pytest.approx(want, rel=1e-6)
            assert r["clip_coef"] == (pytest.approx(want, rel=1e-6) if name == "high_lr_clip" else 1.0)
            for g in r["groups"].values():
                assert g["ratio"] == pytest.approx(g["update_norm"] / g["param_norm"])
    # same data, same init: the first loss and gradient norm agree across candidates
    assert len({round(tr[0]["loss"], 6) for tr in rows.values()}) == 1
    assert len({round(tr[0]["grad_norm"], 5) for tr in rows.values()}) == 1
    # AdamW's first step is about lr per element: 100x the LR gives about 100x the update
    r0 = rows["high_lr"][0]["groups"]["mlp"]["update_norm"] / rows["base_lr"][0]["groups"]["mlp"]["update_norm"]
    assert 50 < r0 < 150
    assert rows["high_lr_clip"][0]["clip_coef"] < 1.0  # the tiny model's first gradient exceeds max_norm


def test_update_ratio_measures_the_step(setup):
    """The first AdamW update of the norm gains (init 1, no decay) moves each element by about lr."""
    model, init, batches = setup
    tr = experiment.trace(model, init, batches[:1], "base_lr", CFG, "cpu")
    g = tr[0]["groups"]["norm_bias"]
    n_norm = sum(p.numel() for p in update_dynamics.param_groups(model)["norm_bias"])
    assert g["update_norm"] == pytest.approx(CFG.base_lr * math.sqrt(n_norm), rel=0.1)


@pytest.mark.parametrize("rows,want", [
    ([dict(loss=5.0, finite=True), dict(loss=4.0, finite=True)], "accept"),
    ([dict(loss=5.0, finite=True), dict(loss=4.0, finite=True), dict(loss=4.6, finite=True),
      dict(loss=3.0, finite=True)], "tune"),  # spike of 0.6 nats over the running minimum
    ([dict(loss=5.0, finite=True), dict(loss=5.1, finite=True)], "tune"),  # did not fall
    ([dict(loss=5.0, finite=True), dict(loss=float("nan"), finite=False)], "reject"),
])
def test_decision_rule(rows, want):
    rows = [dict(r, grad_norm=1.0, clip_coef=1.0, groups={"mlp": dict(ratio=0.01)}) for r in rows]
    d = experiment.decide(experiment.summarize(rows))
    assert d.verdict == want and d.reason and d.next_step



def _rows(ratios, norms):
    """A falling-loss trace with the given update ratios (mlp group) and gradient norms."""
    return [dict(loss=5.0 - 0.1 * t, finite=True, grad_norm=n, clip_coef=1.0,
                 groups={"mlp": dict(ratio=r), "norm_bias": dict(ratio=r / 10)})
            for t, (r, n) in enumerate(zip(ratios, norms))]


def test_the_update_ratio_decides_at_its_bound():
    """A falling loss with no spike is still tuned when one update moves a group by more than
    MAX_UPDATE_RATIO of its norm; at the bound it is accepted."""
    hi = experiment.MAX_UPDATE_RATIO
    summary = experiment.summarize(_rows([0.01, hi, 0.01], [1.0, 1.0, 1.0]))
    assert experiment.decide(summary).verdict == "accept"
    summary = experiment.summarize(_rows([0.01, math.nextafter(hi, 1), 0.01], [1.0, 1.0, 1.0]))
    assert summary.max_ratio_at == dict(update=1, group="mlp")
    d = experiment.decide(summary)
    assert d.verdict == "tune" and d.reason == "finite, but update 1 moved mlp by 0.1× its norm (> MAX_UPDATE_RATIO 0.1)"


def test_a_gradient_norm_spike_decides_without_a_loss_spike():
    """The norm against the median of the earlier ones: at GRAD_SPIKE_MAX x accepted, above it tuned."""
    k = experiment.GRAD_SPIKE_MAX
    assert experiment.grad_spike([2.0, 1.0, 1.0, k]) == k  # the median of 2, 1, 1, not the first
    assert experiment.grad_spike([2.0]) == 1.0 and experiment.grad_spike([0.0, 1.0]) == math.inf
    ok = experiment.summarize(_rows([0.01] * 4, [2.0, 1.0, 1.0, k]))
    assert experiment.decide(ok).verdict == "accept"
    bad = experiment.summarize(_rows([0.01] * 4, [2.0, 1.0, 1.0, math.nextafter(k, 3)]))
    d = experiment.decide(bad)
    assert d.verdict == "tune" and "a gradient norm reached 2.0× the earlier median (> GRAD_SPIKE_MAX 2)" in d.reason


def test_the_high_lr_is_tuned_by_its_first_update(setup):
    """100x the LR moves the freshly initialised weights by several times their norm in update 0."""
    model, init, batches = setup
    summary = experiment.summarize(experiment.trace(model, init, batches, "high_lr", CFG, "cpu"))
    assert summary.max_ratio_at["update"] == 0 and max(summary.max_ratio.values()) > 1
    assert experiment.decide(summary).verdict == "tune"

def test_run_records(tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, "config_for", lambda arch, device, smoke=False: CFG)
    recs = experiment.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))
    assert [r.candidate for r in recs] == list(experiment.CANDIDATES)
    for r in recs:
        results.save_record(r, tmp_path)
        assert r.failure is None and r.peak_allocated > 0 and r.step_median_s > 0 and r.strategy == "plain"
        want = experiment.decide(experiment.summarize(r.metrics["trace"]))
        assert len(r.metrics["trace"]) == 6 and dict(decision=r.decision, next_step=r.next_step) == want.record_fields()
        assert r.metrics["summary"] == dataclasses.asdict(experiment.summarize(r.metrics["trace"]))
        assert r.threads == 1 and r.metrics["interleaved"] and len(r.metrics["step_samples_s"]) == CFG.timed
        by_run = r.metrics["updates_by_run"]
        assert by_run == dict(trace=6, measurement=2 + CFG.warmup + CFG.timed) and r.updates == sum(by_run.values())
    rec = {r.candidate: r for r in recs}
    assert rec["base_lr"].timing_noise is None and rec["base_lr"].metrics["time_ratio"] is None
    for name, base in (("high_lr", "base_lr"), ("high_lr_clip", "high_lr")):
        m = rec[name].metrics
        assert m["time_baseline"] == base and m["time_ratio"] == rec[name].step_median_s / rec[base].step_median_s
        if name == "high_lr_clip" and m["time_ratio"] < 1.0:  # clipping is more work: faster is noise
            assert "strictly more work" in rec[name].timing_noise
    assert recs[2].metrics["summary"]["clipped_updates"] >= 1 and recs[1].metrics["summary"]["clipped_updates"] == 0
    monkeypatch.undo()  # the plan of the real configs
    plan = registry.dry_run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "dry_run", "qwen05-b2s512"))
    gpu = plan["modes"]["real_gpu"]
    assert gpu["lrs"]["high_lr"] == 100 * gpu["lrs"]["base_lr"] and gpu["estimated_seconds"] < 60
    assert gpu["timed_rounds"] >= 20 and plan["modes"]["cpu"]["interleaved"] and plan["modes"]["cpu"]["threads"] == 1


def test_a_diverged_trace_still_saves(tmp_path, monkeypatch):
    """NaN/inf in a trace become null in the record (strict JSON) and the decision is reject."""
    def fake_trace(model, init, batches, name, cfg, device):
        g = {k: dict(update_norm=math.inf, param_norm=1.0, ratio=math.inf) for k in update_dynamics.GROUPS}
        return [dict(loss=5.0, finite=True, grad_norm=2.0, clip_coef=1.0, would_clip=0.5, groups=g),
                dict(loss=math.nan, finite=False, grad_norm=math.nan, clip_coef=1.0, would_clip=math.nan, groups=g)]

    monkeypatch.setattr(experiment, "config_for", lambda arch, device, smoke=False: CFG)
    monkeypatch.setattr(experiment, "trace", fake_trace)
    recs = experiment.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))
    for r in recs:
        assert r.decision == "reject" and r.all_finite is False and r.next_step.startswith("non-finite from update 1")
        assert r.metrics["trace"][1]["loss"] is None and r.metrics["summary"]["first_nonfinite"] == 1
        results.load_record(results.save_record(r, tmp_path))


def test_stale_gradients_do_not_leak_into_the_next_candidate(setup):
    """After a candidate fails mid-step (CUDA OOM), .grad may remain on the shared model."""
    model, init, batches = setup
    clean = experiment.trace(model, init, batches[:2], "high_lr_clip", CFG, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    assert experiment.trace(model, init, batches[:2], "high_lr_clip", CFG, "cpu") == clean


@pytest.mark.parametrize("together", [True, False])
def test_oom_in_one_candidate_is_its_failure(monkeypatch, together):
    real = harness.train_step  # the measurement's step (the trace calls bench.step.train_step itself)

    def flaky(model, opt, batch, strategy, max_norm=None, **kw):
        if max_norm is None and opt.param_groups[0]["lr"] > CFG.base_lr:  # high_lr's measurement
            model(**batch).loss.backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, opt, batch, strategy, max_norm=max_norm, **kw)

    real_measure = experiment.measure
    monkeypatch.setattr(experiment, "config_for", lambda arch, device, smoke=False: CFG)
    monkeypatch.setattr(harness, "train_step", flaky)
    monkeypatch.setattr(experiment, "measure", lambda *a, **kw: real_measure(*a, **kw, together=together))
    recs = {r.candidate: r for r in experiment.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))}
    bad = recs["high_lr"]
    assert bad.failure.startswith("out of memory") and bad.decision is None and bad.peak_allocated is None
    assert bad.next_step.startswith("failed: out of memory")
    assert len(bad.metrics["trace"]) == CFG.updates == bad.updates  # the trace ran; only the measurement failed
    ok = recs["high_lr_clip"]
    assert ok.failure is None and ok.peak_allocated > 0 and ok.metrics["time_ratio"] is None  # no baseline time
    assert ok.metrics["interleaved"] is together and len(ok.metrics["step_samples_s"]) == CFG.timed


def test_config_follows_the_device():
    assert experiment.config_for("qwen05", "cuda").timed == 20 and experiment.config_for("qwen05", torch.device("cuda", 0)).timed == 20
    assert experiment.config_for("tiny", "cpu").base_lr == 1e-3 and experiment.config_for("qwen05", "cpu").base_lr == 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = experiment.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "real_gpu", "tiny-b2s64"))
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.memory_source == "cuda-allocator" and r.failure is None
        assert r.peak_reserved >= r.peak_allocated > 0 and r.step_p95_s >= r.step_median_s > 0
    assert recs[0].all_finite and recs[0].decision == "accept"
