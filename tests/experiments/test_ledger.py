"""TRAIN-STATE-LEDGER (Part 02 · 43), the experiment: the decision rule names the line that fails,
the run gives three valid records per strategy (CPU, and the CUDA branch with an out-of-memory
strategy), the dry-run plan, the conformance row against MemTracker, and the GPU records of the
chapters that own the strategies matched to the formula by name."""

import copy

import pytest
import torch

from bp_mech import ledger, state_bytes
from bp_mech.planner import lifecycle
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import ARCHITECTURES, parse_workload
from bp_mech.experiments import ledger as experiment
from tests.conftest import ALLOCATOR_CALLS

TINY = parse_workload("tiny-b2s64")


def test_a_line_off_by_more_than_its_tolerance_is_tune_with_the_line_named():
    """The decision uses both: a large line off by 10 % fails even where its stage total is within 5 %."""
    formula = ledger.theoretical(ARCHITECTURES[TINY.arch], TINY.batch, TINY.seq)
    measured = lifecycle.track(TINY)
    assert experiment.decide(formula, measured).record_fields() == dict(decision="accept", next_step=None)
    wrong = copy.deepcopy(formula)
    wrong.stages["zero_grad"]["optimizer_states"] = int(1.1 * formula.stages["zero_grad"]["optimizer_states"])
    wrong.stages["zero_grad"]["parameters"] -= wrong.stages["zero_grad"]["optimizer_states"] - \
        formula.stages["zero_grad"]["optimizer_states"]  # the stage total unchanged
    d, m = experiment.decide(wrong, measured), experiment.formula_errors(wrong, measured)
    assert abs(m["formula_error"]["zero_grad"]) < 1e-9 and d.verdict == "tune"
    assert m["worst_line"] in ("zero_grad/optimizer_states", "zero_grad/parameters") and m["worst_line"] in d.next_step
    assert f"line {m['worst_line']} is off by " in d.reason and d.reason.endswith("(CLASS_TOL 3%)")


def test_conformance_against_memtracker():
    row = experiment.conformance()
    assert row.passed, row.detail


def test_run_gives_three_valid_records_per_strategy(monkeypatch):
    from bp_mech.records import results
    from bp_mech.records.registry import make_context

    for name in ALLOCATOR_CALLS:  # a CPU run never touches torch.cuda
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} on a CPU run"))
    recs = experiment.run(make_context("TRAIN-STATE-LEDGER", mode="cpu"))
    assert len(recs) == 3 * len(experiment.CANDIDATES)
    for r in recs:
        results.validate(r.to_dict())
        assert r.failure is None and r.peak_allocated > 0
    levels = {r.candidate: (r.evidence_level, r.memory_source) for r in recs}
    assert levels["plain"] == ("cpu-mechanism", "tracked-cpu")
    assert levels["plain-estimated"] == ("estimated", "fake-tensor")
    assert levels["plain-formula"] == ("theoretical", "formula")
    by = {r.candidate: r for r in recs}
    for s in experiment.CANDIDATES:
        for r in (by[s], by[s + "-estimated"]):  # both sources: per stage and per large line
            assert (r.decision, r.next_step) == ("accept", None)
            assert max(abs(e) for e in r.metrics["formula_error"].values()) <= experiment.STAGE_TOL
            assert max(abs(e) for e in r.metrics["formula_class_error"].values()) <= experiment.CLASS_TOL
            assert "forward/optimizer_states" in r.metrics["formula_class_error"]
        assert by[s].updates == by[s + "-estimated"].updates == 2  # 1 warm-up + 1 measured optimizer step
        assert by[s + "-formula"].updates is None  # no step ran
        assert by[s].strategy == by[s + "-estimated"].strategy == by[s + "-formula"].strategy == s
    assert (by["fp16"].updates, by["fp16"].skipped_updates) == (2, 0)
    assert (by["plain"].updates, by["plain"].skipped_updates) == (2, None)


