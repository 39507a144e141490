"""Project 73 (``bp_mech.projects.baseline``, ``baseline_loop``, ``baseline_loss``): the cross-process
token-weighted loss, a real ``accelerate launch`` with two CPU processes (gloo) against one process,
the naive per-rank mean, reproducibility, the update clock, records, the plan, and the exercise
checks' mutants."""

import dataclasses
import json
import math
import sys

import pytest
import torch

from bp_mech.records import environment, registry, results
from bp_mech.bench.timing import timing_threads
from bp_mech.bench.compare import relative_l2
from bp_mech.projects import baseline, baseline_loop, baseline_loss
from bp_mech import accumulation
from bp_mech.projects.baseline_loop import LoopConfig
from bp_mech.scheduler import wsd_lr
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.checks import ex73

W = parse_workload("tiny-b2s32")
# short runs: 8 updates, snapshots after 4; the 2-process run then repeats those 4 with per-rank means
CFG = LoopConfig(workload=dataclasses.asdict(W), global_batch=4, updates=8, warmup=2, decay=3, naive_updates=4,
                 holdout_batches=2, save_tensors=True)


def _uneven(seed=0, k=2, G=4):
    """k micro-batches of G rows, right-padded so that ranks hold different numbers of target tokens."""
    return baseline_loop.train_batches(W.replace(seed=seed), dataclasses.replace(CFG, updates=1, accumulation=k,
                                                                               global_batch=G))


# --- the mechanism, from scratch (threads for the ranks) --------------------------------------

def test_simulated_ranks_reproduce_the_full_batch_and_the_per_rank_mean_does_not():
    """float64: P ranks x b rows with the loss divisor N / P = 1 process x P b rows, to rounding."""
    model = build_model(W).double()
    micro = _uneven(k=2, G=4)
    counts = [[int(accumulation.count_targets(baseline_loss.shard_rows(mb, r, 2)["labels"])) for mb in micro]
              for r in range(2)]
    assert sum(counts[0]) != sum(counts[1])  # the ranks hold different numbers of target tokens
    with timing_threads("cpu"):  # one intra-op thread (a second one only waits on a shared 2-core machine)
        loss1, g1 = baseline_loss.simulate_ranks(model, micro, 1)
        loss2, g2 = baseline_loss.simulate_ranks(model, micro, 2)
        _, naive = baseline_loss.simulate_ranks(model, micro, 2, baseline_loss.per_rank_divisor)
    assert abs(loss2 - loss1).item() <= 1e-14 * loss1.item()
    assert relative_l2(g2, g1) <= 1e-13  # float64 rounding
    assert relative_l2(naive, g1) > 1e-4  # the per-rank mean weighs the rank with fewer tokens more


def test_divisors_run_one_all_reduce_per_rank_and_raise_what_a_rank_raises():
    counts = [[torch.tensor(3), torch.tensor(4)], [torch.tensor(10), torch.tensor(1)], [torch.tensor(0)]]
    assert [d.item() for d in baseline_loss.divisors(counts)] == [6.0] * 3
    assert [d.item() for d in baseline_loss.divisors(counts, baseline_loss.per_rank_divisor)] == [7.0, 11.0, 0.0]

    def broken(c, P, all_reduce):
        raise KeyError("rank failure")

    with pytest.raises(KeyError):
        baseline_loss.divisors(counts, broken)


def test_shard_rows_errors():
    b = {"x": torch.arange(6)}
    assert baseline_loss.shard_rows(b, 1, 3)["x"].tolist() == [2, 3]
    for rank, P in ((0, 4), (3, 3), (0, 0)):
        with pytest.raises(ValueError):
            baseline_loss.shard_rows(b, rank, P)


# --- the loop on Accelerate: one process in this process, two under accelerate launch ------------

@pytest.fixture(scope="module")
def one_process():
    return baseline_loop.train(CFG)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """A real ``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo), the CLI's command."""
    return baseline.launch(CFG, 2, tmp_path_factory.mktemp("launch2"))


