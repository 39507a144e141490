"""TRAIN-AMP-BACKWARD, the experiment (``bp_mech.experiments.amp``): the decision rule, the run on the
CPU (records, overflow sample semantics, decisions), the GPU plan, the measurement's paths (interleaved,
alone, an out-of-memory candidate, fused AdamW), diverged runs and the conformance check."""

import math

import pytest
import torch

from bp_mech.bench import trainer
from bp_mech.bench.timing import MAX_RATIO_SPREAD
from bp_mech.experiments import amp as experiment, amp_overflow, decision, harness
from bp_mech import scheduler
from bp_mech.experiments.amp import decide
from bp_mech.experiments.amp_overflow import overflow_failure
from bp_mech.records import registry, results


def test_decision_rule():
    # (finite, skipped fraction, loss rel. diff, peak saving, time ratio)
    assert decide(True, 0.0, 0.001, 0.11, 1.02).record_fields() == dict(decision="accept", next_step=None)
    assert decide(True, 0.0, 0.001, 0.03, 1.00).verdict == "tune"  # saving below decision.MIN_PEAK_SAVING
    assert decide(True, 0.0, 0.001, decision.MIN_PEAK_SAVING, 1.00).verdict == "accept"  # at the threshold
    assert decide(True, 0.0, 0.001, -0.10, 1.00).verdict == "tune"  # a higher peak
    assert decide(True, 0.0, 0.001, 0.20, 1.50).reason.endswith("1.50x FP32's (> 1 + MAX_TIME_COST 1.1x)")  # too slow
    assert decide(False, 0.0, 0.001, 0.20, 1.00).verdict == "reject"
    assert decide(True, 0.5, 0.001, 0.20, 1.00).reason == "skipped fraction 50% > MAX_SKIPPED_FRACTION 25%"
    assert decide(True, 0.0, 0.05, 0.20, 1.00).reason == "held-out loss 5.00% off FP32's (LOSS_REL_TOL 2%)"
    assert decide(True, 0.0, math.nan, 0.20, 1.00).verdict == "reject"
    assert decide(True, 0.0, 0.001, math.nan, 1.00).verdict == "tune"  # no peak to compare: no memory win shown
    for args in [(True, 0.0, 0.001, 0.20, 1.00), (True, 0.0, 0.001, 0.20, 1.50)]:  # noise: the time decides nothing
        d = decide(*args, noise="median ratio 1.00 and P95 ratio 3.00 differ")
        assert d.verdict is None and "noise (median ratio 1.00" in d.reason and "GPU" in d.next_step
    # what does not depend on the time still decides under noise; a tune or reject always says what next
    assert decide(True, 0.0, 0.001, 0.03, 1.00, noise="x").verdict == "tune"
    assert decide(False, 0.0, 0.001, 0.20, 1.00, noise="x").verdict == "reject"
    for args in [(True, 0.0, 0.001, 0.03, 1.0), (True, 0.0, 0.001, 0.2, 1.5), (False, 0.0, 0.001, 0.2, 1.0)]:
        assert decide(*args).next_step


@pytest.fixture(scope="module")
def cpu_records():
    ctx = registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s32")
    return {r.candidate: r for r in registry.run(ctx)}


def peak_saving(recs, name):
    return 1 - recs[name].peak_allocated / recs["plain"].peak_allocated