def test_gpu_run_reports_allocator_peaks_and_survives_an_oom(monkeypatch, fake_cuda):
    """run() on its CUDA branch (the measured step replaced by a CPU one with allocator readings):
    gpu-measured records with the allocator's peaks, memory freed before each strategy, estimates
    with the foreach AdamW, and an out-of-memory strategy recorded as its failure."""
    from bp_mech.records import registry, results

    real_env, real_track, calls = registry.environment_fields, lifecycle.track, []
    monkeypatch.setattr(registry, "environment_fields", lambda profile, device="cpu": dict(
        real_env(profile, "cpu"), cuda="13.0", device_name="NVIDIA H200", device_memory=150_000_000_000))

    def track(w, s, device="cpu", fake=False, options=StepOptions()):
        o = options.for_device(device)
        calls.append((s.name, (o.adamw, o.offload_min_bytes), str(device), fake))
        if fake:
            return real_track(w, s, fake=True, options=options)
        if s.offload:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        led = real_track(w, s, options=options)
        led.allocator = dict(forward=1, forward_peak=10, backward_peak=30, forward_reserved=40, backward_reserved=20)
        return led

    monkeypatch.setattr(lifecycle, "track", track)
    monkeypatch.setattr(experiment, "CANDIDATES", ("plain", "offload"))
    ctx = registry.make_context("TRAIN-STATE-LEDGER", "real_gpu", "tiny-b2s64")
    recs = {r.candidate: r for r in experiment.run(ctx)}
    plain = recs["plain"]
    assert (plain.evidence_level, plain.memory_source) == ("gpu-measured", "cuda-allocator")
    assert (plain.peak_allocated, plain.peak_reserved) == (30, 40)
    assert recs["offload"].failure.startswith("out of memory") and recs["offload-formula"].peak_allocated > 0
    assert (recs["plain-estimated"].evidence_level, recs["plain-estimated"].memory_source) == ("estimated",
                                                                                              "fake-tensor")
    assert {flavour for _, flavour, _, fake in calls} == {("fused", 2**20)}  # the GPU's, estimate included
    assert [dev for *_, dev, fake in calls if not fake] == ["cuda"] * len(experiment.CANDIDATES)
    assert fake_cuda.count("empty_cache") == len(experiment.CANDIDATES)
    for r in recs.values():
        results.validate(r.to_dict())


def test_dry_run_for_qwen05():
    from bp_mech.records import registry

    p = registry.dry_run(registry.make_context("TRAIN-STATE-LEDGER", "dry_run", "qwen05-b2s512"))
    assert p["candidates"] == list(experiment.CANDIDATES)
    assert (p["stage_tolerance"], p["class_tolerance"]) == (experiment.STAGE_TOL, experiment.CLASS_TOL)
    assert 8e9 < p["formula_peak_bytes_cuda"]["checkpoint-all"] < p["formula_peak_bytes_cuda"]["plain"] < 12e9


# --- the GPU records of 11, 19, 42 and AMP, matched by name (synthetic records) -----------

def _gpu_record(sid, candidate, peak, workload="qwen05-b2s512", run_label="gpu-synthetic", updates=24,
                strategy="same", **fields):
    """A GPU record as the GPU suite writes one, made up here (temporary directory only); its strategy is
    its candidate's name unless given."""
    from bp_mech.records import registry, results

    w = parse_workload(workload)
    fields = dict(dict(effective_batch=w.batch, input_shape=[w.batch, w.seq]), **fields)
    return results.Record(semantic_id=sid, workload_id=workload, run_label=run_label, page=registry.get(sid).page,
                          candidate=candidate, strategy=candidate if strategy == "same" else strategy,
                          model_id="Qwen/Qwen2.5-0.5B", model_commit="config-synthetic",
                          model_source="config", dtype="float32", seed=0, evidence_level="gpu-measured",
                          memory_source="cuda-allocator", cuda="12.8", device_name="synthetic",
                          peak_allocated=peak, updates=updates, **fields)


@pytest.fixture
def gpu_dir(tmp_path):
    return tmp_path


def _peak(name, batch=2, seq=512):
    return experiment.formula(ARCHITECTURES["qwen05"], batch, seq, parse(name), "cuda").peak


