"""TRAIN-AMP-BACKWARD: the scaler model vs GradScaler, clipping after unscale, the run on the
CPU (overflow sample semantics, decisions), the GPU plan, and mutants for the exercise checks."""

import math
import types

import pytest
import torch

from bp_mech import amp, registry, results
from bp_mech.amp import DynamicLossScaler, decide, unscale_and_clip_
from bp_mech.measure import MAX_RATIO_SPREAD
from checks import ex_amp



def test_scaler_model_matches_gradscaler():
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    ref = ex_amp.GradScalerReference(init_scale=2.0**16, growth_interval=3)
    ours = DynamicLossScaler(2.0**16, growth_interval=3)
    trace = []
    for f in pattern:
        skipped, scale = ref.step(f)
        assert ours.update(f) == skipped and ours.scale == scale
        trace.append(scale)
    assert trace[:6] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16]  # backoff, then growth after 3


def test_unscale_then_clip_equals_torch():
    g = torch.Generator().manual_seed(0)
    true = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    params = [torch.zeros_like(t, requires_grad=True) for t in true]
    for p, t in zip(params, true):
        p.grad = t.clone()
    norm_ref = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    grads = [t * 1024.0 for t in true]
    norm, coef, found_inf = unscale_and_clip_(grads, 1024.0, 0.5)
    assert not found_inf and norm == pytest.approx(norm_ref, rel=1e-6) and coef < 1
    for a, p in zip(grads, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=0)


def test_decision_rule():
    assert decide(True, 0.0, 0.001, 0.89, 1.02) == ("accept", None)
    assert decide(True, 0.0, 0.001, 0.97, 1.00)[0] == "tune"  # saving below MIN_PEAK_SAVING
    assert decide(True, 0.0, 0.001, 0.80, 1.50)[0] == "tune"  # too slow
    assert decide(False, 0.0, 0.001, 0.80, 1.00)[0] == "reject"
    assert decide(True, 0.5, 0.001, 0.80, 1.00)[0] == "reject"  # too many skipped steps
    assert decide(True, 0.0, 0.05, 0.80, 1.00)[0] == "reject"  # loss off FP32
    assert decide(True, 0.0, math.nan, 0.80, 1.00)[0] == "reject"
    assert decide(True, 0.0, 0.001, math.nan, 1.00)[0] == "tune"  # no peak to compare: no memory win shown
    for args in [(True, 0.0, 0.001, 0.80, 1.00), (True, 0.0, 0.001, 0.80, 1.50)]:  # noise: the time decides nothing
        decision, nxt = decide(*args, noise="median ratio 1.00 and P95 ratio 3.00 differ")
        assert decision is None and "noise (median ratio 1.00" in nxt and "GPU" in nxt
    # what does not depend on the time still decides under noise; a tune or reject always says what next
    assert decide(True, 0.0, 0.001, 0.97, 1.00, noise="x")[0] == "tune"
    assert decide(False, 0.0, 0.001, 0.80, 1.00, noise="x")[0] == "reject"
    for args in [(True, 0.0, 0.001, 0.97, 1.0), (True, 0.0, 0.001, 0.8, 1.5), (False, 0.0, 0.001, 0.8, 1.0)]:
        assert decide(*args)[1]


@pytest.fixture(scope="module")
def cpu_records():
    ctx = registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s32")
    return {r.candidate: r for r in registry.run(ctx)}


def r_peak(recs, name):
    return recs[name].peak_allocated / recs["fp32"].peak_allocated


def test_cpu_run_records(cpu_records, tmp_path):
    assert set(cpu_records) == set(amp.CANDIDATES)  # CPU autocast supports bf16
    for r in cpu_records.values():
        results.load_record(results.save_record(r, tmp_path))
        assert r.failure is None and r.evidence_level == "cpu-mechanism"
    cfg = amp.CPU_CONFIG
    for name in ("fp32", "fp16-amp", "bf16-amp"):
        r = cpu_records[name]
        applied = r.metrics["applied_per_step"]
        assert len(applied) == 1 + cfg.warmup + cfg.timed  # tracked + warm-up + timed: every optimizer call
        assert r.updates == sum(applied) and r.updates + r.skipped_updates == len(applied)
        assert r.update_count == r.updates  # the LR clock counted exactly the applied updates
        assert r.all_finite and r.warmup_excluded == cfg.warmup and len(r.metrics["step_samples_s"]) == cfg.timed
        assert r.threads == 1 and r.metrics["interleaved"] is True
        assert r.peak_allocated > 0 and r.memory_source == "tracked-cpu" and r.step_p95_s >= r.step_median_s
    assert cpu_records["fp32"].decision is None and cpu_records["fp32"].timing_noise is None
    for name in ("fp16-amp", "bf16-amp"):
        r = cpu_records[name]
        m = r.metrics
        assert m["loss_rel_diff"] <= amp.LOSS_REL_TOL and m["peak_ratio"] == r_peak(cpu_records, name)
        assert m["time_ratio"] == r.step_median_s / cpu_records["fp32"].step_median_s
        assert m["p95_ratio"] == r.step_p95_s / cpu_records["fp32"].step_p95_s
        spread = max(m["time_ratio"], m["p95_ratio"]) / min(m["time_ratio"], m["p95_ratio"])
        assert (r.timing_noise is not None) == (spread > MAX_RATIO_SPREAD)  # AMP is not "strictly more work"
        want = decide(r.all_finite, r.skipped_updates / len(m["applied_per_step"]), m["loss_rel_diff"],
                      m["peak_ratio"], m["time_ratio"], noise=r.timing_noise)
        assert (r.decision, r.next_step) == want
        if r.decision in ("tune", "reject") or r.decision is None:
            assert r.next_step
    assert cpu_records["fp16-amp"].metrics["loss_scale_trace"][0] == cfg.init_scale
    assert cpu_records["bf16-amp"].metrics["scaler"] is False


def test_overflow_sample_semantics(cpu_records):
    r, cfg = cpu_records["fp16-overflow"], amp.CPU_CONFIG
    m = r.metrics
    assert m["skipped_calls"] == list(cfg.overflow_calls) and r.skipped_updates == len(cfg.overflow_calls)
    assert r.updates == r.update_count == cfg.overflow_n - len(cfg.overflow_calls)  # successful steps only
    assert r.updates + r.skipped_updates == len(m["applied_per_step"]) == cfg.overflow_n
    assert r.failure is None and r.decision is None  # the scaler recovered: growth after the last overflow
    assert m["scaler_matches_reference"] and m["params_unchanged_on_skip"] and m["clock_held_on_skip"]
    assert m["fp32_finite_under_same_injection"]  # the injected overflow is an FP16 overflow
    assert m["backoff_calls"] == [2, 3, 8] and m["growth_calls"] == [6, 11]
    s = m["loss_scale_trace"]
    assert s[3] == cfg.init_scale / 4 and s[6] == cfg.init_scale / 2
    lr = m["lr_per_call"]
    assert lr[3] == lr[2] and lr[4] == lr[2]  # two skipped calls: the next update reads the same LR


def test_gpu_plan_fits_budget():
    p = registry.plan(registry.make_context("TRAIN-AMP-BACKWARD", "dry_run", "qwen05-b2s512"))
    gpu, cpu = p["modes"]["real_gpu"], p["modes"]["cpu"]
    assert gpu["config"]["timed"] == amp.GPU_CONFIG.timed >= 20 and cpu["config"]["timed"] == amp.CPU_CONFIG.timed
    assert gpu["config"]["schedule"]["base_lr"] == 1e-4
    assert gpu["updates_per_candidate"] == amp.GPU_CONFIG.warmup + amp.GPU_CONFIG.timed
    assert cpu["interleaved"] and cpu["threads"] == 1 and not gpu["interleaved"] and gpu["threads"] is None
    assert 10 <= gpu["estimated_seconds"] <= 60 and set(gpu["estimated_s"]) == set(amp.CANDIDATES)
    assert "H200" in p["estimate_basis"]


def test_first_three_gpu_experiments_fit_the_budget():
    """The suite starts with AMP, 11 and 55 on qwen05: together about 3 minutes on one H200."""
    total = 0.0
    for sid in ("TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION", "TRAIN-UPDATE-DYNAMICS"):
        ctx = registry.make_context(sid, "dry_run", registry.get(sid).gpu_workload)
        assert ctx.workload.arch == "qwen05"
        total += registry.plan(ctx)["modes"]["real_gpu"]["estimated_seconds"]
    assert total <= 170, total


def test_config_follows_the_device():
    assert amp.config_for("cuda") is amp.GPU_CONFIG and amp.config_for(torch.device("cuda", 0)) is amp.GPU_CONFIG
    assert amp.config_for("cpu") is amp.CPU_CONFIG


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "real_gpu", "tiny-b2s64"))
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.failure is None
    assert all(r.memory_source == "cuda-allocator" for r in recs if r.candidate != "fp16-overflow")
    assert next(r for r in recs if r.candidate == "fp16-overflow").metrics["semantics_ok"]


# --- the exercise checks catch the classic mistakes ------------------------------------

class GrowsOnOverflowStep(DynamicLossScaler):
    """Counts the step and grows before looking at found_inf."""

    def update(self, found_inf):
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        return bool(found_inf)


class KeepsTrackerOnOverflow(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            return True
        return super().update(False)


class NeverSkips(DynamicLossScaler):
    def update(self, found_inf):
        super().update(found_inf)
        return False


class GrowsOneLate(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            return super().update(True)
        self.growth_tracker += 1
        if self.growth_tracker > self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        return False


class NoBackoff(DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            return True
        return super().update(False)


SCALER_MUTANTS = [GrowsOnOverflowStep, KeepsTrackerOnOverflow, NeverSkips, GrowsOneLate, NoBackoff]


@pytest.mark.parametrize("cls", SCALER_MUTANTS, ids=lambda c: c.__name__)
def test_scaler_check_catches(cls):
    with pytest.raises(AssertionError):
        ex_amp.check_scaler_patterns(types.SimpleNamespace(DynamicLossScaler=cls))


def clip_scaled_then_unscale(grads, scale, max_norm, eps=1e-6):
    """The classic bug: clip the scaled gradients, unscale afterwards."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = min(1.0, max_norm / (total + eps))
    for g in grads:
        g.mul_(coef / scale)
    return total, coef, not math.isfinite(total)


def clip_before_unscale_reporting_true_norm(grads, scale, max_norm, eps=1e-6):
    """Subtler: reports the unscaled norm but clips with the scaled one."""
    total, coef, found = clip_scaled_then_unscale(grads, scale, max_norm, eps)
    return total / scale, coef, found


def clips_on_overflow(grads, scale, max_norm, eps=1e-6):
    for g in grads:
        g.mul_(1.0 / scale)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = max_norm / (total + eps)
    for g in grads:
        g.mul_(min(1.0, coef))
    return total, min(1.0, coef), not math.isfinite(total)


@pytest.mark.parametrize("fn", [clip_scaled_then_unscale, clip_before_unscale_reporting_true_norm, clips_on_overflow],
                         ids=lambda f: f.__name__)
def test_clip_checks_catch(fn):
    m = types.SimpleNamespace(unscale_and_clip_=fn)
    caught = 0
    for check in (ex_amp.check_unscale_and_clip, ex_amp.check_unscale_and_clip_overflow):
        try:
            check(m)
        except AssertionError:
            caught += 1
    assert caught >= 1


def test_conformance_passes():
    row = amp.conformance()
    assert row.passed, row.detail


SMALL = amp.AmpConfig(timed=2, warmup=1, overflow_n=4, overflow_calls=(1,))


def test_oom_in_one_candidate_is_its_failure(monkeypatch):
    real = amp.tracked_trainer

    def flaky(base, name, *a, **kw):
        if name == "fp16-amp":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(base, name, *a, **kw)

    monkeypatch.setattr(amp, "tracked_trainer", flaky)
    monkeypatch.setattr(amp, "CPU_CONFIG", SMALL)
    recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s16"))}
    bad = recs["fp16-amp"]
    assert bad.failure.startswith("out of memory") and bad.peak_allocated is None and bad.decision is None
    assert bad.next_step and bad.updates is None
    ok = recs["bf16-amp"]  # the run went on, and was timed with the others
    assert ok.failure is None and ok.metrics["time_ratio"] > 0 and len(ok.metrics["step_samples_s"]) == SMALL.timed
    assert ok.decision is not None or ok.timing_noise is not None
    assert recs["fp16-overflow"].skipped_updates == 1


def test_the_sequential_path_measures_each_candidate_alone():
    """The CUDA path (one candidate after another, measure_steps), run on the CPU: every candidate
    makes warm-up + timed updates (+ the tracked one measure_steps adds on the CPU), none interleaved."""
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b1s16")
    batches = make_batches(w, SMALL.warmup + SMALL.timed + 2)
    out = amp.timed_runs(build_model(w), ["fp32", "bf16-amp"], SMALL, "cpu", batches, interleave=False)
    for name, (r, failure) in out.items():
        assert failure is None and r["updates"] == 1 + SMALL.warmup + SMALL.timed and r["skipped"] == 0
        t = r["stats"].timing
        assert not t.interleaved and len(t.samples) == SMALL.timed and t.warmup_excluded == SMALL.warmup
        assert r["stats"].peak_allocated > 0 and math.isfinite(r["eval_loss"])


def test_fused_adamw_path_keeps_the_skip_semantics(monkeypatch):
    """On CUDA ``make_adamw`` is fused: GradScaler then hands ``found_inf`` to the optimizer,
    which runs and skips inside its kernel. CPU fused AdamW takes the same GradScaler branch."""
    made = []

    def fused(params, lr, device, **kw):
        made.append(torch.optim.AdamW(params, lr=lr, fused=True, **kw))
        return made[-1]

    monkeypatch.setattr(amp, "make_adamw", fused)
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b1s16")
    cfg = amp.AmpConfig(timed=2, warmup=1, overflow_n=6, overflow_calls=(1, 2))
    o = amp.overflow_sample(build_model(w), "fp16-overflow", cfg, "cpu", make_batches(w, 4))
    assert made[-1]._step_supports_amp_scaling
    assert o["params_unchanged_on_skip"] and o["clock_held_on_skip"] and o["scaler_matches_reference"]
    assert o["skipped"] == 2 and o["updates"] == 4 and o["backoff_calls"] == [1, 2]
    step = {float(s["step"]) for s in made[-1].state.values()}
    assert step == {4.0}  # the skipped calls did not count as AdamW steps either


def test_a_diverged_candidate_still_saves_without_jsonschema(monkeypatch, tmp_path):
    """NaN/inf in a trace become null (records are strict JSON) and the decision is reject; the
    GPU machine has no jsonschema, so the built-in validator checks the record."""
    import sys

    real = amp.finish

    def diverged(tr, *a, **kw):
        out = real(tr, *a, **kw)
        if tr.low is torch.bfloat16:
            out["eval_loss"] = math.nan
            out["trace"]["loss"][-1] = math.inf
        return out

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    monkeypatch.setattr(amp, "finish", diverged)
    monkeypatch.setattr(amp, "CPU_CONFIG", SMALL)
    recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-AMP-BACKWARD", "cpu", "tiny-b1s16"))}
    r = recs["bf16-amp"]
    assert r.decision == "reject" and r.all_finite is False
    assert r.metrics["eval_loss"] is None and r.metrics["loss_per_step"][-1] is None
    for rec in recs.values():
        results.load_record(results.save_record(rec, tmp_path))


# --- the overflow sample's failure -----------------------------------------------------

def _trace(applied, scale, loss):
    return dict(applied=applied, scale=scale, loss=loss)


def test_overflow_failure_says_why():
    ok = _trace([True, False, True, True], [4.0, 2.0, 2.0, 4.0], [5.0, 5.0, 4.9, 4.8])
    assert amp.overflow_failure(ok, (1,)) is None
    stuck = _trace([True, False, False, False], [4.0, 2.0, 1.0, 0.5], [5.0, 5.0, 5.0, 5.0])
    why = amp.overflow_failure(stuck, (1,))
    assert "never recovered" in why and "after the last injected overflow (call 1)" in why
    assert "fell to 0.5, below SCALE_FLOOR 1" in why
    at_end = _trace([True, True, False], [4.0, 4.0, 2.0], [5.0, 4.9, 4.8])  # nothing after the last overflow
    assert "never recovered" in amp.overflow_failure(at_end, (2,))
    low = _trace([True, True], [0.25, 0.25], [5.0, 4.9])  # recovered, but the scale collapsed
    assert amp.overflow_failure(low, ()) == "the loss scale fell to 0.25, below SCALE_FLOOR 1"
    nan = _trace([True, True], [4.0, 4.0], [5.0, math.nan])
    assert amp.overflow_failure(nan, ()) == "the loss ended non-finite"


# --- clipping the scaled gradients, measured -----------------------------------------------

@pytest.fixture(scope="module")
def clip_setup():
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload(registry.get("TRAIN-AMP-BACKWARD").cpu_workload)  # the page's workload
    return build_model(w), make_batches(w, amp.CLIP_DEMO_UPDATES)


def _first_gradient(base, batch, scale):
    """The unscaled float32 gradient of the first update, as both runs compute it."""
    import copy

    model = copy.deepcopy(base)
    with amp.autocast("cpu", torch.float16):
        loss = model(**batch).loss
    (loss * scale).backward()
    return [p.grad / scale for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def test_clipping_order_fires_at_the_wrong_times(clip_setup):
    base, batches = clip_setup
    S, mn = 2.0**16, amp.CLIP_DEMO_MAX_NORM
    rows = amp.clipping_order(base, batches, mn, scale=S)
    assert len(rows) == amp.CLIP_DEMO_UPDATES and all(r["applied_a"] and r["applied_b"] for r in rows)
    for r in rows:
        assert r["clip_coef_a"] == pytest.approx(min(1.0, mn / (r["norm_a"] + 1e-6)), rel=1e-12)
        assert r["clipped_a"] == (r["clip_coef_a"] < 1.0) == (r["norm_a"] + 1e-6 > mn)
        # (b) compares max_norm with S x its true norm: clips every step, by a coefficient ~1/S too small
        assert r["clipped_b"] and r["clip_coef_b"] == pytest.approx(mn / (r["norm_b"] + 1e-6), rel=1e-12)
        assert r["clip_coef_b"] < 1e-3 * min(1.0, r["clip_coef_a"])
        # what AdamW receives in (b): the gradient rescaled to norm max_norm / S
        assert r["grad_median_b"] < 1e-3 * r["grad_median_a"]
    # the same weights at the first update: the same true norm, S times larger as (b) sees it
    assert rows[0]["norm_b"] == pytest.approx(S * rows[0]["norm_a"], rel=1e-5)
    assert rows[0]["loss_a"] == rows[0]["loss_b"]
    # at the page's max_norm the correct run clips some updates, not all
    assert 0 < sum(r["clipped_a"] for r in rows) < len(rows)


def test_clipping_order_update_difference_is_adams_epsilon(clip_setup):
    """The first AdamW update is -lr * (c g / (|c g| + eps) + wd p) per element (m_hat = c g,
    sqrt(v_hat) = |c g|): computed here in float64 from the first gradient, for c_a and c_b."""
    base, batches = clip_setup
    S, mn, lr = 2.0**16, amp.CLIP_DEMO_MAX_NORM, 1e-3
    grads, params = _first_gradient(base, batches[0], S)
    norm = sum(g.double().pow(2).sum() for g in grads).sqrt().item()
    c_a, c_b = min(1.0, mn / (norm + 1e-6)), mn / (S * norm + 1e-6)
    for eps in (1e-8, 1e-30):
        rows = amp.clipping_order(base, batches[:2], mn, scale=S, lr=lr, adam_eps=eps)
        step = [[c * g.double() / ((c * g.double()).abs() + eps) for g in grads] for c in (c_a, c_b)]
        diff = sum((a - b).pow(2).sum() for a, b in zip(*step)).sqrt().item()
        size = sum((a + 0.01 * p.double()).pow(2).sum() for a, p in zip(step[0], params)).sqrt().item()
        if eps == 1e-8:  # the rescaled gradient meets eps: the update shrinks by tens of percent
            assert rows[0]["update_rel_diff"] == pytest.approx(diff / size, rel=1e-3) and diff / size > 0.1
        else:  # eps plays no role: AdamW's first step ignores the rescale (float32 rounding of p_after - p)
            assert diff / size < 1e-6 and rows[0]["update_rel_diff"] < 1e-5
            assert rows[1]["update_rel_diff"] < 1e-2  # afterwards: the rescale only reweights the moments