def test_two_runs_with_the_same_seed_reproduce_the_cpu_losses_exactly(one_process):
    again = baseline_loop.train(CFG)
    assert again["run"]["loss"] == one_process["run"]["loss"]
    assert again["holdout_after"] == one_process["holdout_after"]
    assert all(torch.equal(a, b) for a, b in zip(again["tensors"]["params"], one_process["tensors"]["params"]))


def test_the_loop_counts_tokens_clips_and_steps_the_clock(one_process):
    run = one_process["run"]
    assert one_process["processes"] == 1 and one_process["threads"] == 1 and one_process["backend"] is None
    want_tokens = [int(sum(accumulation.count_targets(b["labels"]) for b in pair))
                   for pair in zip(*[iter(baseline_loop.train_batches(W, CFG))] * CFG.accumulation)]
    assert run["target_tokens"] == want_tokens
    for norm, coef in zip(run["grad_norm"], run["clip_coef"]):
        assert coef == pytest.approx(min(1.0, CFG.max_norm / (norm + 1e-6)), rel=1e-6)
    assert run["lr"] == [wsd_lr(u, CFG.wsd()) for u in range(CFG.updates)]  # no skips: the clock counts every update
    assert run["updates"] == CFG.updates and run["skipped"] == 0 and all(run["applied"])
    assert one_process["holdout_after"] < one_process["holdout_before"]
    assert one_process["peak_by_rank"][0] > 0


def test_a_skipped_step_does_not_advance_the_clock(monkeypatch):
    """``accelerator.optimizer_step_was_skipped`` (a GradScaler skip on fp16 GPUs) holds the WSD clock."""
    from accelerate import Accelerator

    calls = []

    def skipped(self):
        calls.append(1)
        return len(calls) == 2  # the second update is skipped

    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(skipped))
    cfg = dataclasses.replace(CFG, updates=4, warmup=3, decay=0, save_tensors=False, naive_updates=0)
    run = baseline_loop.train(cfg)["run"]
    assert run["applied"] == [True, False, True, True] and run["updates"] == 3 and run["skipped"] == 1
    assert run["lr"] == [wsd_lr(u, cfg.wsd()) for u in (0, 1, 1, 2)]  # the skipped update left the clock at 1


