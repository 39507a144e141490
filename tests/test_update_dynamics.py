"""Part 02 · 55: clipping and the update ratio against torch, the per-update trace, the
decision rule, the records, and the exercise checks (mutants)."""

import math

import pytest
import torch

from bp_mech import registry, results
from bp_mech import update_dynamics as U
from bp_mech.workload import build_model, make_batches, parse_workload
from checks import ex55

W = parse_workload("tiny-b2s16")
CFG = U.DynamicsConfig(updates=6, timed=3, warmup=1)


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    return model, {n: t.clone() for n, t in model.state_dict().items()}, make_batches(W, CFG.updates)


def test_groups_cover_every_parameter_once(setup):
    model, _, _ = setup
    groups = U.param_groups(model)
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(groups[g] for g in U.GROUPS)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: counted once, in "embedding"
    opt = U.make_optimizer(model, 1e-3, CFG, "cpu")
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {
        "embedding": 0.1, "attention": 0.1, "mlp": 0.1, "norm_bias": 0.0}


def test_clip_matches_torch_and_conformance():
    row = U.conformance()
    assert row.passed, row.detail
    g = [torch.randn(5, 3), torch.randn(7) * 10]
    assert U.clip_coefficient(U.global_grad_norm(g), 1e9).item() == 1.0  # never scales up


def test_trace_values(setup):
    model, init, batches = setup
    rows = {n: U.trace(model, init, batches, n, CFG, "cpu") for n in U.CANDIDATES}
    for name, tr in rows.items():
        assert len(tr) == CFG.updates and all(r["finite"] for r in tr)
        for r in tr:
            want = min(1.0, CFG.max_norm / (r["grad_norm"] + U.EPS))
            assert r["would_clip"] == pytest.approx(want, rel=1e-6)
            assert r["clip_coef"] == (pytest.approx(want, rel=1e-6) if name == "high_lr_clip" else 1.0)
            for g in r["groups"].values():
                assert g["ratio"] == pytest.approx(g["update_norm"] / g["param_norm"])
    # same data, same init: the first loss and gradient norm agree across candidates
    assert len({round(tr[0]["loss"], 6) for tr in rows.values()}) == 1
    assert len({round(tr[0]["grad_norm"], 5) for tr in rows.values()}) == 1
    # AdamW's first step is about lr per element: 100x the LR gives about 100x the update
    r0 = rows["high_lr"][0]["groups"]["mlp"]["update_norm"] / rows["base_lr"][0]["groups"]["mlp"]["update_norm"]
    assert 50 < r0 < 150
    assert rows["high_lr_clip"][0]["clip_coef"] < 1.0  # the tiny model's first gradient exceeds max_norm


def test_update_ratio_measures_the_step(setup):
    """The first AdamW update of the norm gains (init 1, no decay) moves each element by about lr."""
    model, init, batches = setup
    tr = U.trace(model, init, batches[:1], "base_lr", CFG, "cpu")
    g = tr[0]["groups"]["norm_bias"]
    n_norm = sum(p.numel() for p in U.param_groups(model)["norm_bias"])
    assert g["update_norm"] == pytest.approx(CFG.base_lr * math.sqrt(n_norm), rel=0.1)


@pytest.mark.parametrize("rows,want", [
    ([dict(loss=5.0, finite=True), dict(loss=4.0, finite=True)], "accept"),
    ([dict(loss=5.0, finite=True), dict(loss=4.0, finite=True), dict(loss=4.6, finite=True),
      dict(loss=3.0, finite=True)], "tune"),  # spike of 0.6 nats over the running minimum
    ([dict(loss=5.0, finite=True), dict(loss=5.1, finite=True)], "tune"),  # did not fall
    ([dict(loss=5.0, finite=True), dict(loss=float("nan"), finite=False)], "reject"),
])
def test_decision_rule(rows, want):
    rows = [dict(r, grad_norm=1.0, clip_coef=1.0, groups={"mlp": dict(ratio=0.01)}) for r in rows]
    assert U.decide(U.summarize(rows))[0] == want


