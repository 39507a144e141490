import dataclasses

from bp_mech import registry, results

DESIGN_IDS = ["TRAIN-LOCAL-BACKWARD", "TRAIN-ATTENTION-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION",
              "TRAIN-SCHEDULER-CLOCK", "TRAIN-UPDATE-DYNAMICS", "TRAIN-CONTINUAL-PRETRAIN", "TRAIN-AMP-BACKWARD",
              "TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-STATE-LEDGER", "TRAIN-BASELINE",
              "TRAIN-PROFILING-DIAGNOSIS", "TRAIN-MEMORY-STRATEGY"]


def test_registry_holds_every_design_id():
    assert sorted(registry.EXPERIMENTS) == sorted(DESIGN_IDS)


def test_gpu_suite_runs_numeric_paths_first():
    order = [e.semantic_id for e in registry.EXPERIMENTS.values() if e.gpu]
    assert order[:4] == ["TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION", "TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"]


def test_status_is_computed_from_module_page_and_records(tmp_path):
    e = registry.get("TRAIN-LOCAL-BACKWARD")
    root = registry.Path(__file__).resolve().parents[1]
    assert registry.status(e, root, tmp_path) == "CPU mechanism (no current CPU record cached)"
    ctx = registry.make_context(e.semantic_id, "cpu", "tiny-b1s8")
    r = ctx.record("linear", all_finite=True)
    results.save_record(r, tmp_path)
    assert registry.status(e, root, tmp_path) == "complete CPU mechanism"
    results.save_record(dataclasses.replace(r, code_hash="stale"), tmp_path)  # same file, now stale
    assert registry.status(e, root, tmp_path) == "CPU mechanism (no current CPU record cached)"
    assert registry.status(e, tmp_path, tmp_path) == "in progress (no chapter yet)"
    missing = dataclasses.replace(e, module="bp_mech.does_not_exist")
    assert registry.status(missing, root, tmp_path) == "planned"


def test_gpu_status_names_cached_gpu_records(tmp_path):
    e = dataclasses.replace(registry.get("TRAIN-LOCAL-BACKWARD"), gpu=True)
    root = registry.Path(__file__).resolve().parents[1]
    ctx = registry.make_context(e.semantic_id, "cpu", "tiny-b1s8")
    results.save_record(ctx.record("linear"), tmp_path)
    assert registry.status(e, root, tmp_path).endswith("no GPU record cached yet")
    gpu = dataclasses.replace(ctx.record("silu"), evidence_level="gpu-measured", cuda="12.8", device_name="H200",
                              memory_source="cuda-allocator", run_label="gpu-default")
    results.save_record(gpu, tmp_path)
    assert registry.status(e, root, tmp_path) == "complete CPU mechanism + GPU cached"
