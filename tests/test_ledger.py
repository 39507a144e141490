"""Part 02 · 43, the mechanism: the formula (``bp_mech.ledger``) agrees with the measured and the
fake-tensor ledger (``bp_mech.planner.lifecycle``) per stage and per class, the classes mean what they
say, and the exercise checks catch the classic mistakes. (The tracker's own behaviour on the one step:
tests/planner/test_lifecycle.py.)"""

import re

import pytest
import torch

from bp_mech import ledger, ledger_table, state_bytes
from bp_mech.planner import lifecycle
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import ARCHITECTURES, parse_workload
from bp_mech.checks import ex43, ex43_measure
from bp_mech.experiments import ledger as experiment

TINY = parse_workload("tiny-b2s64")
STRATEGIES = experiment.CANDIDATES  # plain, checkpoint-all, offload, fp16, micro2: what the formula models


@pytest.fixture(scope="module")
def measured():
    return {s: lifecycle.track(TINY, parse(s)) for s in STRATEGIES}


def _formula(w, s, device="cpu", options=StepOptions()):
    return experiment.formula(ARCHITECTURES[w.arch], w.batch, w.seq, parse(s), device, options)


def _assert_agrees(formula, led):
    """Stage totals within STAGE_TOL and every large line within CLASS_TOL (what the decision asks)."""
    stage, line = experiment.stage_errors(formula, led), experiment.class_errors(formula, led)
    assert max(abs(e) for e in stage.values()) <= experiment.STAGE_TOL, stage
    assert max(abs(e) for e in line.values()) <= experiment.CLASS_TOL, line
    return line


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_formula_matches_the_measured_ledger_per_stage_and_per_class(measured, strategy):
    line = _assert_agrees(_formula(TINY, strategy), measured[strategy])
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
    options = StepOptions(offload_min_bytes=min_bytes)
    led = lifecycle.track(TINY, parse("offload"), options=options)
    _assert_agrees(_formula(TINY, "offload", options=options), led)
    saved = led.stages["forward"]["saved_activations"]
    plain = lifecycle.track(TINY).stages["forward"]
    assert (saved == 0) == (min_bytes == 0) and (saved == plain["saved_activations"]) == (min_bytes == 2**20)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_fake_tensor_step_is_counted_as_the_real_one(measured, strategy):
    """One tracker, one offload class, real or fake tensors: at tiny the estimate is the measured ledger
    byte for byte (stages, classes, host, forward peak), but for AMP's GradScaler, which runs only on
    real tensors: its scalars (found_inf, the inverse scale: 4 bytes each) are "other" bytes the
    estimate lacks."""
    est, meas = lifecycle.track(TINY, parse(strategy), fake=True), measured[strategy]
    assert (est.host, est.forward_peak) == (meas.host, meas.forward_peak)
    for stage in ledger_table.STAGES:
        diff = {c: meas.stages[stage][c] - est.stages[stage][c] for c in ledger_table.CLASSES}
        scaler = diff.pop("other")
        assert set(diff.values()) == {0} and (scaler == 0 if strategy != "fp16" else 0 <= scaler <= 8), (stage, diff)


@pytest.mark.parametrize("strategy", ["plain", "fp16"])
def test_formula_follows_the_peak_to_the_end_of_the_backward(strategy):
    """Short sequences: the tied embedding's three gradient-sized tensors set the peak."""
    w = parse_workload("tiny-b1s32")
    formula = _formula(w, strategy)
    assert formula.moment.startswith("the end of the backward")
    _assert_agrees(formula, lifecycle.track(w, parse(strategy)))


