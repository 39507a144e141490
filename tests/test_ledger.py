"""TRAIN-STATE-LEDGER (Part 02 · 43): the three sources agree, the classes mean what they say,
the strategies train the same, and the exercise checks catch the classic mistakes."""

import copy
import gc
import types
import weakref

import pytest
import torch

from bp_mech import ledger as L
from bp_mech.measure import PeakMemory
from bp_mech.workload import ARCHITECTURES, build_model, make_batches, parse_workload
from checks import ex43

TINY = parse_workload("tiny-b2s64")


@pytest.fixture(scope="module")
def measured():
    return {s: L.track(TINY, L.LedgerConfig(strategy=s)) for s in L.CANDIDATES}


def _formula(w, cfg, device="cpu"):
    return L.theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, cfg, device)


def _assert_agrees(formula, led):
    """Stage totals within TOL and every large line within CLASS_TOL (what the decision asks)."""
    stage, line = L.stage_errors(formula, led), L.class_errors(formula, led)
    assert max(abs(e) for e in stage.values()) <= L.TOL, stage
    assert max(abs(e) for e in line.values()) <= L.CLASS_TOL, line
    return line


@pytest.mark.parametrize("strategy", L.CANDIDATES)
def test_formula_matches_the_measured_ledger_per_stage_and_per_class(measured, strategy):
    line = _assert_agrees(_formula(TINY, L.LedgerConfig(strategy=strategy)), measured[strategy])
    # the large lines are checked where they are large: the step's master state everywhere...
    assert {"forward/parameters", "forward/optimizer_states", "backward/gradients",
            "optimizer_peak/gradients", "zero_grad/optimizer_states"} <= set(line)
    if strategy != "offload":  # ...and what the strategy moves: saved activations and logits
        assert "forward/saved_activations" in line and any(k.endswith("/logits_loss") for k in line)
    else:  # offload leaves no large saved line on the device
        assert not any(k.endswith("saved_activations") for k in line)


@pytest.mark.parametrize("min_bytes", [0, 2048, 2**20])
def test_formula_follows_the_offload_threshold(min_bytes):
    """Part 02 · 42's ActivationOffload keeps the storages under ``min_bytes`` on the device: none (0),
    the 1/rms vectors and targets, and (1 MiB) every activation of tiny: then offload saves nothing."""
    cfg = L.LedgerConfig(strategy="offload", offload_min_bytes=min_bytes)
    led = L.track(TINY, cfg)
    _assert_agrees(_formula(TINY, cfg), led)
    saved = led.stages["forward"]["saved_activations"]
    plain = L.track(TINY).stages["forward"]
    assert (saved == 0) == (min_bytes == 0) and (saved == plain["saved_activations"]) == (min_bytes == 2**20)


def test_what_offload_moves_arrives_on_the_host(measured):
    """Saved activations and logits the offload moved are exactly the host bytes in use after the forward."""
    plain, off = measured["plain"].stages["forward"], measured["offload"]
    moved = sum(plain[c] - off.stages["forward"][c] for c in ("saved_activations", "logits_loss"))
    assert off.host["forward"] == moved > 0 and off.host["load"] == 0


def test_host_buffers_are_host_bytes_even_when_allocated_inside_the_step():
    """The offload's pool allocates its host buffers under ``measure.host_side()`` in its first step; the
    tracker books them as host bytes (never as device bytes) there as in a steady step that reuses them."""
    from bp_mech.ledger_tracker import offload_hooks

    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    cfg = L.LedgerConfig(strategy="offload")
    opt, hooks = L.make_optimizer(model.parameters(), cfg, "cpu"), offload_hooks(model, cfg, "cpu")
    seen = []
    for _ in range(2):  # first step: the pool allocates; second: it reuses its buffers
        tr = L._Tracker("cpu")
        with tr:
            L.train_step(model, opt, batch, cfg, tr, hooks=hooks)
        seen.append((tr.marks["forward"][0], sum(tr.host.values()), tr.marks["forward"][2]))
    (dev1, host1, in_use1), (dev2, host2, in_use2) = seen
    assert dev1 == dev2 and host1 == host2 == hooks.pool.allocated > 0 and in_use1 == in_use2 > 0


