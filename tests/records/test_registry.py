import dataclasses

from bp_mech.records import provenance, registry, results
from bp_mech import ROOT

DESIGN_IDS = ["TRAIN-LOCAL-BACKWARD", "TRAIN-ATTENTION-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION",
              "TRAIN-SCHEDULER-CLOCK", "TRAIN-UPDATE-DYNAMICS", "TRAIN-CONTINUAL-PRETRAIN", "TRAIN-AMP-BACKWARD",
              "TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-STATE-LEDGER", "TRAIN-BASELINE",
              "TRAIN-PROFILING-DIAGNOSIS", "TRAIN-MEMORY-STRATEGY"]


def test_registry_holds_every_design_id():
    assert sorted(registry.EXPERIMENTS) == sorted(DESIGN_IDS)


def test_gpu_suite_runs_numeric_paths_first():
    order = [e.semantic_id for e in registry.EXPERIMENTS.values() if e.gpu]
    assert order[:4] == ["TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION", "TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"]


def test_status_is_computed_from_page_and_records(tmp_path):
    e = registry.get("TRAIN-LOCAL-BACKWARD")
    root = ROOT
    assert registry.status(e, root, tmp_path) == "CPU mechanism (no CPU record cached)"
    ctx = registry.make_context(e.semantic_id, "cpu", "tiny-b1s8")
    r = ctx.record("linear", all_finite=True)
    results.save_record(r, tmp_path)
    assert registry.status(e, root, tmp_path) == "complete CPU mechanism"
    results.save_record(dataclasses.replace(r, code_hash="stale"), tmp_path)  # same file, now stale
    assert registry.status(e, root, tmp_path) == "CPU mechanism (cached CPU records are stale: code changed since)"
    assert registry.status(e, tmp_path, tmp_path) == "in progress (no chapter yet)"


def test_gpu_status_names_cached_gpu_records(tmp_path):
    e = dataclasses.replace(registry.get("TRAIN-LOCAL-BACKWARD"), gpu=True)
    root = ROOT
    ctx = registry.make_context(e.semantic_id, "cpu", "tiny-b1s8")
    results.save_record(ctx.record("linear"), tmp_path)
    assert registry.status(e, root, tmp_path).endswith("no GPU record cached yet")
    gpu = dataclasses.replace(ctx.record("silu"), evidence_level="gpu-measured", cuda="12.8", device_name="H200",
                              memory_source="cuda-allocator", run_label="gpu-default")
    results.save_record(gpu, tmp_path)
    assert registry.status(e, root, tmp_path) == "complete CPU mechanism + GPU cached"


def test_a_record_carries_numerics_for_its_workload_and_no_invented_updates(cpu_only):
    from bp_mech.records import environment

    ctx = registry.make_context("TRAIN-LOCAL-BACKWARD", "cpu", "tiny-b2s64")
    r = ctx.record("linear")
    shape = environment.attention_shape(ctx.workload)
    assert shape == dict(batch=2, heads=4, kv_heads=2, seq=64, head_dim=16)
    assert r.numerics == environment.numerics("cpu", shape)
    assert r.numerics["sdpa_kernel"]["float32"] == environment.sdpa_kernel("cpu", dtype="float32", **shape)
    assert r.updates is None and r.skipped_updates is None  # 09 runs no optimizer
    assert r.git_commit == provenance.git_commit() and r.code_hash == provenance.code_hash("bp_mech.experiments.local_backward")
    results.validate(r.to_dict())  # without jsonschema, as on the GPU machine


def test_scheduler_records_count_applied_updates_and_skips_apart():
    """``updates`` = optimizer steps that ran; ``skipped_updates`` = calls that changed nothing."""
    from bp_mech.experiments.scheduler import ClockRun, run
    from bp_mech.scheduler import WSDConfig

    run_cfg = ClockRun(schedule=WSDConfig(warmup=1, stable=1, decay=1), overflow_calls=(1,), explicit_skip_calls=(3,))
    for r in run(registry.make_context("TRAIN-SCHEDULER-CLOCK", "cpu", "tiny-b1s8"), run_cfg):
        applied = r.metrics["applied_per_call"]
        assert len(applied) == 5 and applied == [True, False, True, False, True]
        assert (r.updates, r.skipped_updates) == (3, 2)


def test_the_chapter_map_points_at_files_that_exist():
    """chapter -> mechanism module -> experiment module -> exercise -> tests, for every implemented
    Part 02 experiment: the mechanism apart from its experiment, each with its files."""
    import importlib.util

    rows = {r["semantic_id"]: r for r in registry.chapter_map(ROOT)}
    for e in registry.EXPERIMENTS.values():
        if ".projects." in e.module:
            continue
        r = rows[e.semantic_id]
        assert r["experiment"].startswith("bp_mech.experiments.") and importlib.util.find_spec(r["mechanism"]), r
        assert (ROOT / r["chapter"]).exists() and r["exercise"] and r["tests"], r
        assert all((ROOT / f).exists() for f in r["exercise"] + r["tests"]), r