def test_cpu_run_records(cpu_records, tmp_path):
    assert set(cpu_records) == set(experiment.CANDIDATES)  # CPU autocast supports bf16
    for r in cpu_records.values():
        results.load_record(results.save_record(r, tmp_path))
        assert r.failure is None and r.evidence_level == "cpu-mechanism"
    cfg = experiment.CPU_CONFIG
    for name in ("plain", "fp16", "bf16"):
        r = cpu_records[name]
        applied = r.metrics["applied_per_step"]
        assert len(applied) == 2 + cfg.warmup + cfg.timed  # warm + tracked + warm-up + timed: every optimizer call
        assert r.updates == sum(applied) and r.updates + r.skipped_updates == len(applied) and r.strategy == name
        lr = r.metrics["lr_per_step"]  # the LR clock counted exactly the applied updates
        assert lr[0] == cfg.schedule.base_lr * scheduler.wsd_lr(0, cfg.schedule) / cfg.schedule.base_lr
        assert lr[-1] == scheduler.wsd_lr(sum(applied[:-1]), cfg.schedule)
        assert r.all_finite and r.warmup_excluded == cfg.warmup and len(r.metrics["step_samples_s"]) == cfg.timed
        assert r.threads == 1 and r.metrics["interleaved"] is True
        assert r.peak_allocated > 0 and r.memory_source == "tracked-cpu" and r.step_p95_s >= r.step_median_s
    assert cpu_records["plain"].decision is None and cpu_records["plain"].timing_noise is None
    for name in ("fp16", "bf16"):
        r = cpu_records[name]
        m = r.metrics
        assert m["loss_rel_diff"] <= experiment.LOSS_REL_TOL and m["peak_saving"] == peak_saving(cpu_records, name)
        assert m["time_ratio"] == r.step_median_s / cpu_records["plain"].step_median_s
        assert m["p95_ratio"] == r.step_p95_s / cpu_records["plain"].step_p95_s
        spread = max(m["time_ratio"], m["p95_ratio"]) / min(m["time_ratio"], m["p95_ratio"])
        assert (r.timing_noise is not None) == (spread > MAX_RATIO_SPREAD)  # AMP is not "strictly more work"
        want = decide(r.all_finite, r.skipped_updates / len(m["applied_per_step"]), m["loss_rel_diff"],
                      m["peak_saving"], m["time_ratio"], noise=r.timing_noise)
        assert dict(decision=r.decision, next_step=r.next_step) == want.record_fields()
        if r.decision in ("tune", "reject") or r.decision is None:
            assert r.next_step
    assert cpu_records["fp16"].metrics["loss_scale_trace"][0] == cfg.init_scale
    assert cpu_records["bf16"].metrics["scaler"] is False


def test_overflow_sample_semantics(cpu_records):
    r, cfg = cpu_records["fp16-overflow"], experiment.CPU_CONFIG
    m = r.metrics
    assert m["skipped_calls"] == list(cfg.overflow_calls) and r.skipped_updates == len(cfg.overflow_calls)
    assert r.updates == cfg.overflow_n - len(cfg.overflow_calls) and r.strategy is None  # successful steps only
    assert r.updates + r.skipped_updates == len(m["applied_per_step"]) == cfg.overflow_n
    assert r.failure is None and r.decision is None  # the scaler recovered: growth after the last overflow
    assert m["scaler_matches_reference"] and m["params_unchanged_on_skip"] and m["clock_held_on_skip"]
    assert m["fp32_finite_under_same_injection"]  # the injected overflow is an FP16 overflow
    assert m["backoff_calls"] == [2, 3, 8] and m["growth_calls"] == [6, 11]
    s = m["loss_scale_trace"]
    assert s[3] == cfg.init_scale / 4 and s[6] == cfg.init_scale / 2
    lr = m["lr_per_call"]
    assert lr[3] == lr[2] and lr[4] == lr[2]  # two skipped calls: the next update reads the same LR


def test_the_gpu_dry_run_fits_the_budget():
    p = registry.dry_run(registry.make_context("TRAIN-AMP-BACKWARD", "dry_run", "qwen05-b2s512"))
    gpu, cpu = p["modes"]["real_gpu"], p["modes"]["cpu"]
    gpu_cfg, cpu_cfg = experiment.GPU_CONFIG, experiment.CPU_CONFIG
    assert gpu["config"]["timed"] == gpu["timed_rounds"] == gpu_cfg.timed >= 20
    assert cpu["config"]["timed"] == cpu["timed_rounds"] == cpu_cfg.timed
    assert gpu["config"]["schedule"]["base_lr"] == 1e-4
    assert gpu["measured_steps"] == 1 + gpu_cfg.warmup + gpu_cfg.timed  # the tracked step, alone on the GPU
    assert cpu["measured_steps"] == 1 + cpu_cfg.warmup + cpu_cfg.timed  # the tracked step gives the CPU's peak
    assert cpu["interleaved"] and cpu["threads"] == 1 and not gpu["interleaved"] and gpu["threads"] is None
    assert 10 <= gpu["estimated_seconds"] <= 60 and set(gpu["estimated_seconds_per_candidate"]) == set(experiment.CANDIDATES)
    assert p["rule"]["MIN_PEAK_SAVING"] == decision.MIN_PEAK_SAVING
    assert "H200" in p["estimate_basis"]