def test_two_processes_reproduce_one_process_and_the_naive_per_rank_mean_does_not(one_process, two_processes):
    r = two_processes
    assert (r["processes"], r["distributed_type"], r["backend"], r["per_process_rows"]) == (
        2, "DistributedType.MULTI_CPU", "gloo", CFG.global_batch // 2)
    assert len(r["seconds_by_rank"]) == 2 and r["threads"] == 1
    assert r["run"]["target_tokens"] == one_process["run"]["target_tokens"]
    eq = baseline.compare(one_process, r)
    assert eq["grad_rel_diff"] <= baseline.GRAD_TOL
    assert eq["loss_rel_diff"] <= baseline.LOSS_TOL
    assert eq["param_rel_diff_early"] <= baseline.PARAM_TOL and eq["param_rel_diff"] <= baseline.PARAM_TOL
    assert baseline.equal(eq) is True
    assert abs(r["holdout_before"] - one_process["holdout_before"]) <= 1e-6 * one_process["holdout_before"]
    naive = eq["naive"]
    assert naive["grad_rel_diff"] > 10 * baseline.GRAD_TOL and naive["param_rel_diff_early"] > 10 * baseline.PARAM_TOL
    assert baseline.equal(eq, naive=True) is False


def test_records_validate_and_say_how_many_processes(one_process, two_processes, cpu_only):
    ctx = registry.make_context("TRAIN-BASELINE", "cpu", W)
    ref = dict(one_process, command="in-process")
    recs = [baseline.candidate_record(ctx, "plain", CFG, ref, ref),
            baseline.candidate_record(ctx, "2-processes", CFG, two_processes, ref)]
    for rec in recs:
        results.validate(rec.to_dict())
        assert rec.decision == "accept" and rec.all_finite and rec.metrics["updates_by_run"]["training"] == CFG.updates
        m = rec.metrics
        timed = slice(CFG.warmup_excluded, None)
        res = ref if rec.candidate == "plain" else two_processes
        assert m["tokens_per_s"] == pytest.approx(sum(m["curve"]["target_tokens"][timed]) / sum(res["seconds"][timed]))
        assert rec.warmup_excluded == CFG.warmup_excluded and len(m["step_samples_s"]) == CFG.updates - 2
        assert rec.step_clock == "thread_time" and m["step_samples_s"] == res["cpu_seconds"][timed]
        assert m["wall_samples_s"] == res["seconds"][timed] and rec.strategy == "plain"
    assert [r.metrics["processes"] for r in recs] == [1, 2]
    assert [r.input_shape for r in recs] == [[4, W.seq], [2, W.seq]] and {r.effective_batch for r in recs} == {8}
    assert recs[1].updates == CFG.updates + CFG.naive_updates and recs[1].metrics["naive_equal"] is False
    assert recs[1].output_error <= baseline.LOSS_TOL and recs[1].grad_error <= baseline.GRAD_TOL


def test_decision_rule():
    assert baseline.decide(True, 5.0, 3.0, 2, (0.0, 0.0, 0.0)).verdict == "accept"
    d = baseline.decide(True, 5.0, 3.0, 2, (1e-3, 0.0, math.nan))
    assert d.verdict == "reject" and d.reason == ("2 processes do not reproduce 1 process: first gradient 0.001 > "
                                                  "GRAD_TOL 1e-05; parameters nan > PARAM_TOL 0.0001")
    assert baseline.decide(False, 5.0, 3.0).verdict == "reject"
    assert baseline.decide(True, 5.0, 5.0).reason == "the holdout loss did not fall (5.0000 -> 5.0000)"
    assert baseline.decide(True, 5.0, math.nan).verdict == "tune"
    eq_ok = dict(grad_rel_diff=0.0, loss_rel_diff=0.0, param_rel_diff=0.0, param_rel_diff_early=0.0)
    assert baseline.equal(eq_ok) is True and baseline.equal(dict(eq_ok, loss_rel_diff=2e-5)) is False


# --- launching, the GPU path, the plan -------------------------------------------------------

def test_launch_commands():
    one = baseline.launch_command(1, CFG, "c.json", "out")
    two = baseline.launch_command(2, CFG, "c.json", "out")
    assert one[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and "--multi_gpu" not in one
    assert two[two.index("--num_processes") + 1] == "2" and "--multi_gpu" in two
    assert two[two.index("--main_process_port") + 1] == "0"  # a free port: parallel runs do not collide
    assert two[-6:] == ["-m", "bp_mech.projects.baseline_loop", "--config", "c.json", "--out", "out"]


def test_a_failed_launch_is_one_error_with_the_log(monkeypatch, tmp_path):
    monkeypatch.setattr(baseline, "launch_command",
                        lambda *a: [sys.executable, "-c", "import sys; print('worker says no'); sys.exit(3)"])
    with pytest.raises(baseline.LaunchError, match="exited with 3(.|\n)*worker says no"):
        baseline.launch(CFG, 2, tmp_path)


def test_gpu_runs_the_candidates_the_visible_gpus_hold(monkeypatch):
    """real_gpu on one GPU: only the 1-process candidate, fp16, no tensors; its record says 1 process."""
    launched = []

    def fake_launch(cfg, processes, workdir):
        launched.append((processes, cfg.mixed_precision, cfg.save_tensors, cfg.device))
        ok = dict(loss=[11.0, 10.0, 9.0], target_tokens=[100] * 3, lr=[0.0] * 3, grad_norm=[1.0, math.inf, 1.0],
                  clip_coef=[1.0] * 3, applied=[True, False, True], updates=2, skipped=1, peak=5)
        return dict(processes=processes, distributed_type="DistributedType.NO", backend=None, device="cuda:0",
                    mixed_precision=cfg.mixed_precision, threads=None, holdout_before=11.0, holdout_after=9.5,
                    per_process_rows=4, seconds=[0.2, 0.1, 0.1], cpu_seconds=[0.01] * 3,
                    seconds_by_rank=[[0.2, 0.1, 0.1]], peak_by_rank=[5],
                    run=ok, naive=None, tensors=None, command="accelerate launch ...")

    monkeypatch.setattr(baseline, "launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(baseline, "config_for", lambda w, d, s=False: dataclasses.replace(
        CFG, updates=3, warmup_excluded=1, device="cuda", mixed_precision="fp16", save_tensors=False))
    monkeypatch.setattr(registry, "environment_fields", lambda p, d: environment.environment_fields(p, "cpu"))
    monkeypatch.setattr(registry, "numerics", lambda d, a: {})
    recs = baseline.run(registry.make_context("TRAIN-BASELINE", "real_gpu", W))
    assert launched == [(1, "fp16", False, "cuda")]
    (rec,) = recs
    assert rec.candidate == "plain" and rec.metrics["processes"] == 1 and rec.evidence_level == "gpu-measured"
    assert rec.updates == 2 and rec.skipped_updates == 1 and rec.decision == "accept"
    assert rec.step_clock == "wall" and rec.step_median_s == 0.1  # CUDA: the wall time decides
    assert rec.output_error is None and rec.metrics["equivalence"] is None
    assert rec.all_finite and rec.metrics["curve"]["grad_norm"] == [1.0, None, 1.0]  # the skipped step's inf norm
    json.dumps(rec.to_dict(), allow_nan=False)  # records are strict JSON


def test_config_for_each_device():
    cpu, gpu = baseline.config_for(W, "cpu"), baseline.config_for(parse_workload("qwen05-b2s512"), "cuda")
    assert (cpu.mixed_precision, cpu.save_tensors, cpu.global_batch, cpu.naive_updates > 0) == ("no", True, 4, True)
    assert (gpu.mixed_precision, gpu.save_tensors, gpu.device, gpu.naive_updates) == ("fp16", False, "cuda", 0)


def test_the_dry_run_touches_no_model(monkeypatch):
    monkeypatch.setattr(baseline_loop, "build_model", lambda *a, **k: pytest.fail("dry_run built a model"))
    ctx = registry.make_context("TRAIN-BASELINE", "dry_run", "qwen05-b2s512")
    p = registry.dry_run(ctx)
    assert p["candidates"] == list(baseline.CANDIDATES)
    assert p["modes"]["cpu"]["candidates"] == list(baseline.CANDIDATES)
    assert p["modes"]["real_gpu"]["candidates"] == ["plain"]
    assert "--multi_gpu" in p["modes"]["cpu"]["commands"][1] and p["modes"]["real_gpu"]["mixed_precision"] == "fp16"
    assert 10 < p["modes"]["real_gpu"]["estimated_seconds"] < 120  # ~30 s on one H200


# --- mutants: the checks of exercises/ex73_baseline.py catch the classic mistakes ---------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex73_baseline", **over)


def test_check_rejects_the_per_rank_mean():
    bad = _solution(loss_divisor=lambda counts, P, all_reduce: torch.stack(list(counts)).sum().double())
    with pytest.raises(AssertionError, match="loss_divisor"):
        ex73.check_loss_divisor(bad)


def test_check_rejects_a_divisor_without_the_world_size():
    bad = _solution(loss_divisor=lambda counts, P, all_reduce: all_reduce(torch.stack(list(counts)).sum()).double())
    with pytest.raises(AssertionError, match="loss_divisor"):
        ex73.check_loss_divisor(bad)
    with pytest.raises(AssertionError, match="D per rank.* differs from N / P"):
        ex73.check_loss_divisor(bad)


def test_check_rejects_interleaved_rows_and_a_silent_uneven_split():
    interleaved = _solution(shard_rows=lambda b, r, P: {k: v[r::P] for k, v in b.items()})
    with pytest.raises(AssertionError, match="split_batches"):
        ex73.check_shard_rows(interleaved)
    chunked = _solution(shard_rows=lambda b, r, P: {k: torch.chunk(v, P)[r] for k, v in b.items()})
    with pytest.raises(AssertionError, match="expected ValueError"):
        ex73.check_shard_rows(chunked)
