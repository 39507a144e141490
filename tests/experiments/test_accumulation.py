"""Part 02 · 11, the experiment (``bp_mech.experiments.accumulation``): token-weighted accumulation
equals the full batch and the naive one does not (the equivalence run), the measurement (resident and
incremental peak, both paths), the decision rule, the records, an out-of-memory candidate, the
conformance check."""


import pytest
import torch

from bp_mech import accumulation
from bp_mech.records import registry, results
from bp_mech.book import report
from bp_mech.experiments import accumulation as experiment
from bp_mech.bench.workload import build_model, parse_workload

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
    assert all(failure is None for _, failure in out.values())
    full, four = out["full"][0], out["micro4"][0]
    n_params = sum(p.numel() for p in model.parameters())
    # float32 params + exp_avg + exp_avg_sq, plus one float32 `step` per parameter tensor
    assert full["resident_bytes"] == 3 * 4 * n_params + 4 * len(list(model.parameters()))
    for m, _ in out.values():
        assert m["stats"].peak_allocated - m["resident_bytes"] > 4 * n_params  # the incremental peak: grads at least
        assert m["stats"].memory_source == "tracked-cpu" and m["stats"].timing.warmup_excluded == CFG.warmup
        t = m["stats"].timing
        assert t.interleaved and t.threads == 1 and len(t.samples) == CFG.timed
        assert m["steps"] == 1 + CFG.warmup + CFG.timed  # tracked + warm-up + timed (the warm update comes before)
    assert four["stats"].peak_allocated < full["stats"].peak_allocated  # activations of 1/4 of the batch
    # the sequential (CUDA) path, run on the CPU: the same tracked peak, a function of the program
    seq = experiment.measure(model, init, batches, CFG, "cpu", interleave=False)
    for name, (m, _) in seq.items():
        assert m["stats"].peak_allocated == out[name][0]["stats"].peak_allocated
        assert m["resident_bytes"] == full["resident_bytes"] and m["steps"] == out[name][0]["steps"]
        assert not m["stats"].timing.interleaved and len(m["stats"].timing.samples) == CFG.timed


@pytest.mark.parametrize("diff,saving,time,noise,want", [
    (1e-3, 0.5, 1.0, None, "reject"), (None, 0.5, 1.0, None, "reject"), (1e-7, 0.15, 1.3, None, "accept"),
    (1e-7, 0.05, 1.1, None, "tune"), (1e-7, 0.5, 1.6, None, "tune"), (1e-7, None, None, None, None),
    (1e-7, -0.2, 1.0, None, "tune"),  # a higher peak
    (1e-3, 0.5, 1.0, "noise", "reject"),  # the gradient decides without the time
    (1e-7, 0.05, 0.8, "noise", "tune"),  # so does a peak that barely falls
    (1e-7, 0.5, 0.8, "noise", None), (1e-7, 0.5, 1.6, "noise", None)])  # the rest would need the time
def test_decision_rule(diff, saving, time, noise, want):
    decision, nxt = experiment.decide(diff, 1e-5, saving, time, noise)
    assert decision == want and nxt  # every outcome says what to do next
    if want is None and noise:
        assert "time ratio is noise (noise)" in nxt and "GPU" in nxt


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
        assert by_run["equivalence_token"] == CFG.updates == r.update_count
        assert by_run["equivalence_naive"] == (0 if r.candidate == "full" else CFG.updates)
        if r.candidate == "full":
            assert r.timing_noise is None and r.decision is None
            continue
        assert r.grad_error <= 1e-5 and r.metrics["naive"]["grad_rel_diff"] > 1e-3
        m = r.metrics
        if m["time_ratio"] < 1.0:  # more passes, measured faster: noise, whatever the spread
            assert r.timing_noise and "strictly more work" in r.timing_noise
        assert m["peak_saving"] == 1 - r.peak_allocated / next(
            x for x in recs if x.candidate == "full" and x.workload_id == r.workload_id).peak_allocated
        want = experiment.decide(r.grad_error, 1e-5, m["peak_saving"], m["time_ratio"], r.timing_noise)
        assert (r.decision, r.next_step) == want
    c = report.cached("TRAIN-GRADIENT-ACCUMULATION", tmp_path)
    assert sorted(c.groups) == ["cpu-default-s16", "cpu-default-s8"]
    monkeypatch.undo()  # the plan of the real configs
    plan = registry.plan(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "dry_run", "qwen05-b2s256"))
    gpu = plan["modes"]["real_gpu"]
    assert plan["workloads"] == ["qwen05-b2s128", "qwen05-b2s256"] and gpu["estimated_seconds"] < 75
    assert gpu["timed_rounds"] == experiment.config_for("cuda").timed >= 20 and "H200" in plan["estimate_basis"]
    assert gpu["measured_steps"] == gpu["timed_rounds"] + gpu["warmup_rounds"] and not gpu["interleaved"]
    assert plan["modes"]["cpu"]["interleaved"] and plan["modes"]["cpu"]["threads"] == 1


def test_stale_gradients_do_not_leak_into_the_next_candidate(setup):
    """A candidate that fails mid-backward (CUDA OOM) leaves .grad behind on the shared model;
    the next one must start from zero, not accumulate into it."""
    model, init, batches = setup
    clean = experiment.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    again = experiment.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    assert experiment.rel_diff(again["grad"], clean["grad"]) == 0.0 and again["losses"] == clean["losses"]


@pytest.mark.parametrize("interleave", [True, False])
def test_oom_in_one_candidate_is_its_failure(monkeypatch, interleave):
    real = experiment.prepare_candidate

    def flaky(model, init, batches, k, cfg, device):
        if k == 2:
            accumulation.accumulated_backward(model, batches[0], k)  # leaves gradients behind, as a real OOM would
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, init, batches, k, cfg, device)

    real_measure = experiment.measure
    monkeypatch.setattr(experiment, "config_for", lambda device, smoke=False: CFG)
    monkeypatch.setattr(experiment, "prepare_candidate", flaky)
    monkeypatch.setattr(experiment, "measure", lambda *a, **kw: real_measure(*a, **kw, interleave=interleave))
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
    assert experiment.decide(5e-5, experiment.EQUIV_TOL["cuda"], 0.5, 1.0)[0] == "accept"
    assert experiment.decide(5e-4, experiment.EQUIV_TOL["cuda"], 0.5, 1.0)[0] == "reject"
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
        if r.candidate != "full":
            assert r.grad_error <= experiment.EQUIV_TOL["cuda"] and r.decision in ("accept", "tune")


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail
