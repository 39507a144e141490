"""TRAIN-STATE-LEDGER (Part 02 · 43): the three sources agree, the classes mean what they say,
the strategies train the same, and the exercise checks catch the classic mistakes."""

import types

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


def test_run_gives_three_valid_records_per_strategy():
    from bp_mech import results
    from bp_mech.registry import make_context

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


def test_formula_exposes_the_gpt_constant_gap():
    """The Qwen2 block is not GPT's sbh(34 + 5as/h) (fp16 bytes, with dropout masks and the
    s x s attention matrix): the real layer saves something else entirely."""
    cfg = ex43._config(ex43.SHAPES[0])
    B, T = 2, 16
    measured = ex43.measure_block_saved_bytes(cfg, B, T)
    assert L.block_saved_bytes(cfg, B, T) == measured
    s, b, h, a = T, B, cfg.hidden_size, cfg.num_attention_heads
    assert abs(s * b * h * (34 + 5 * a * s / h) - measured) / measured > 0.05


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