def test_run_records(tmp_path, monkeypatch):
    monkeypatch.setattr(U, "config_for", lambda arch, device, smoke=False: CFG)
    recs = U.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))
    assert [r.candidate for r in recs] == list(U.CANDIDATES)
    for r in recs:
        results.save_record(r, tmp_path)
        assert r.failure is None and r.peak_allocated > 0 and r.step_median_s > 0 and r.update_count == 6
        assert len(r.metrics["trace"]) == 6 and (r.decision, r.next_step) == U.decide(U.summarize(r.metrics["trace"]))
        assert r.threads == 1 and r.metrics["interleaved"] and len(r.metrics["step_samples_s"]) == CFG.timed
        by_run = r.metrics["updates_by_run"]
        assert by_run == dict(trace=6, measurement=2 + CFG.warmup + CFG.timed) and r.updates == sum(by_run.values())
    rec = {r.candidate: r for r in recs}
    assert rec["base_lr"].timing_noise is None and rec["base_lr"].metrics["time_ratio"] is None
    for name, base in (("high_lr", "base_lr"), ("high_lr_clip", "high_lr")):
        m = rec[name].metrics
        assert m["time_baseline"] == base and m["time_ratio"] == rec[name].step_median_s / rec[base].step_median_s
        if name == "high_lr_clip" and m["time_ratio"] < 1.0:  # clipping is more work: faster is noise
            assert "strictly more work" in rec[name].timing_noise
    assert recs[2].metrics["summary"]["clipped_updates"] >= 1 and recs[1].metrics["summary"]["clipped_updates"] == 0
    monkeypatch.undo()  # the plan of the real configs
    plan = registry.plan(registry.make_context("TRAIN-UPDATE-DYNAMICS", "dry_run", "qwen05-b2s512"))
    gpu = plan["modes"]["real_gpu"]
    assert gpu["lrs"]["high_lr"] == 100 * gpu["lrs"]["base_lr"] and gpu["estimated_seconds"] < 60
    assert gpu["timed_steps"] >= 20 and plan["modes"]["cpu"]["interleaved"] and plan["modes"]["cpu"]["threads"] == 1


# --- mutants: the checks catch the classic mistakes --------------------------------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex55_update_dynamics", **over)


def _per_tensor_clip(params, max_norm, eps=1e-6):  # clips each tensor to max_norm on its own
    params = [p for p in params if p.grad is not None]
    total = U.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad.mul_(torch.clamp(max_norm / (p.grad.norm() + eps), max=1.0))
    return total


def _uncapped_clip(params, max_norm, eps=1e-6):  # scales up small gradients too
    params = [p for p in params if p.grad is not None]
    total = U.global_grad_norm(p.grad for p in params)
    for p in params:
        p.grad.mul_(max_norm / (total + eps))
    return total


def _mean_ratio(before, after):  # mean of per-tensor ratios
    rs = [(a - b).norm().item() / b.norm().item() for b, a in zip(before, after)]
    du, pn, _ = U.update_ratio(before, after)
    return du, pn, sum(rs) / len(rs)


def _after_ratio(before, after):  # divides by the parameters after the update
    du = sum((a - b).pow(2).sum().item() for b, a in zip(before, after)) ** 0.5
    pa = sum(a.pow(2).sum().item() for a in after) ** 0.5
    return du, pa, du / pa


@pytest.mark.parametrize("check,over", [
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_per_tensor_clip)),
    (ex55.check_clip_by_global_norm_, dict(clip_by_global_norm_=_uncapped_clip)),
    (ex55.check_clip_coefficient, dict(clip_coefficient=lambda n, m, eps=1e-6: m / (n + eps))),
    (ex55.check_clip_coefficient, dict(clip_coefficient=lambda n, m, eps=1e-6: torch.clamp(m / n, max=1.0))),
    (ex55.check_global_grad_norm, dict(global_grad_norm=lambda gs: sum(g.norm() for g in gs if g is not None))),
    (ex55.check_update_ratio, dict(update_ratio=_mean_ratio)),
    (ex55.check_update_ratio, dict(update_ratio=_after_ratio)),
], ids=["per-tensor-clip", "uncapped-clip", "coef-uncapped", "coef-no-eps", "norm-sum-of-norms",
        "ratio-mean-per-tensor", "ratio-after-norm"])
