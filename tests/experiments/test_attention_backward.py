"""Part 02 · 10, the experiment: its records validate (errors, saved bytes, the timing protocol, the
decisions), the decision rule, the dry-run plan for qwen05, and the conformance row."""

from bp_mech import attention_backward
from bp_mech.records import registry, results
from bp_mech.experiments import attention_backward as experiment
from bp_mech.bench.timing import CPU_TIMING_THREADS, SMOKE_SCHEDULE


def test_run_writes_valid_records(monkeypatch, tmp_path, cpu_only):
    monkeypatch.setattr(experiment, "SWEEP_T", (32, 64))
    ctx = registry.make_context("TRAIN-ATTENTION-BACKWARD", "cpu", "tiny-b1s48", smoke=True)  # SMOKE_SCHEDULE rounds
    recs = experiment.run(ctx)
    assert [r.candidate for r in recs] == list(experiment.CANDIDATES)
    by = {r.candidate: r for r in recs}
    timed, warmup = SMOKE_SCHEDULE
    for r in recs:
        results.validate(results.load_record(results.save_record(r, tmp_path)).to_dict())
        assert r.step_median_s > 0 and r.warmup_excluded == warmup and r.memory_source == "tracked-cpu"
        assert r.threads == CPU_TIMING_THREADS and len(r.metrics["step_samples_s"]) == r.metrics["timed_steps"] == timed
    for n in ("saved_probs", "recompute", "sdpa"):
        assert by[n].decision == "accept" and by[n].grad_error <= experiment.TOL64
    assert by["autograd"].decision is None and by["autograd"].grad_error is None
    assert by["recompute"].recompute_count == attention_backward.n_recomputed_tiles(48, 64) == 1
    assert by["saved_probs"].metrics["saved_ratio_vs_recompute"]["64"] > 1
    assert by["recompute"].metrics["saved_bytes"] == by["recompute"].metrics["saved_bytes_formula"]
    assert by["autograd"].metrics["backward_time_ratio_vs_autograd"] == 1.0


def test_decide_names_every_failed_check():
    tol64, tol32, tol_module, linear = experiment.TOL64, experiment.TOL32, experiment.TOL_MODULE, experiment.LINEAR_MAX
    ref = experiment.decide("autograd", 1.0, 1.0, None, 2.0)  # the reference
    assert ref.record_fields() == dict(decision=None, next_step=None) and "reference" in ref.reason
    assert experiment.decide("recompute", tol64, tol32, tol_module, linear).record_fields() == \
        dict(decision="accept", next_step=None)
    assert experiment.decide("saved_probs", 0.0, 0.0, 0.0, 2.0).verdict == "accept"  # claims no linear state
    d = experiment.decide("recompute", 2 * tol64, 0.0, 2 * tol_module, 2.0)
    assert d.verdict == "reject" and d.next_step.endswith("failed checks: float64, qwen2_module, linear_state")
    assert d.reason == "float64 error 2e-10 > TOL64 1e-10; layer error 2e-05 > TOL_MODULE 1e-05; saved bytes grow " \
        "as T^2.00 > T^LINEAR_MAX 1.1"
    assert experiment.decide("sdpa", 0.0, 2 * tol32, None, 1.0).reason == "float32 error 2e-05 > TOL32 1e-05"


def test_plan_for_qwen05():
    ctx = registry.make_context("TRAIN-ATTENTION-BACKWARD", "dry_run", "qwen05-b2s512")
    p = registry.dry_run(ctx)
    assert (p["attention"]["heads"], p["attention"]["kv_heads"], p["attention"]["head_dim"]) == (14, 2, 64)
    assert p["saved_bytes_formula_float32"]["saved_probs"] > p["saved_bytes_formula_float32"]["recompute"]
    assert p["rounds"]["real_gpu"]["timed_rounds"] >= 20  # at least 20 timed steps on the GPU


def test_conformance_row_passes():
    row = experiment.conformance()
    assert row.passed, row.detail
    assert row.semantic_id == "TRAIN-ATTENTION-BACKWARD"