def test_fused_adamw_updates_in_place():
    """The GPU runs' AdamW is fused: no temporaries, its step counters on the device; the CPU has the
    kernel too, so the formula's fused line is checked on real tensors here."""
    options = StepOptions(adamw="fused")
    led = lifecycle.track(TINY, options=options)
    _assert_agrees(_formula(TINY, "plain", options=options), led)
    assert led.total("optimizer_peak") == led.total("backward")
    foreach = lifecycle.track(TINY)
    assert foreach.total("optimizer_peak") - foreach.total("backward") == state_bytes.param_bytes(ARCHITECTURES["tiny"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_formula_matches_the_fake_tensor_estimate_at_qwen05(strategy):
    """The full Qwen2.5-0.5B step under fake tensors, with the GPU's settings (fused AdamW, offload
    threshold 1 MiB), per stage and per class."""
    w = parse_workload("qwen05-b2s512")
    options = StepOptions().for_device("cuda")
    est = lifecycle.track(w, parse(strategy), fake=True, options=options)
    _assert_agrees(_formula(w, strategy, "cuda", options), est)
    if strategy == "plain":  # the lines the chapter names: fp32 log-softmax output B*T*V*4, 2P of AdamW
        assert est.stages["forward"]["logits_loss"] >= 4 * w.batch * w.seq * 151936
        assert est.stages["zero_grad"]["optimizer_states"] >= 2 * state_bytes.param_bytes(ARCHITECTURES["qwen05"])
    if strategy == "offload":  # at 1 MiB the 512 KiB k and v of every layer stay on the device
        kv = 2 * 4 * w.batch * w.seq * 128 * ARCHITECTURES["qwen05"]["num_hidden_layers"]
        assert kv <= est.stages["forward"]["saved_activations"] < 1.1 * kv and est.host["forward"] > 3e9


def test_layer_storages_sum_to_the_block_formula():
    for arch in ("tiny", "qwen05"):
        a = ARCHITECTURES[arch]
        assert sum(state_bytes.layer_saved_storages(a, 2, 64)) == state_bytes.block_saved_bytes(a, 2, 64)


def test_classes_mean_what_they_say(measured):
    P = state_bytes.param_bytes(ARCHITECTURES["tiny"])
    plain = measured["plain"].stages
    assert plain["backward"]["gradients"] == P  # the tied embedding has one .grad
    assert plain["zero_grad"]["gradients"] == 0 and plain["zero_grad"]["saved_activations"] == 0
    assert 2 * P <= plain["zero_grad"]["optimizer_states"] < 2 * P + 1024  # + 4-byte step counters
    assert plain["forward"]["saved_activations"] > 0 and plain["forward"]["gradients"] == 0
    off = measured["offload"]
    assert 0 < off.stages["forward"]["saved_activations"] < plain["forward"]["saved_activations"] / 100
    ck = measured["checkpoint-all"].stages["forward"]["saved_activations"]
    assert ck < plain["forward"]["saved_activations"] / 4  # only the layer inputs stay
    amp = measured["fp16"].stages["forward"]
    assert amp["parameters"] > plain["forward"]["parameters"]  # autocast's half-precision weight copies
    assert measured["micro2"].stages["forward"]["gradients"] == P  # micro-batch 1's gradients wait


def test_formula_exposes_the_gpt_constant_gap():
    """The Qwen2 block is not GPT's sbh(34 + 5as/h) (fp16 bytes, with dropout masks and the
    s x s attention matrix): the real layer saves something else entirely."""
    cfg = ex43_measure.shape_config(ex43.SHAPES[0])
    B, T = 2, 16
    measured = ex43_measure.measure_block_saved_bytes(cfg, B, T)
    assert state_bytes.block_saved_bytes(cfg, B, T) == measured
    s, b, h, a = T, B, cfg.hidden_size, cfg.num_attention_heads
    assert abs(s * b * h * (34 + 5 * a * s / h) - measured) / measured > 0.05


def test_formula_on_cuda_counts_the_step_counters_where_adamw_keeps_them():
    """Fused (the GPU runs' default): counters on the device, no temporaries. foreach on CUDA: the
    counters are host scalars, and the update takes one temporary per tensor (W in all)."""
    a = ARCHITECTURES["qwen05"]
    cpu, fused, foreach = (ledger.theoretical(a, 2, 512, None, dev, adamw=f)
                           for f, dev in (("foreach", "cpu"), ("fused", "cuda"), ("foreach", "cuda")))
    n_tensors = 2 + a["num_hidden_layers"] * 12  # embedding (tied), final norm, 12 per layer
    assert cpu.total("zero_grad") == fused.total("zero_grad") == foreach.total("zero_grad") + 4 * n_tensors
    assert fused.total("optimizer_peak") == fused.total("backward")
    assert foreach.total("optimizer_peak") == foreach.total("backward") + state_bytes.param_bytes(a)
    assert ledger.theoretical(a, 2, 512, None, "cuda").stages == fused.stages  # fused by default
    assert StepOptions().for_device("cpu").adamw == "foreach"


def test_the_formula_says_which_strategies_it_models():
    assert all(ledger.unmodelled(parse(s)) is None for s in STRATEGIES)
    for name, why in (("chunked-loss", "chunked loss"), ("checkpoint-mlp", "every decoder layer or none"),
                      ("checkpoint-all+offload", "one strategy at a time")):
        assert why in ledger.unmodelled(parse(name))
        with pytest.raises(ValueError, match=re.escape(f"no formula for '{name}'")):
            ledger.theoretical(ARCHITECTURES["tiny"], 2, 64, parse(name))


# --- the exercise checks catch the classic mistakes -----------------------------------

def _solutions(**overrides):
    """The answers (the package's ledger lines, the variant and the prediction) with some replaced."""
    from conftest import mutant

    return mutant("ex43_state_ledger", **overrides)


def _tied_twice(cfg, nb=4):
    extra = cfg.vocab_size * cfg.hidden_size * nb if cfg.tie_word_embeddings else 0
    return state_bytes.param_bytes(cfg, nb) + extra


def _no_biases(cfg, nb=4):
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    return state_bytes.param_bytes(cfg, nb) - cfg.num_hidden_layers * (cfg.hidden_size + 2 * kv) * nb


def _sdpa_output_copied(cfg, batch, seq):  # counts o_proj's input as a second storage
    return state_bytes.block_saved_bytes(cfg, batch, seq) + 4 * batch * seq * cfg.hidden_size


def _forgot_lse(cfg, batch, seq):
    return state_bytes.block_saved_bytes(cfg, batch, seq) - 4 * batch * cfg.num_attention_heads * seq


def _gpt_constant(cfg, batch, seq):
    s, b, h, a = seq, batch, cfg.hidden_size, cfg.num_attention_heads
    return int(s * b * h * (34 + 5 * a * s / h))


def test_checks_pass_on_a_correct_solution():
    for check in ex43.CHECKS:
        check(_solutions())


@pytest.mark.parametrize("check, mutant", [
    (ex43.check_param_bytes, {"param_bytes": _tied_twice}),
    (ex43.check_param_bytes, {"param_bytes": _no_biases}),
    (ex43.check_grad_bytes, {"grad_bytes": lambda cfg, nb=4: 2 * state_bytes.param_bytes(cfg, nb)}),
    (ex43.check_grad_bytes, {"grad_bytes": _tied_twice}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: state_bytes.param_bytes(cfg, nb)}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: 2 * _tied_twice(cfg, nb)}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _sdpa_output_copied}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _forgot_lse}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _gpt_constant}),
    (ex43.check_grad_bytes, {"grad_bytes": lambda cfg, nb=4: state_bytes.grad_bytes(cfg, 4)}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: state_bytes.adam_state_bytes(cfg, 4)}),
], ids=["tied-counted-twice", "no-qkv-biases", "grads-counted-twice", "tied-grad-twice", "adam-one-moment",
        "adam-tied-twice", "sdpa-output-copied", "forgot-lse", "gpt-constant", "grads-always-float32",
        "adam-moments-always-float32"])
