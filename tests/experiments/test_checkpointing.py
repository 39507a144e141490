"""Part 02 · 19, the experiment: its records validate (recomputes counted, equality, peaks, decisions);
an out-of-memory candidate is its failure; a NaN is never equal; the dry run estimates the GPU run; the
reference run's figures (RTX 5070 Ti, Qwen2.5-0.5B) give its decision; the conformance check passes."""

import math

import torch

from bp_mech.bench.compare import EXACT_TOL, compare
from bp_mech.bench.oom import Failed
from bp_mech.bench.rates import ASSUMED_BUILD_S
from bp_mech.bench.step import Probe
from bp_mech.bench.timing import Timing
from bp_mech.instruments.peak import Peak
from bp_mech.instruments.workload import parse_workload
from bp_mech.experiments import checkpointing as experiment
from bp_mech.experiments import decision, dry_run, harness
from bp_mech.records import references, registry
from bp_mech.records.results import load_record, save_record


def test_decide_rule_and_the_course_reference():
    s = references.REFERENCES["TRAIN-CHECKPOINT"]  # the reference run's figures, in one place
    assert s.strategy == "checkpoint-all" and references.for_strategy("checkpoint-all") is s
    assert decision.decide(True, s.peak_saving, s.median_ratio).verdict == s.decision == "accept"
    assert decision.decide(False, 0.5, 1.0).verdict == "reject"
    assert decision.decide(True, 0.01, 1.0).verdict == "reject"
    assert decision.decide(True, 0.08, 1.1).verdict == "tune"  # between MIN_USEFUL_SAVING and MIN_PEAK_SAVING
    assert decision.decide(True, 0.40, 3.0).verdict == "tune"


def test_run_writes_valid_records(tmp_path, cpu_only):
    ctx = registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32")
    recs = experiment.run(ctx)
    assert [r.candidate for r in recs] == [r.strategy for r in recs] == list(experiment.CANDIDATES)
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    assert by["plain"].decision is None and by["plain"].recompute_count == 0
    L = len(by["plain"].metrics["forward_calls"]["layer"])
    assert by["checkpoint-all"].recompute_count == 2 * L
    for name in experiment.CANDIDATES[1:]:
        r = by[name]
        assert r.output_error == 0.0 and r.grad_error == 0.0 and r.metrics["bitwise_equal"] and r.metrics["equal"]
        assert r.memory_source == "tracked-cpu" and r.evidence_level == "cpu-mechanism" and r.all_finite
        assert r.peak_allocated < by["plain"].peak_allocated  # tracked storages: deterministic
        assert r.metrics["saved_activation_bytes"] < by["plain"].metrics["saved_activation_bytes"]
        assert r.decision in ("accept", "tune", "reject")
        assert r.warmup_excluded == dry_run.schedule("cpu")[1] and r.threads == 1 and r.step_clock == "thread_time"
        assert r.wall_median_s > 0 and len(r.metrics["wall_samples_s"]) == len(r.metrics["step_samples_s"])
        assert r.updates == sum(dry_run.schedule("cpu")) + 1 and r.skipped_updates == 0  # tracked + warm-up + timed
        assert r.metrics["more_work"] == (name != "plain")  # every candidate recomputes