def test_checks_catch_mistakes(check, over):
    with pytest.raises(AssertionError):
        check(_solution(**over))


def test_a_diverged_trace_still_saves(tmp_path, monkeypatch):
    """NaN/inf in a trace become null in the record (strict JSON) and the decision is reject."""
    def fake_trace(model, init, batches, name, cfg, device):
        g = {k: dict(update_norm=math.inf, param_norm=1.0, ratio=math.inf) for k in U.GROUPS}
        return [dict(loss=5.0, finite=True, grad_norm=2.0, clip_coef=1.0, would_clip=0.5, groups=g),
                dict(loss=math.nan, finite=False, grad_norm=math.nan, clip_coef=1.0, would_clip=math.nan, groups=g)]

    monkeypatch.setattr(U, "config_for", lambda arch, device, smoke=False: CFG)
    monkeypatch.setattr(U, "trace", fake_trace)
    recs = U.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))
    for r in recs:
        assert r.decision == "reject" and r.all_finite is False and r.next_step.startswith("non-finite from update 1")
        assert r.metrics["trace"][1]["loss"] is None and r.metrics["summary"]["first_nonfinite"] == 1
        results.load_record(results.save_record(r, tmp_path))


def test_stale_gradients_do_not_leak_into_the_next_candidate(setup):
    """After a candidate fails mid-step (CUDA OOM), .grad may remain on the shared model."""
    model, init, batches = setup
    clean = U.trace(model, init, batches[:2], "high_lr_clip", CFG, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    assert U.trace(model, init, batches[:2], "high_lr_clip", CFG, "cpu") == clean


@pytest.mark.parametrize("interleave", [True, False])
def test_oom_in_one_candidate_is_its_failure(monkeypatch, interleave):
    real = U.prepare_candidate

    def flaky(model, init, batches, name, cfg, device):
        if name == "high_lr":
            model(**batches[0]).loss.backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, init, batches, name, cfg, device)

    real_measure = U.measure_candidates
    monkeypatch.setattr(U, "config_for", lambda arch, device, smoke=False: CFG)
    monkeypatch.setattr(U, "prepare_candidate", flaky)
    monkeypatch.setattr(U, "measure_candidates", lambda *a, **kw: real_measure(*a, **kw, interleave=interleave))
    recs = {r.candidate: r for r in U.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "cpu", "tiny-b2s16"))}
    bad = recs["high_lr"]
    assert bad.failure.startswith("out of memory") and bad.decision is None and bad.peak_allocated is None
    assert bad.next_step.startswith("failed: out of memory")
    assert len(bad.metrics["trace"]) == CFG.updates == bad.updates  # the trace ran; only the measurement failed
    ok = recs["high_lr_clip"]
    assert ok.failure is None and ok.peak_allocated > 0 and ok.metrics["time_ratio"] is None  # no baseline time
    assert ok.metrics["interleaved"] is interleave and len(ok.metrics["step_samples_s"]) == CFG.timed


def test_config_follows_the_device():
    assert U.config_for("qwen05", "cuda").timed == 20 and U.config_for("qwen05", torch.device("cuda", 0)).timed == 20
    assert U.config_for("tiny", "cpu").base_lr == 1e-3 and U.config_for("qwen05", "cpu").base_lr == 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = U.run(registry.make_context("TRAIN-UPDATE-DYNAMICS", "real_gpu", "tiny-b2s64"))
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.memory_source == "cuda-allocator" and r.failure is None
        assert r.peak_reserved >= r.peak_allocated > 0 and r.step_p95_s >= r.step_median_s > 0
    assert recs[0].all_finite and recs[0].decision == "accept"