@pytest.mark.parametrize("strategy", ["plain", "amp"])
def test_formula_follows_the_peak_to_the_end_of_the_backward(strategy):
    """Short sequences: the tied embedding's three gradient-sized tensors set the peak."""
    w = parse_workload("tiny-b1s32")
    formula = _formula(w, L.LedgerConfig(strategy=strategy))
    assert formula.moment.startswith("the end of the backward")
    _assert_agrees(formula, L.track(w, L.LedgerConfig(strategy=strategy)))


def test_fused_adamw_updates_in_place():
    """The GPU runs' AdamW is fused: no temporaries, its step counters on the device; the CPU has the
    kernel too, so the formula's fused line is checked on real tensors here."""
    cfg = L.LedgerConfig(adamw="fused")
    led = L.track(TINY, cfg)
    _assert_agrees(_formula(TINY, cfg), led)
    assert led.total("optimizer_peak") == led.total("backward")
    foreach = L.track(TINY)
    assert foreach.total("optimizer_peak") - foreach.total("backward") == L.param_bytes(ARCHITECTURES["tiny"])


@pytest.mark.parametrize("strategy", L.CANDIDATES)
def test_formula_matches_the_fake_tensor_estimate_at_qwen05(strategy):
    """The full Qwen2.5-0.5B step under fake tensors, with the GPU's settings (fused AdamW, offload
    threshold 1 MiB), per stage and per class."""
    w = parse_workload("qwen05-b2s512")
    cfg = L.LedgerConfig(strategy=strategy).for_device("cuda")
    est = L.track(w, cfg, fake=True)
    _assert_agrees(_formula(w, cfg, "cuda"), est)
    if strategy == "plain":  # the lines the chapter names: fp32 log-softmax output B*T*V*4, 2P of AdamW
        assert est.stages["forward"]["logits_loss"] >= 4 * w.batch * w.seq * 151936
        assert est.stages["zero_grad"]["optimizer_states"] >= 2 * L.param_bytes(ARCHITECTURES["qwen05"])
    if strategy == "offload":  # at 1 MiB the 512 KiB k and v of every layer stay on the device
        kv = 2 * 4 * w.batch * w.seq * 128 * ARCHITECTURES["qwen05"]["num_hidden_layers"]
        assert kv <= est.stages["forward"]["saved_activations"] < 1.1 * kv and est.host["forward"] > 3e9


def test_a_line_off_by_more_than_its_tolerance_is_tune_with_the_line_named(measured):
    """The decision uses both: a large line off by 10 % fails even where its stage total is within 5 %."""
    formula = _formula(TINY, L.LedgerConfig())
    assert L._judge(formula, measured["plain"])[:2] == ("accept", None)
    wrong = copy.deepcopy(formula)
    wrong.stages["zero_grad"]["optimizer_states"] = int(1.1 * formula.stages["zero_grad"]["optimizer_states"])
    wrong.stages["zero_grad"]["parameters"] -= wrong.stages["zero_grad"]["optimizer_states"] - \
        formula.stages["zero_grad"]["optimizer_states"]  # the stage total unchanged
    decision, next_step, m = L._judge(wrong, measured["plain"])
    assert abs(m["formula_error"]["zero_grad"]) < 1e-9 and decision == "tune"
    assert m["worst_line"] in ("zero_grad/optimizer_states", "zero_grad/parameters") and m["worst_line"] in next_step


def test_layer_storages_sum_to_the_block_formula():
    for arch in ("tiny", "qwen05"):
        assert sum(L.layer_saved_storages(ARCHITECTURES[arch], 2, 64)) == L.block_saved_bytes(ARCHITECTURES[arch], 2, 64)


def test_tracker_peak_equals_the_shared_peak_memory_tool():
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = L.make_optimizer(model.parameters(), L.LedgerConfig(), "cpu")
    L.train_step(model, opt, batch, L.LedgerConfig(), L._Tracker("cpu"))  # warm-up
    state = [v for st in opt.state.values() for v in st.values()]
    with PeakMemory("cpu", resident=[model.parameters(), model.buffers(), state, batch.values()]) as pm:
        L.train_step(model, opt, batch, L.LedgerConfig(), L._Tracker("cpu"))
    assert pm.peak_allocated == L.track(TINY).peak


