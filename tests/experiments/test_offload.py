"""Part 02 · 42, the experiment: the counting pass, the candidates' hooks, the link metrics; its records
validate (equality, D2H = the independent count, peaks, transfer bound); the course's reference run
(RTX 5070 Ti, Qwen2.5-0.5B) gives its decision; the conformance check passes."""

import pytest
import torch

from bp_mech import offload
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import Entered
from bp_mech.experiments import decision
from bp_mech.experiments import offload as experiment
from bp_mech.records import references, registry
from bp_mech.records.results import load_record, save_record


def test_count_saved_counts_storages_once_and_less_under_checkpointing(tiny):
    model, batches = tiny
    plain, checkpointed = (experiment.count_saved(model, batches[0], c) for c in ("plain", "checkpoint-all"))
    assert 0 < checkpointed.bytes < plain.bytes < plain.tensor_bytes  # views and parameters: once / not at all
    assert plain.param_saves > 0 and plain.tensors > len(plain.storages)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)  # configuration undone


def test_make_hooks_and_hook_stats(tiny):
    model, batches = tiny
    cfg = offload.OffloadConfig(min_bytes=offload.CPU_MIN_BYTES)
    hooks = {name: experiment.make_hooks(name, model, cfg, "cpu") for name in experiment.CANDIDATES[1:]}
    assert isinstance(hooks["save_on_cpu"], offload.CountingSaveOnCpu)
    assert all(isinstance(hooks[n], offload.ActivationOffload) for n in ("offload", "checkpoint-all+offload"))
    s = experiment.ARMS["offload"]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(model, opt, batches[0], s, entered=Entered(model, s, "cpu", hooks=hooks["offload"]))
    stats = experiment.hook_stats(hooks["offload"])
    assert stats["d2h"] == hooks["offload"].d2h_bytes > 0 and stats["host_pool_bytes"] == stats["d2h"]
    assert stats["pool_allocations"] == len(hooks["offload"]._order)


def test_run_writes_valid_records(tmp_path, cpu_only):
    ctx = registry.make_context("TRAIN-OFFLOAD", "cpu", "tiny-b2s32")
    bw = {"h2d": 2.0e10, "d2h": 1.5e10}  # stands for measure_bandwidth: the GPU-only metrics, on the CPU
    recs = experiment.run(ctx, bandwidth=bw)
    assert [r.candidate for r in recs] == list(experiment.CANDIDATES)
    assert [r.strategy for r in recs] == ["plain", None, "offload", "checkpoint-all+offload"]  # save_on_cpu: torch's
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    assert by["plain"].transfer_bytes is None and by["plain"].decision is None
    for name in experiment.CANDIDATES[1:]:
        r = by[name]
        assert r.output_error == 0.0 and r.grad_error == 0.0 and r.metrics["bitwise_equal"] and r.all_finite
        assert r.metrics["d2h_matches_count"] and r.transfer_bytes["d2h"] == r.metrics["expected_d2h_bytes"]
        assert r.peak_allocated < by["plain"].peak_allocated
        assert r.metrics["held_after_forward_bytes"] < by["plain"].metrics["held_after_forward_bytes"]
        t = r.transfer_bytes
        assert r.metrics["transfer_bound_s"] == pytest.approx(t["d2h"] / bw["d2h"] + t["h2d"] / bw["h2d"])
    assert by["offload"].transfer_bytes["d2h"] < by["save_on_cpu"].transfer_bytes["d2h"]
    assert by["checkpoint-all+offload"].transfer_bytes["d2h"] < by["offload"].transfer_bytes["d2h"]


def test_link_metrics():
    m = experiment.link_metrics(3 * 10**9, 2 * 10**9, {"d2h": 1e9, "h2d": 2e9}, median_s=5.0, base_median_s=1.0)
    assert m["transfer_bound_s"] == 4.0 and m["overhead_s"] == 4.0 and m["overhead_over_bound"] == 1.0
    assert m["implementation_s"] == 0.0
    hidden = experiment.link_metrics(10**9, 10**9, {"d2h": 1e9, "h2d": 1e9}, median_s=1.5, base_median_s=1.0)
    assert hidden["overhead_over_bound"] == 0.25 and hidden["implementation_s"] == 0.0  # copies hidden
    slow = experiment.link_metrics(10**9, 0, {"d2h": 1e9, "h2d": 1e9}, median_s=4.0, base_median_s=1.0)
    assert slow["implementation_s"] == 2.0
    assert experiment.link_metrics(0, 0, {"d2h": 1e9, "h2d": 1e9}, 1.0, 1.0)["overhead_over_bound"] is None


def test_the_course_reference_gives_its_own_decision():
    s = references.REFERENCES["TRAIN-OFFLOAD"]  # the reference run's figures, in one place
    assert decision.decide(True, s.peak_saving, s.median_ratio).verdict == s.decision == "tune"


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail
