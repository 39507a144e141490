"""Part 02 · 11, the experiment (``bp_mech.experiments.accumulation``): token-weighted accumulation
equals the full batch and the naive one does not (the equivalence run), the measurement (resident and
incremental peak, both paths), the decision rule, the records, an out-of-memory candidate, the
conformance check."""


import pytest
import torch

from bp_mech import accumulation, accumulation_framework
from bp_mech.bench.compare import relative_l2
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.records import cache, registry, results
from bp_mech.experiments import accumulation as experiment, accumulation_updates, harness

W = parse_workload("tiny-b2s16")
CFG = experiment.AccumConfig(updates=2, timed=3, warmup=1)


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    return model, init, accumulation.padded_batches(W, CFG.updates, CFG.micro_max, CFG.max_pad_fraction)


def test_token_weighted_equals_full_batch_naive_does_not(setup):
    model, init, batches = setup
    eq = experiment.equivalence(model, init, batches, CFG, "cpu")
    for name in ("micro2", "micro4"):
        tok, naive = eq[name]["token"], eq[name]["naive"]
        assert tok["finite"] and naive["finite"]
        assert tok["loss_rel_diff"] <= 1e-6 and tok["grad_rel_diff"] <= 1e-5
        # After AdamW the parameters are compared relative to the update, not asserted equal: Adam moves an
        # element by about lr * sign(g), so where |g| is near eps a float32 reordering of the accumulated
        # gradient (other CPUs sum in another order) can flip that step; m of N elements flipping give a
        # relative difference of about 2 sqrt(m / N). The gradients before the update carry the equality.
        assert tok["param_diff_vs_update"] <= 0.05 < naive["param_diff_vs_update"]
        assert naive["grad_rel_diff"] > 1e-3 > 100 * tok["grad_rel_diff"]  # the naive error is real, not rounding


def test_measure_resident_and_incremental_peak(setup):
    model, init, batches = setup
    out = experiment.measure(model, init, batches, CFG, "cpu")
    assert all(isinstance(m, harness.Measured) for m in out.values())
    full, four = out["plain"], out["micro4"]
    n_params = sum(p.numel() for p in model.parameters())
    # float32 params + exp_avg + exp_avg_sq, plus one float32 `step` per parameter tensor
    assert full.resident_bytes == 3 * 4 * n_params + 4 * len(list(model.parameters()))
    for m in out.values():
        assert m.peak.allocated - m.resident_bytes > 4 * n_params  # the incremental peak: grads at least
        assert m.peak.source == "tracked-cpu" and m.timing.warmup_excluded == CFG.warmup
        t = m.timing
        assert t.interleaved and t.threads == 1 and len(t.samples) == CFG.timed
        assert m.updates == 2 + CFG.warmup + CFG.timed  # warm + tracked + warm-up + timed
    assert four.peak.allocated < full.peak.allocated  # activations of 1/4 of the batch
    # the sequential (CUDA) path, run on the CPU: the same tracked peak, a function of the program
    seq = experiment.measure(model, init, batches, CFG, "cpu", together=False)
    for name, m in seq.items():
        assert m.peak.allocated == out[name].peak.allocated
        assert m.resident_bytes == full.resident_bytes and m.updates == out[name].updates
        assert not m.timing.interleaved and len(m.timing.samples) == CFG.timed


@pytest.mark.parametrize("diff,saving,time,noise,want", [
    (1e-3, 0.5, 1.0, None, "reject"), (None, 0.5, 1.0, None, "reject"), (1e-7, 0.15, 1.3, None, "accept"),
    (1e-7, 0.05, 1.1, None, "tune"), (1e-7, 0.5, 1.6, None, "tune"), (1e-7, None, None, None, None),
    (1e-7, -0.2, 1.0, None, "tune"),  # a higher peak
    (1e-3, 0.5, 1.0, "noise", "reject"),  # the gradient decides without the time
    (1e-7, 0.05, 0.8, "noise", "tune"),  # so does a peak that barely falls
    (1e-7, 0.5, 0.8, "noise", None), (1e-7, 0.5, 1.6, "noise", None)])  # the rest would need the time
def test_decision_rule(diff, saving, time, noise, want):
    d = experiment.decide(diff, 1e-5, saving, time, noise)
    assert d.verdict == want and d.reason and d.next_step  # every outcome says why and what to do next
    if want is None and noise:
        assert "is noise (noise)" in d.reason and "GPU" in d.next_step