def test_classes_mean_what_they_say(measured):
    P = L.param_bytes(ARCHITECTURES["tiny"])
    plain = measured["plain"].stages
    assert plain["backward"]["gradients"] == P  # the tied embedding has one .grad
    assert plain["zero_grad"]["gradients"] == 0 and plain["zero_grad"]["saved_activations"] == 0
    assert 2 * P <= plain["zero_grad"]["optimizer_states"] < 2 * P + 1024  # + 4-byte step counters
    assert plain["forward"]["saved_activations"] > 0 and plain["forward"]["gradients"] == 0
    off = measured["offload"]
    assert 0 < off.stages["forward"]["saved_activations"] < plain["forward"]["saved_activations"] / 100
    ck = measured["checkpoint"].stages["forward"]["saved_activations"]
    assert ck < plain["forward"]["saved_activations"] / 4  # only the layer inputs stay
    amp = measured["amp"].stages["forward"]
    assert amp["parameters"] > plain["forward"]["parameters"]  # autocast's half-precision weight copies
    assert measured["accumulation"].stages["forward"]["gradients"] == P  # micro-batch 1's gradients wait


LR = 1e-3  # the learning rate of the equality test's single AdamW update
ADAM_EPS = 1e-8  # torch's default AdamW eps
GRAD_RTOL = 1e-5  # float32 reordering: a gradient may differ by this relative to its tensor's max |g|


def _one_update(strategy):
    """One AdamW update of ``strategy`` from the same weights: loss, the gradients the update used
    (copied by a step pre-hook, i.e. before it), and the parameters before and after."""
    from bp_mech import checkpointing
    from bp_mech.ledger_tracker import offload_hooks

    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    cfg = L.LedgerConfig(strategy=strategy, lr=LR)
    opt = L.make_optimizer(model.parameters(), cfg, "cpu")
    grads, before = [], [p.detach().clone() for p in model.parameters()]
    opt.register_step_pre_hook(lambda *_: grads.extend(p.grad.detach().clone() for p in model.parameters()))
    hooks = offload_hooks(model, cfg, "cpu") if strategy == "offload" else None
    with checkpointing.configure(model, cfg.checkpoint):
        loss = L.train_step(model, opt, batch, cfg, L._Tracker("cpu"), hooks=hooks)
    return loss, grads, before, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["checkpoint", "offload", "accumulation"])
def test_memory_strategies_train_the_same_as_plain(strategy):
    """Compared where the comparison is well-conditioned. The gradients: equal up to float32
    reordering (accumulation sums two micro-batches; other CPUs' kernels order sums differently).
    The update: AdamW's first step moves an element by lr * g / (|g| + eps) (m_hat = g, v_hat = g^2),
    so where |g| is near eps a reordering-sized change of g (even of its sign) moves the update by up
    to 2 lr: there only that bound holds. Where |g| >= 1000 eps and |g| exceeds the gradient's
    tolerance (no sign change), the update moves by lr * (eps / |g|) * (dg / |g|) <= lr * 1e-3, plus
    the rounding of p."""
    loss0, g0, _, p0 = _one_update("plain")
    loss1, g1, _, p1 = _one_update(strategy)
    assert torch.allclose(loss0, loss1, rtol=1e-5, atol=0)  # float32: reordering only
    f32 = torch.finfo(torch.float32).eps
    for g, h, a, b in zip(g0, g1, p0, p1):
        tol = GRAD_RTOL * g.abs().max()
        assert (h - g).abs().max() <= tol, ((h - g).abs().max() / g.abs().max()).item()
        diff = (b - a).abs()  # both updates start from the same weights
        assert diff.max() <= 2 * LR * (1 + 1e-6) + 4 * f32 * a.abs().max()
        sure = (g.abs() >= 1000 * ADAM_EPS) & (g.abs() >= tol)
        assert (diff[sure] <= LR * 1e-3 + 4 * f32 * a.abs()[sure]).all(), (diff[sure] / LR).max().item()


def test_conformance_against_memtracker():
    row = L.conformance()
    assert row.passed, row.detail