def test_gpu_records_are_matched_to_the_formula_by_their_strategy(gpu_dir):
    from bp_mech.records.results import save_record

    records = [_gpu_record("TRAIN-CHECKPOINT", "plain", int(_peak("plain") / 1.02)),
               _gpu_record("TRAIN-CHECKPOINT", "checkpoint-all", _peak("checkpoint-all")),
               _gpu_record("TRAIN-CHECKPOINT", "checkpoint-mlp", 7_000_000_000),
               _gpu_record("TRAIN-OFFLOAD", "offload", _peak("offload")),
               _gpu_record("TRAIN-OFFLOAD", "save_on_cpu", 5_000_000_000, strategy=None),
               _gpu_record("TRAIN-AMP-BACKWARD", "bf16", _peak("bf16")),
               _gpu_record("TRAIN-GRADIENT-ACCUMULATION", "micro2", _peak("micro2", 8, 256),
                           workload="qwen05-b2s256", run_label="gpu-default-s256", effective_batch=8,
                           input_shape=[4, 256])]
    for r in records:
        save_record(r, gpu_dir)
    rows = {(r["experiment"], r["candidate"]): r for r in experiment.gpu_references(gpu_dir)}
    assert len(rows) == len(records)
    plain = rows["TRAIN-CHECKPOINT", "plain"]
    assert plain["ledger"] == "plain, fused AdamW" and plain["formula_error"] == pytest.approx(0.02, abs=1e-6)
    assert rows["TRAIN-CHECKPOINT", "checkpoint-all"]["ledger"] == "checkpoint-all, fused AdamW"
    assert rows["TRAIN-OFFLOAD", "offload"]["ledger"] == "offload, fused AdamW"
    assert rows["TRAIN-AMP-BACKWARD", "bf16"]["ledger"] == "bf16, fused AdamW"
    acc = rows["TRAIN-GRADIENT-ACCUMULATION", "micro2"]  # the effective batch of 8 in 2 micro-batches of 4
    assert acc["ledger"] == "micro2, fused AdamW" and acc["formula_error"] == 0
    for k in [("TRAIN-CHECKPOINT", "checkpoint-all"), ("TRAIN-OFFLOAD", "offload"), ("TRAIN-AMP-BACKWARD", "bf16")]:
        assert rows[k]["formula_error"] == 0, rows[k]
    mlp = rows["TRAIN-CHECKPOINT", "checkpoint-mlp"]  # stated, not compared: the formula says why
    assert "every decoder layer or none" in mlp["note"] and mlp["formula_peak"] is None
    torch_arm = rows["TRAIN-OFFLOAD", "save_on_cpu"]
    assert "not one of the book's strategies" in torch_arm["note"] and torch_arm["formula_peak"] is None


def test_the_optimizer_state_is_counted_on_both_sides(gpu_dir):
    """The formula's peak holds AdamW's moments (2W + the fused step counters on the device); a GPU
    record counts them only if its step ran an update, so a record that ran none is refused."""
    from bp_mech.records.results import save_record

    a = ARCHITECTURES["qwen05"]
    n_tensors = 2 + a["num_hidden_layers"] * 12
    save_record(_gpu_record("TRAIN-CHECKPOINT", "plain", _peak("plain")), gpu_dir)
    (row,) = experiment.gpu_references(gpu_dir)
    assert row["formula_optimizer_states"] == 2 * state_bytes.param_bytes(a) + 4 * n_tensors and row["formula_error"] == 0
    save_record(_gpu_record("TRAIN-CHECKPOINT", "plain", _peak("plain") - row["formula_optimizer_states"], updates=0),
                gpu_dir)  # the same run without an update: its peak lacks the moments
    with pytest.raises(ValueError, match=r"TRAIN-CHECKPOINT record .*'plain'.*updates=0.*no optimizer state"):
        experiment.gpu_references(gpu_dir)


def test_no_gpu_record_no_rows(gpu_dir):
    assert experiment.gpu_references(gpu_dir) == []