def test_first_three_gpu_experiments_fit_the_budget():
    """The suite starts with AMP, 11 and 55 on qwen05: together about 3 minutes on one H200."""
    total = 0.0
    for sid in ("TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION", "TRAIN-UPDATE-DYNAMICS"):
        ctx = registry.make_context(sid, "dry_run", registry.get(sid).gpu_workload)
        assert ctx.workload.arch == "qwen05"
        total += registry.dry_run(ctx)["modes"]["real_gpu"]["estimated_seconds"]
    assert total <= 170, total


def test_config_follows_the_device():
    assert experiment.config_for("cuda") is experiment.GPU_CONFIG
    assert experiment.config_for(torch.device("cuda", 0)) is experiment.GPU_CONFIG
    assert experiment.config_for("cpu") is experiment.CPU_CONFIG


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "real_gpu", "tiny-b2s64"))
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.failure is None
    assert all(r.memory_source == "cuda-allocator" for r in recs if r.candidate != "fp16-overflow")
    assert next(r for r in recs if r.candidate == "fp16-overflow").metrics["semantics_ok"]


def test_conformance_passes():
    row = experiment.conformance()
    assert row.passed, row.detail


SMALL = experiment.AmpConfig(timed=2, warmup=1, overflow_n=4, overflow_calls=(1,))


def test_oom_in_one_candidate_is_its_failure(monkeypatch):
    real = harness.train_step

    def flaky(model, opt, batch, strategy, **kw):
        if strategy.name == "fp16":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, opt, batch, strategy, **kw)

    monkeypatch.setattr(harness, "train_step", flaky)
    monkeypatch.setattr(experiment, "CPU_CONFIG", SMALL)
    recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s16"))}
    bad = recs["fp16"]
    assert bad.failure.startswith("out of memory") and bad.peak_allocated is None and bad.decision is None
    assert bad.next_step and bad.updates is None
    ok = recs["bf16"]  # the run went on, and was timed with the others
    assert ok.failure is None and ok.metrics["time_ratio"] > 0 and len(ok.metrics["step_samples_s"]) == SMALL.timed
    assert ok.decision is not None or ok.timing_noise is not None
    assert recs["fp16-overflow"].skipped_updates == 1


def test_the_sequential_path_measures_each_candidate_alone():
    """The CUDA path (one arm after another, alone), run on the CPU: every arm makes its warm update, the
    tracked one, warm-up and timed updates, none interleaved."""
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b1s16")
    batches = make_batches(w, SMALL.warmup + SMALL.timed + 2)
    out = experiment.measure(build_model(w), ["plain", "bf16"], SMALL, "cpu", batches, together=False)
    for name, m in out.items():
        assert isinstance(m, harness.Measured) and m.updates == 2 + SMALL.warmup + SMALL.timed and m.skipped == 0
        t = m.timing
        assert not t.interleaved and len(t.samples) == SMALL.timed and t.warmup_excluded == SMALL.warmup
        assert m.peak.allocated > 0 and math.isfinite(m.finish.eval_loss)
        assert len(m.finish.trace["applied"]) == m.updates


def test_fused_adamw_path_keeps_the_skip_semantics(monkeypatch):
    """On CUDA ``make_adamw`` is fused: GradScaler then hands ``found_inf`` to the optimizer,
    which runs and skips inside its kernel. CPU fused AdamW takes the same GradScaler branch."""
    made = []

    def fused(params, lr, device, **kw):
        made.append(torch.optim.AdamW(params, lr=lr, fused=True, **kw))
        return made[-1]

    monkeypatch.setattr(trainer, "make_adamw", fused)  # the overflow sample's AdamW: bench.trainer's
    from bp_mech.instruments.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b1s16")
    cfg = experiment.AmpConfig(timed=2, warmup=1, overflow_n=6, overflow_calls=(1, 2))
    o = amp_overflow.overflow_sample(build_model(w), cfg, "cpu", make_batches(w, 4))
    assert made[-1]._step_supports_amp_scaling
    assert o["params_unchanged_on_skip"] and o["clock_held_on_skip"] and o["scaler_matches_reference"]
    assert o["skipped"] == 2 and o["updates"] == 4 and o["backoff_calls"] == [1, 2]
    step = {float(s["step"]) for s in made[-1].state.values()}
    assert step == {4.0}  # the skipped calls did not count as AdamW steps either


def test_a_diverged_candidate_still_saves_without_jsonschema(monkeypatch, tmp_path):
    """NaN/inf in a trace become null (records are strict JSON) and the decision is reject; the
    GPU machine has no jsonschema, so the built-in validator checks the record."""
    import sys

    import dataclasses

    real = experiment.measure

    def diverged(*a, **kw):  # the bf16 arm's run diverges: its last loss inf, its held-out loss NaN
        out = real(*a, **kw)
        o = out["bf16"].finish
        o.trace["loss"][-1] = math.inf
        out["bf16"].finish = dataclasses.replace(o, eval_loss=math.nan)
        return out

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    monkeypatch.setattr(experiment, "measure", diverged)
    monkeypatch.setattr(experiment, "CPU_CONFIG", SMALL)
    recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s16"))}
    r = recs["bf16"]
    assert r.decision == "reject" and r.all_finite is False
    assert r.metrics["eval_loss"] is None and r.metrics["loss_per_step"][-1] is None
    for rec in recs.values():
        results.load_record(results.save_record(rec, tmp_path))


# --- the overflow sample's failure -----------------------------------------------------

def _trace(applied, scale, loss):
    return dict(applied=applied, scale=scale, loss=loss)


def test_overflow_failure_says_why():
    ok = _trace([True, False, True, True], [4.0, 2.0, 2.0, 4.0], [5.0, 5.0, 4.9, 4.8])
    assert overflow_failure(ok, (1,)) is None
    stuck = _trace([True, False, False, False], [4.0, 2.0, 1.0, 0.5], [5.0, 5.0, 5.0, 5.0])
    why = overflow_failure(stuck, (1,))
    assert "never recovered" in why and "after the last injected overflow (call 1)" in why
    assert "fell to 0.5, below SCALE_FLOOR 1" in why
    at_end = _trace([True, True, False], [4.0, 4.0, 2.0], [5.0, 4.9, 4.8])  # nothing after the last overflow
    assert "never recovered" in overflow_failure(at_end, (2,))
    low = _trace([True, True], [0.25, 0.25], [5.0, 4.9])  # recovered, but the scale collapsed
    assert overflow_failure(low, ()) == "the loss scale fell to 0.25, below SCALE_FLOOR 1"
    nan = _trace([True, True], [4.0, 4.0], [5.0, math.nan])
    assert overflow_failure(nan, ()) == "the loss ended non-finite"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_skipped_step_calls_fused_adamw_and_it_skips_inside(impl):
    """The mixed-precision page: on an overflow ``scaler.step`` does not call a foreach AdamW's step; a fused
    AdamW (the book's on CUDA, ``make_adamw``) it does call, with ``found_inf``, and the kernel skips."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, **{impl: True})
    scaler, calls, step = torch.amp.GradScaler("cpu"), [], opt.step
    opt.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    for factor in (2.0, math.inf):  # a finite step (AdamW's state exists), then an overflow
        opt.zero_grad()
        scaler.scale((p * factor).sum()).backward()
        before, count = p.detach().clone(), opt.state[p].get("step", torch.tensor(0.0)).clone()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(p.detach(), before) and torch.equal(opt.state[p]["step"], count)  # nothing moved
    assert len(calls) == (2 if impl == "fused" else 1)