def test_run_gives_three_valid_records_per_strategy(monkeypatch):
    from bp_mech import results
    from bp_mech.registry import make_context

    for name in CUDA_CALLS + ("empty_cache",):  # a CPU run never touches torch.cuda
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} on a CPU run"))
    recs = L.run(make_context("TRAIN-STATE-LEDGER", mode="cpu"))
    assert len(recs) == 3 * len(L.CANDIDATES)
    for r in recs:
        results.validate(r.to_dict())
        assert r.failure is None and r.peak_allocated > 0
    levels = {r.candidate: (r.evidence_level, r.memory_source) for r in recs}
    assert levels["plain"] == ("cpu-mechanism", "tracked-cpu")
    assert levels["plain-estimated"] == ("estimated", "fake-tensor")
    assert levels["plain-formula"] == ("theoretical", "formula")
    by = {r.candidate: r for r in recs}
    for s in L.CANDIDATES:
        for r in (by[s], by[s + "-estimated"]):  # both sources: per stage and per large line
            assert (r.decision, r.next_step) == ("accept", None)
            assert max(abs(e) for e in r.metrics["formula_error"].values()) <= L.TOL
            assert max(abs(e) for e in r.metrics["formula_class_error"].values()) <= L.CLASS_TOL
            assert "forward/optimizer_states" in r.metrics["formula_class_error"]
        assert by[s].updates == by[s + "-estimated"].updates == 2  # 1 warm-up + 1 measured optimizer step
        assert by[s + "-formula"].updates is None  # no step ran
    assert (by["amp"].updates, by["amp"].update_count, by["amp"].skipped_updates) == (2, 2, 0)
    assert (by["plain"].updates, by["plain"].update_count, by["plain"].skipped_updates) == (2, 2, None)


def test_formula_exposes_the_gpt_constant_gap():
    """The Qwen2 block is not GPT's sbh(34 + 5as/h) (fp16 bytes, with dropout masks and the
    s x s attention matrix): the real layer saves something else entirely."""
    cfg = ex43._config(ex43.SHAPES[0])
    B, T = 2, 16
    measured = ex43.measure_block_saved_bytes(cfg, B, T)
    assert L.block_saved_bytes(cfg, B, T) == measured
    s, b, h, a = T, B, cfg.hidden_size, cfg.num_attention_heads
    assert abs(s * b * h * (34 + 5 * a * s / h) - measured) / measured > 0.05


# --- the CUDA paths, exercised on the CPU ---------------------------------------------

CUDA_CALLS = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
              "max_memory_reserved")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's allocator calls replaced by a log of their names; each returns the log's length."""
    log = []
    for name in CUDA_CALLS + ("empty_cache",):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: log.append(_n) or len(log))
    return log


def test_tracker_reads_the_allocator_around_every_phase(fake_cuda):
    """On CUDA a phase's start resets the allocator's peak and the next start reads it (after a
    synchronize); a stage mark reads the allocated bytes. The device decides; tensors stay on the CPU."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tr = L._Tracker("cuda")
    L.train_step(model, opt, batch, L.LedgerConfig(), tr)
    mark = ["synchronize", "memory_allocated"]
    read = ["synchronize", "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"]
    # start forward, mark forward, start backward, mark backward, start optimizer, start zero_grad, mark, idle
    assert fake_cuda == ["reset_peak_memory_stats"] + mark + read + mark + read + read + mark + read
    phases = ("forward", "backward", "optimizer", "zero_grad")
    assert set(tr.allocator) == {"forward", "backward", "zero_grad"} | {f"{p}_{k}" for p in phases
                                                                       for k in ("peak", "reserved")}


