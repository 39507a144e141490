"""TRAIN-STATE-LEDGER (Part 02 · 43): the three sources agree, the classes mean what they say,
the strategies train the same, and the exercise checks catch the classic mistakes."""

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


@pytest.mark.parametrize("strategy", L.CANDIDATES)
def test_formula_matches_the_measured_ledger_at_every_stage(measured, strategy):
    formula = L.theoretical(ARCHITECTURES["tiny"], TINY.batch, TINY.seq, L.LedgerConfig(strategy=strategy))
    errors = L.stage_errors(formula, measured[strategy])
    assert max(abs(e) for e in errors.values()) <= L.TOL, errors


@pytest.mark.parametrize("strategy", ["plain", "amp"])
def test_formula_follows_the_peak_to_the_end_of_the_backward(strategy):
    """Short sequences: the tied embedding's three gradient-sized tensors set the peak."""
    w = parse_workload("tiny-b1s32")
    formula = L.theoretical(ARCHITECTURES["tiny"], w.batch, w.seq, L.LedgerConfig(strategy=strategy))
    assert formula.moment.startswith("the end of the backward")
    errors = L.stage_errors(formula, L.track(w, L.LedgerConfig(strategy=strategy)))
    assert max(abs(e) for e in errors.values()) <= L.TOL, errors


def test_formula_matches_the_fake_tensor_estimate_at_qwen05():
    w = parse_workload("qwen05-b2s512")
    cfg = L.LedgerConfig(foreach=True)  # AdamW's CUDA default
    est = L.track(w, cfg, fake=True)
    formula = L.theoretical(ARCHITECTURES["qwen05"], w.batch, w.seq, cfg)
    assert max(abs(e) for e in L.stage_errors(formula, est).values()) <= L.TOL
    # the lines the chapter names: fp32 log-softmax output B*T*V*4 after the forward, 2P of AdamW
    assert est.stages["forward"]["logits_loss"] >= 4 * w.batch * w.seq * 151936
    assert est.stages["zero_grad"]["optimizer_states"] >= 2 * L.param_bytes(ARCHITECTURES["qwen05"])


def test_tracker_peak_equals_the_shared_peak_memory_tool():
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
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
    assert off.stages["forward"]["saved_activations"] == 0 and off.host["forward"] > 0
    ck = measured["checkpoint"].stages["forward"]["saved_activations"]
    assert ck < plain["forward"]["saved_activations"] / 4  # only the layer inputs stay
    amp = measured["amp"].stages["forward"]
    assert amp["parameters"] > plain["forward"]["parameters"]  # autocast's half-precision weight copies
    assert measured["accumulation"].stages["forward"]["gradients"] == P  # micro-batch 1's gradients wait


def _one_update(strategy):
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = L.LedgerConfig(strategy=strategy)
    if strategy == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss = L.train_step(model, opt, batch, cfg, L._Tracker("cpu"))
    return loss, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["checkpoint", "offload", "accumulation"])
def test_memory_strategies_train_the_same_as_plain(strategy):
    loss0, p0 = _one_update("plain")
    loss1, p1 = _one_update(strategy)
    assert torch.allclose(loss0, loss1, rtol=1e-5, atol=0)  # float32: reordering only
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


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
    assert all(r.decision == "accept" for r in recs if not r.candidate.endswith("-formula"))
    by = {r.candidate: r for r in recs}
    assert (by["amp"].update_count, by["amp"].skipped_updates) == (2, 0)
    assert (by["plain"].update_count, by["plain"].skipped_updates) == (2, None)


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
        calls.append((cfg.strategy, cfg.foreach, str(device), fake))
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
    assert {foreach for _, foreach, _, fake in calls if fake} == {True}  # AdamW's CUDA default
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


def test_formula_on_cuda_keeps_step_counters_on_the_host_and_uses_foreach():
    a = ARCHITECTURES["qwen05"]
    cpu, cuda = (L.theoretical(a, 2, 512, L.LedgerConfig(foreach=True), dev) for dev in ("cpu", "cuda"))
    n_tensors = 2 + a["num_hidden_layers"] * 12  # embedding (tied), final norm, 12 per layer
    assert cpu.total("zero_grad") - cuda.total("zero_grad") == 4 * n_tensors
    assert L.theoretical(a, 2, 512, L.LedgerConfig(), "cuda").stages == cuda.stages  # foreach by default


def test_dry_run_plan_for_qwen05():
    from bp_mech import registry

    p = registry.plan(registry.make_context("TRAIN-STATE-LEDGER", "dry_run", "qwen05-b2s512"))
    assert p["candidates"] == list(L.CANDIDATES) and p["tolerance"] == L.TOL
    assert 8e9 < p["formula_peak_bytes_cuda"]["checkpoint"] < p["formula_peak_bytes_cuda"]["plain"] < 12e9


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