def test_run_records_one_label_per_sequence_length(tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, "config_for", lambda device, smoke=False: CFG)
    ctx = registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "cpu", "tiny-b2s16")
    recs = experiment.run(ctx)
    assert [(r.workload_id, r.run_label, r.candidate) for r in recs] == [
        (f"tiny-b2s{s}", f"cpu-default-s{s}", c) for s in (8, 16) for c in experiment.CANDIDATES]
    for r in recs:
        results.save_record(r, tmp_path)
        assert r.failure is None and r.all_finite and r.peak_allocated > 0 and r.effective_batch == 8
        assert r.threads == 1 and r.metrics["interleaved"] and r.warmup_excluded == CFG.warmup
        by_run = r.metrics["updates_by_run"]
        assert by_run["measurement"] == 2 + CFG.warmup + CFG.timed and r.updates == sum(by_run.values())
        assert by_run["equivalence_token"] == CFG.updates and r.strategy == r.candidate
        assert by_run["equivalence_naive"] == (0 if r.candidate == "plain" else CFG.updates)
        if r.candidate == "plain":
            assert r.timing_noise is None and r.decision is None
            continue
        assert r.grad_error <= 1e-5 and r.metrics["naive"]["grad_rel_diff"] > 1e-3
        m = r.metrics
        if m["time_ratio"] < 1.0:  # more passes, measured faster: noise, whatever the spread
            assert r.timing_noise and "strictly more work" in r.timing_noise
        assert m["peak_saving"] == 1 - r.peak_allocated / next(
            x for x in recs if x.candidate == "plain" and x.workload_id == r.workload_id).peak_allocated
        want = experiment.decide(r.grad_error, 1e-5, m["peak_saving"], m["time_ratio"], r.timing_noise)
        assert dict(decision=r.decision, next_step=r.next_step) == want.record_fields()
    c = cache.cached("TRAIN-GRADIENT-ACCUMULATION", tmp_path)
    assert sorted(c.groups) == ["cpu-default-s16", "cpu-default-s8"]
    monkeypatch.undo()  # the plan of the real configs
    plan = registry.dry_run(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "dry_run", "qwen05-b2s256"))
    gpu = plan["modes"]["real_gpu"]
    assert plan["workloads"] == ["qwen05-b2s128", "qwen05-b2s256"] and gpu["estimated_seconds"] < 75
    assert gpu["timed_rounds"] == experiment.config_for("cuda").timed >= 20 and "H200" in plan["estimate_basis"]
    assert gpu["measured_steps"] == 1 + gpu["timed_rounds"] + gpu["warmup_rounds"] and not gpu["interleaved"]
    assert plan["modes"]["cpu"]["interleaved"] and plan["modes"]["cpu"]["threads"] == 1


def test_stale_gradients_do_not_leak_into_the_next_candidate(setup):
    """A candidate that fails mid-backward (CUDA OOM) leaves .grad behind on the shared model;
    the next one must start from zero, not accumulate into it."""
    model, init, batches = setup
    clean = accumulation_updates.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    again = accumulation_updates.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    assert relative_l2(again["grad"], clean["grad"]) == 0.0 and again["losses"] == clean["losses"]


@pytest.mark.parametrize("together", [True, False])
def test_oom_in_one_candidate_is_its_failure(monkeypatch, together):
    real = harness.train_step

    def flaky(model, opt, batch, strategy, **kw):
        if strategy.micro_batches == 2:
            accumulation.accumulated_backward(model, batch, 2)  # leaves gradients behind, as a real OOM would
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, opt, batch, strategy, **kw)

    real_measure = experiment.measure
    monkeypatch.setattr(experiment, "config_for", lambda device, smoke=False: CFG)
    monkeypatch.setattr(harness, "train_step", flaky)
    monkeypatch.setattr(experiment, "measure", lambda *a, **kw: real_measure(*a, **kw, together=together))
    recs = {(r.metrics["seq"], r.candidate): r
            for r in experiment.run(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "cpu", "tiny-b2s16"))}
    for s in (8, 16):
        bad, ok = recs[s, "micro2"], recs[s, "micro4"]
        assert bad.failure.startswith("out of memory") and bad.decision is None and bad.peak_allocated is None
        assert bad.next_step.startswith("failed: out of memory") and bad.timing_noise is None
        assert bad.grad_error <= experiment.EQUIV_TOL["cpu"]  # its equivalence run still counts
        assert bad.updates == 2 * CFG.updates and bad.metrics["updates_by_run"]["measurement"] is None
        assert ok.failure is None and ok.peak_allocated > 0 and ok.metrics["time_ratio"] > 0
        assert ok.decision in ("accept", "tune") or ok.timing_noise


def test_the_decision_gates_on_the_gradient():
    assert experiment.decide(5e-5, experiment.EQUIV_TOL["cuda"], 0.5, 1.0).verdict == "accept"
    assert experiment.decide(5e-4, experiment.EQUIV_TOL["cuda"], 0.5, 1.0).reason == \
        "token-weighted gradient off the full batch by 5.00e-04 > EQUIV_TOL 0.0001"
    assert experiment.config_for("cuda").timed >= 20 and experiment.config_for("cpu").timed >= 20  # enough for a P95


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = registry.run(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "real_gpu", "tiny-b2s64"))
    assert len(recs) == 2 * len(experiment.CANDIDATES)
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.memory_source == "cuda-allocator" and r.failure is None
        assert r.peak_reserved >= r.peak_allocated > r.metrics["resident_bytes"] > 0
        if r.candidate != "plain":
            assert r.grad_error <= experiment.EQUIV_TOL["cuda"] and r.decision in ("accept", "tune")


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail


def test_accelerate_path_is_bitwise_the_hand_written_one(setup):
    """Chapter 11 and ``conformance``: Transformers' loss with ``num_items_in_batch`` and Accelerate's
    ``* k / k`` run the same float32 operations as ``accumulated_backward``: equal bits, not only close."""
    model, init, batches = setup
    for k in (2, 4):
        ours = accumulation_updates.train_updates(model, init, batches, k, "token", CFG, "cpu")
        ours_params = accumulation.snapshot(model.parameters())
        theirs = accumulation_framework.accelerate_updates(model, init, batches, k, CFG.lr)
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours["grad"]))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ours_params))