def test_checks_catch_the_classic_mistakes(check, mutant):
    function = check.__name__.removeprefix("check_")
    with pytest.raises(AssertionError, match=f"^{function}: "):
        check(_solutions(**mutant))


def test_the_gpu_adamw_keeps_its_step_counters_on_the_device():
    """Part 02 · 43: the book's AdamW on CUDA (fused) keeps ``state["step"]`` on the parameters'
    device; ``foreach`` keeps a host scalar. Run on fake CUDA parameters, so no GPU is needed: the
    package's optimizer construction and PyTorch's placement rule (``_init_group``) run for real;
    what the fused CUDA kernel then does with the counter does not run here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bp_mech.bench.optimizer import make_optimizer

    assert StepOptions().for_device("cuda").adamw == "fused"
    for impl, where in ((None, "cuda"), ("foreach", "cpu")):  # None: the book's choice for CUDA
        with FakeTensorMode():
            p = torch.nn.Parameter(torch.zeros(8, device="cuda"))
            opt = make_optimizer([p], StepOptions(), "cuda", adamw=impl)
            p.grad = torch.zeros_like(p)
            opt.step()
            state = opt.state[p]
        assert state["step"].device.type == where, impl
        assert state["exp_avg"].device.type == "cuda" and state["step"].dtype == torch.float32


def test_the_logits_are_the_largest_tensor_but_not_the_largest_line():
    """Part 02 · 43 at qwen05-b2s512: 4nV is larger than any parameter or saved storage, but at
    the log-softmax backward its line (3 x 4nV) is below the optimizer states, the saved
    activations and the parameters."""
    w, a = parse_workload("qwen05-b2s512"), ARCHITECTURES["qwen05"]
    f = ledger.theoretical(a, w.batch, w.seq, None, "cuda")
    assert f.moment == "the log-softmax backward" and f.peak_stage == "backward_peak"
    at = f.stages["backward_peak"]
    for line in ("optimizer_states", "saved_activations", "parameters"):
        assert at["logits_loss"] < at[line], line
    logp = 4 * w.batch * w.seq * a["vocab_size"]
    assert 3 * logp <= at["logits_loss"] < 3 * logp + 2**20
    assert logp > 4 * a["vocab_size"] * a["hidden_size"]  # the tied embedding, the largest parameter
    assert logp > max(state_bytes.layer_saved_storages(a, w.batch, w.seq))


def test_activation_strategies_stop_paying_at_the_model_state():
    """Part 02 · 43's account at qwen05-b2s512: checkpointing's and offload's peak is the end of
    the backward, where parameters, gradients and moments are (nearly) all of it, so their
    peak is the same, whatever else they remove (``experiment.peak_shares``)."""
    w, a = parse_workload("qwen05-b2s512"), ARCHITECTURES["qwen05"]
    plain = ledger.theoretical(a, w.batch, w.seq, None, "cuda")
    state = ("parameters", "gradients", "optimizer_states")
    _, share = experiment.peak_shares(plain)
    assert abs(sum(share.values()) - 1) < 1e-12 and share["saved_activations"] > 0.2
    for s in ("checkpoint-all", "offload"):
        led = ledger.theoretical(a, w.batch, w.seq, parse(s), "cuda")
        stage, share = experiment.peak_shares(led)
        assert led.moment == "the end of the backward (tied embedding)", s
        assert sum(share[c] for c in state) > 0.999 and led.peak < plain.peak
    assert ledger.theoretical(a, w.batch, w.seq, parse("checkpoint-all"), "cuda").peak == \
        ledger.theoretical(a, w.batch, w.seq, parse("offload"), "cuda").peak