def test_an_out_of_memory_candidate_is_its_failure_and_the_run_goes_on(tmp_path, cpu_only, monkeypatch):
    real, seen = harness.train_step, []

    def oom_under_checkpoint_all(model, *a, **k):  # fails inside the candidate's configuration
        seen.append(model)
        if all(layer.gradient_checkpointing for layer in model.model.layers):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, *a, **k)

    monkeypatch.setattr(harness, "train_step", oom_under_checkpoint_all)
    recs = experiment.run(registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32"))
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    failed = by["checkpoint-all"]
    assert failed.failure.startswith("out of memory") and failed.peak_allocated is None and failed.decision is None
    assert all(by[n].failure is None and by[n].metrics["bitwise_equal"] for n in ("checkpoint-every2", "checkpoint-mlp"))
    assert not any(layer.gradient_checkpointing for layer in seen[0].model.layers)  # the configuration was undone


def _probe(loss, grads, finite=True):
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    return Probe(loss, grads, norm, finite, {}, 0, 0, 0, 0)


def _measured(name, p, base=None, peak=100, median=1.0):
    """A measured arm as ``harness.same_weights`` gives it, with ``p`` its probe and ``base`` the plain one."""
    t = Timing([median] * 4, [median] * 4, 2, "thread_time", 1, True)
    cmp = compare(base, p) if base is not None else None
    equal = p.finite if base is None else p.finite and base.finite and cmp.within(EXACT_TOL["cpu"])
    return harness.Measured(name, t, Peak(peak, None, "tracked-cpu"), 10, 5, 0, [True] * 5, p, cmp, equal,
                            strategy=experiment.ARMS[name])


def test_a_nan_gradient_is_never_equal_and_the_record_still_saves(tmp_path, cpu_only):
    """A race that leaves a gradient NaN must be rejected (``max(0.0, nan)`` is 0.0 in Python, so a
    naive running max passes it), and NaN must not make the record unsavable (strict JSON)."""
    g = [torch.ones(3), torch.ones(2)]
    bad = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    c = compare(_probe(1.0, g), _probe(1.0, bad, finite=False))
    assert c.grad_error == math.inf and not c.bitwise and c.loss_error == 0.0 and not c.within((1.0, 1.0))
    assert compare(_probe(1.0, g), _probe(float("nan"), g, finite=False)).loss_error == math.inf
    ctx = registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32")
    plain = _probe(1.0, g)
    results = {"plain": _measured("plain", plain),
               "checkpoint-all": _measured("checkpoint-all", _probe(1.0, bad, finite=False), plain, peak=50),
               "checkpoint-every2": _measured("checkpoint-every2", _probe(1.0, [x * (1 + 1e-3) for x in g]), plain,
                                              peak=50),
               "checkpoint-mlp": Failed("out of memory: CUDA out of memory", "checkpoint-mlp")}
    recs = decision.strategy_records(ctx, results, experiment.ARMS)
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    nan = by["checkpoint-all"]
    assert nan.decision == "reject" and not nan.all_finite and nan.grad_error is None and not nan.metrics["equal"]
    assert nan.metrics["grad_norm"] is None  # stored as null, not NaN
    assert by["checkpoint-every2"].decision == "reject" and by["checkpoint-every2"].grad_error > EXACT_TOL["cpu"][1]
    assert by["checkpoint-mlp"].failure and by["plain"].decision is None


def test_the_dry_run_estimates_the_gpu_run_within_three_minutes_with_offload():
    total = 0
    for sid in ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"):
        dr = registry.dry_run(registry.make_context(sid, "dry_run", "qwen05-b2s512"))
        gpu = dr["modes"]["real_gpu"]
        assert gpu["timed_rounds"] >= 20 and gpu["warmup_rounds"] >= 1 and gpu["interleaved"]
        total += gpu["estimated_seconds"]
    assert 60 <= total <= 180


def test_the_estimate_scales_with_the_workload():
    w = parse_workload("qwen05-b2s512")
    one = dry_run.same_weights_seconds(w, [1.0], "cuda")
    assert dry_run.same_weights_seconds(parse_workload("qwen05-b2s1024"), [1.0], "cuda") > one + 1
    assert dry_run.same_weights_seconds(w, [1.0, 2.0], "cuda") > 2 * one - ASSUMED_BUILD_S["cuda"]
    assert dry_run.same_weights_seconds(w, [1.0], "cpu") > 10 * one  # qwen05 on 2 CPU cores: estimated, and slow


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail


def test_step_work_counts_the_recompute_as_the_layers_forward_flops():
    """The extra FLOPs of checkpoint-all are the decoder layers' forward FLOPs, counted apart on a
    plain forward, when the recompute runs to the end of each layer; by default (early stop) it
    stops once the saved tensors are rebuilt, so it does less."""
    import torch.utils.checkpoint as tuc
    from torch.utils.flop_counter import FlopCounterMode

    from bp_mech.instruments.workload import build_model, make_batches

    with tuc.set_checkpoint_early_stop(False):
        full = experiment.step_work("tiny-b2s32")
    work = experiment.step_work("tiny-b2s32")
    w = parse_workload("tiny-b2s32")
    model, batch = build_model(w), make_batches(w, 1)[0]
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch)
    counts = counter.get_flop_counts()
    layers = sum(sum(counts[f"Qwen2ForCausalLM.model.layers.{i}"].values())
                 for i in range(len(model.model.layers)))
    assert full["checkpoint-all"].flops - full["plain"].flops == layers > 0
    assert 0 < work["checkpoint-all"].flops - work["plain"].flops < layers
    assert work["checkpoint-all"].operators > work["plain"].operators > 0


def test_matmul_rate_is_twice_n_cubed_over_the_time():
    rate = experiment.matmul_rate(64, repeats=5)
    assert 1e7 < rate < 1e13  # a CPU thread: tens of MFLOP/s to a few TFLOP/s