def test_the_tracker_lets_the_model_go_after_a_step():
    """The allocator counts every live tensor: a tracker (kept alive by its own weakref callbacks
    until the cycle collector runs) must not hold the autograd graph, which holds every parameter."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tr = L._Tracker("cpu")
    with tr:
        L.train_step(model, opt, batch, L.LedgerConfig(), tr)
    param = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    del model, opt
    gc.collect()
    assert param() is None and not tr.loss_nodes


def test_gpu_run_reports_allocator_peaks_and_survives_an_oom(monkeypatch, fake_cuda):
    """run() on its CUDA branch (the measured step replaced by a CPU one with allocator readings):
    gpu-measured records with the allocator's peaks, memory freed before each strategy, estimates
    with the foreach AdamW, and an out-of-memory strategy recorded as its failure."""
    from bp_mech import registry, results

    real_env, real_track, calls = registry.environment_fields, L.track, []
    monkeypatch.setattr(registry, "environment_fields", lambda profile, device="cpu": dict(
        real_env(profile, "cpu"), cuda="13.0", device_name="NVIDIA H200", device_memory=150_000_000_000))

    def track(w, cfg=L.LedgerConfig(), device="cpu", fake=False):
        calls.append((cfg.strategy, (cfg.adamw, cfg.offload_min_bytes), str(device), fake))
        if fake:
            return real_track(w, cfg, fake=True)
        if cfg.strategy == "offload":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        led = real_track(w, cfg)
        led.allocator = dict(forward=1, forward_peak=10, backward_peak=30, forward_reserved=40, backward_reserved=20)
        return led

    monkeypatch.setattr(L, "track", track)
    monkeypatch.setattr(L, "CANDIDATES", ("plain", "offload"))
    recs = {r.candidate: r for r in L.run(registry.make_context("TRAIN-STATE-LEDGER", "real_gpu", "tiny-b2s64"))}
    plain = recs["plain"]
    assert (plain.evidence_level, plain.memory_source) == ("gpu-measured", "cuda-allocator")
    assert (plain.peak_allocated, plain.peak_reserved) == (30, 40)
    assert recs["offload"].failure.startswith("out of memory") and recs["offload-formula"].peak_allocated > 0
    assert (recs["plain-estimated"].evidence_level, recs["plain-estimated"].memory_source) == ("estimated",
                                                                                              "fake-tensor")
    assert {flavour for _, flavour, _, fake in calls} == {("fused", 2**20)}  # the GPU's, estimate included
    assert [dev for *_, dev, fake in calls if not fake] == ["cuda"] * len(L.CANDIDATES)
    assert fake_cuda.count("empty_cache") == len(L.CANDIDATES)
    for r in recs.values():
        results.validate(r.to_dict())


def test_a_skipped_warm_up_step_is_retried_and_counted(monkeypatch):
    """AMP: a step the GradScaler skips (inf/NaN) allocates no AdamW state. track() warms up again,
    so the measured step is still steady-state, and the skip is counted."""
    class SkipOnce(torch.amp.GradScaler):  # an infinite first scale: the first step overflows
        def __init__(self, device):
            super().__init__(device, init_scale=float("inf"))

        def update(self, new_scale=None):
            super().update(2.0**16 if self.get_scale() == float("inf") else new_scale)

    monkeypatch.setattr(torch.amp, "GradScaler", SkipOnce)
    led = L.track(TINY, L.LedgerConfig(strategy="amp"))
    assert (led.updates, led.skipped, led.finite) == (3, 1, True)
    formula = L.theoretical(ARCHITECTURES["tiny"], TINY.batch, TINY.seq, L.LedgerConfig(strategy="amp"))
    assert max(abs(e) for e in L.stage_errors(formula, led).values()) <= L.TOL


def test_formula_on_cuda_counts_the_step_counters_where_adamw_keeps_them():
    """Fused (the GPU runs' default): counters on the device, no temporaries. foreach on CUDA: the
    counters are host scalars, and the update takes one temporary per tensor (W in all)."""
    a = ARCHITECTURES["qwen05"]
    cpu, fused, foreach = (L.theoretical(a, 2, 512, L.LedgerConfig(adamw=f), dev)
                           for f, dev in (("foreach", "cpu"), ("fused", "cuda"), ("foreach", "cuda")))
    n_tensors = 2 + a["num_hidden_layers"] * 12  # embedding (tied), final norm, 12 per layer
    assert cpu.total("zero_grad") == fused.total("zero_grad") == foreach.total("zero_grad") + 4 * n_tensors
    assert fused.total("optimizer_peak") == fused.total("backward")
    assert foreach.total("optimizer_peak") == foreach.total("backward") + L.param_bytes(a)
    assert L.theoretical(a, 2, 512, L.LedgerConfig(), "cuda").stages == fused.stages  # fused by default
    assert L.LedgerConfig().for_device("cpu").adamw == "foreach"


def test_dry_run_plan_for_qwen05():
    from bp_mech import registry

    p = registry.plan(registry.make_context("TRAIN-STATE-LEDGER", "dry_run", "qwen05-b2s512"))
    assert p["candidates"] == list(L.CANDIDATES) and (p["tolerance"], p["class_tolerance"]) == (L.TOL, L.CLASS_TOL)
    assert 8e9 < p["formula_peak_bytes_cuda"]["checkpoint"] < p["formula_peak_bytes_cuda"]["plain"] < 12e9


# --- the GPU records of 11, 19, 42 and AMP, matched by name (synthetic records) -----------

def _gpu_record(sid, candidate, peak, workload="qwen05-b2s512", run_label="gpu-synthetic", updates=24, **fields):
    """A GPU record as the GPU suite writes one, made up here (temporary directory only)."""
    from bp_mech import registry, results

    w = parse_workload(workload)
    fields = dict(dict(effective_batch=w.batch, input_shape=[w.batch, w.seq]), **fields)
    return results.Record(semantic_id=sid, workload_id=workload, run_label=run_label, page=registry.get(sid).page,
                          candidate=candidate, model_id="Qwen/Qwen2.5-0.5B", model_commit="config-synthetic",
                          model_source="config", dtype="float32", seed=0, evidence_level="gpu-measured",
                          memory_source="cuda-allocator", cuda="12.8", device_name="synthetic",
                          peak_allocated=peak, updates=updates, **fields)


@pytest.fixture
def gpu_dir(tmp_path, monkeypatch):
    from bp_mech import report

    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)  # the directory report.cached reads
    return tmp_path


def _peak(cfg, batch=2, seq=512):
    return L.theoretical(ARCHITECTURES["qwen05"], batch, seq, cfg.for_device("cuda"), "cuda").peak


def test_gpu_records_are_matched_to_the_ledger_by_name(gpu_dir):
    from bp_mech.results import save_record

    off = L.LedgerConfig("offload")
    records = [_gpu_record("TRAIN-CHECKPOINT", "plain", int(_peak(L.LedgerConfig()) / 1.02)),
               _gpu_record("TRAIN-CHECKPOINT", "checkpoint-all", _peak(L.LedgerConfig("checkpoint"))),
               _gpu_record("TRAIN-CHECKPOINT", "checkpoint-mlp", 7_000_000_000),
               _gpu_record("TRAIN-OFFLOAD", "offload", _peak(off)),
               _gpu_record("TRAIN-AMP-BACKWARD", "bf16-amp", _peak(L.LedgerConfig("amp", amp_dtype="bfloat16"))),
               _gpu_record("TRAIN-GRADIENT-ACCUMULATION", "micro2", _peak(L.LedgerConfig("accumulation"), 8, 256),
                           workload="qwen05-b2s256", run_label="gpu-default-s256", effective_batch=8,
                           input_shape=[4, 256])]
    for r in records:
        save_record(r, gpu_dir)
    rows = {(r["experiment"], r["candidate"]): r for r in L.gpu_references()}
    assert len(rows) == len(records)
    plain = rows["TRAIN-CHECKPOINT", "plain"]
    assert plain["ledger"] == "plain, fused AdamW" and plain["formula_error"] == pytest.approx(0.02, abs=1e-6)
    assert rows["TRAIN-CHECKPOINT", "checkpoint-all"]["ledger"].startswith("checkpoint")
    assert rows["TRAIN-OFFLOAD", "offload"]["ledger"] == "offload (min 1048576 B), fused AdamW"
    assert rows["TRAIN-AMP-BACKWARD", "bf16-amp"]["ledger"] == "amp bfloat16, fused AdamW"
    acc = rows["TRAIN-GRADIENT-ACCUMULATION", "micro2"]  # the effective batch of 8 in 2 micro-batches of 4
    assert acc["ledger"] == "accumulation x2, fused AdamW" and acc["formula_error"] == 0
    for k in [("TRAIN-CHECKPOINT", "checkpoint-all"), ("TRAIN-OFFLOAD", "offload"), ("TRAIN-AMP-BACKWARD", "bf16-amp")]:
        assert rows[k]["formula_error"] == 0, rows[k]
    mlp = rows["TRAIN-CHECKPOINT", "checkpoint-mlp"]  # stated, not compared
    assert mlp["note"].startswith("no ledger counterpart") and mlp["formula_peak"] is None


def test_every_candidate_of_the_gpu_experiments_has_an_entry():
    from bp_mech import accumulation, amp, checkpointing, offload

    for sid, mod in (("TRAIN-CHECKPOINT", checkpointing), ("TRAIN-OFFLOAD", offload),
                     ("TRAIN-AMP-BACKWARD", amp), ("TRAIN-GRADIENT-ACCUMULATION", accumulation)):
        for c in mod.CANDIDATES:
            entry = L.GPU_COUNTERPARTS[sid, c]
            assert isinstance(entry, L.LedgerConfig) or entry.startswith("no ledger counterpart: ")


def test_a_gpu_record_without_a_counterpart_entry_fails_loudly(gpu_dir):
    from bp_mech.results import save_record

    save_record(_gpu_record("TRAIN-OFFLOAD", "offload-nvme", 5_000_000_000), gpu_dir)
    with pytest.raises(ValueError, match=r"TRAIN-OFFLOAD record .*offload-nvme.*GPU_COUNTERPARTS"):
        L.gpu_references()


def test_the_optimizer_state_is_counted_on_both_sides(gpu_dir):
    """The formula's peak holds AdamW's moments (2W + the fused step counters on the device); a GPU
    record counts them only if its step ran an update, so a record that ran none is refused."""
    from bp_mech.results import save_record

    a, cfg = ARCHITECTURES["qwen05"], L.LedgerConfig()
    n_tensors = 2 + a["num_hidden_layers"] * 12
    save_record(_gpu_record("TRAIN-CHECKPOINT", "plain", _peak(cfg)), gpu_dir)
    (row,) = L.gpu_references()
    assert row["formula_optimizer_states"] == 2 * L.param_bytes(a) + 4 * n_tensors and row["formula_error"] == 0
    save_record(_gpu_record("TRAIN-CHECKPOINT", "plain", _peak(cfg) - row["formula_optimizer_states"], updates=0),
                gpu_dir)  # the same run without an update: its peak lacks the moments
    with pytest.raises(ValueError, match=r"TRAIN-CHECKPOINT record .*'plain'.*updates=0.*no optimizer state"):
        L.gpu_references()


def test_no_gpu_record_no_rows(gpu_dir):
    assert L.gpu_references() == []


# --- the exercise checks catch the classic mistakes -----------------------------------

def _solutions(**overrides):
    m = types.SimpleNamespace(param_bytes=L.param_bytes, grad_bytes=L.grad_bytes,
                              adam_state_bytes=L.adam_state_bytes, block_saved_bytes=L.block_saved_bytes)
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


def _tied_twice(cfg, nb=4):
    extra = cfg.vocab_size * cfg.hidden_size * nb if cfg.tie_word_embeddings else 0
    return L.param_bytes(cfg, nb) + extra


def _no_biases(cfg, nb=4):
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    return L.param_bytes(cfg, nb) - cfg.num_hidden_layers * (cfg.hidden_size + 2 * kv) * nb


def _sdpa_output_copied(cfg, batch, seq):  # counts o_proj's input as a second storage
    return L.block_saved_bytes(cfg, batch, seq) + 4 * batch * seq * cfg.hidden_size


def _forgot_lse(cfg, batch, seq):
    return L.block_saved_bytes(cfg, batch, seq) - 4 * batch * cfg.num_attention_heads * seq


def _gpt_constant(cfg, batch, seq):
    s, b, h, a = seq, batch, cfg.hidden_size, cfg.num_attention_heads
    return int(s * b * h * (34 + 5 * a * s / h))


def test_checks_pass_on_a_correct_solution():
    for check in ex43.CHECKS:
        check(_solutions())


@pytest.mark.parametrize("check, mutant", [
    (ex43.check_param_bytes, {"param_bytes": _tied_twice}),
    (ex43.check_param_bytes, {"param_bytes": _no_biases}),
    (ex43.check_grad_bytes, {"grad_bytes": lambda cfg, nb=4: 2 * L.param_bytes(cfg, nb)}),
    (ex43.check_grad_bytes, {"grad_bytes": _tied_twice}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: L.param_bytes(cfg, nb)}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: 2 * _tied_twice(cfg, nb)}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _sdpa_output_copied}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _forgot_lse}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _gpt_constant}),
], ids=["tied-counted-twice", "no-qkv-biases", "grads-counted-twice", "tied-grad-twice", "adam-one-moment",
        "adam-tied-twice", "sdpa-output-copied", "forgot-lse", "gpt-constant"])
def test_checks_catch_the_classic_mistakes(check, mutant):
    with pytest.raises(AssertionError):
        check(_solutions(**mutant))
