"""Part 02 · 43, the mechanism: the formula (``bp_mech.ledger``) agrees with the measured and the
fake-tensor ledger (``bp_mech.bench.lifecycle``) per stage and per class, the classes mean what they
say, the strategies train the same, and the exercise checks catch the classic mistakes."""

import gc
import types
import weakref

import pytest
import torch

from bp_mech import ledger
from bp_mech.bench import lifecycle as ledger_measure
from bp_mech.experiments import ledger as experiment
from bp_mech.bench.tracking import PeakMemory, StorageTracker
from bp_mech.bench.workload import ARCHITECTURES, build_model, make_batches, parse_workload
from bp_mech.checks import ex43

TINY = parse_workload("tiny-b2s64")


@pytest.fixture(scope="module")
def measured():
    return {s: ledger_measure.track(TINY, ledger.LedgerConfig(strategy=s)) for s in ledger.STRATEGIES}


def _formula(w, cfg, device="cpu"):
    return ledger.theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, cfg, device)


def _assert_agrees(formula, led):
    """Stage totals within STAGE_TOL and every large line within CLASS_TOL (what the decision asks)."""
    stage, line = experiment.stage_errors(formula, led), experiment.class_errors(formula, led)
    assert max(abs(e) for e in stage.values()) <= experiment.STAGE_TOL, stage
    assert max(abs(e) for e in line.values()) <= experiment.CLASS_TOL, line
    return line


@pytest.mark.parametrize("strategy", ledger.STRATEGIES)
def test_formula_matches_the_measured_ledger_per_stage_and_per_class(measured, strategy):
    line = _assert_agrees(_formula(TINY, ledger.LedgerConfig(strategy=strategy)), measured[strategy])
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
    cfg = ledger.LedgerConfig(strategy="offload", offload_min_bytes=min_bytes)
    led = ledger_measure.track(TINY, cfg)
    _assert_agrees(_formula(TINY, cfg), led)
    saved = led.stages["forward"]["saved_activations"]
    plain = ledger_measure.track(TINY).stages["forward"]
    assert (saved == 0) == (min_bytes == 0) and (saved == plain["saved_activations"]) == (min_bytes == 2**20)


@pytest.mark.parametrize("strategy", ledger.STRATEGIES)
def test_the_fake_tensor_step_is_counted_as_the_real_one(measured, strategy):
    """One tracker, one offload class, real or fake tensors: at tiny the estimate is the measured ledger
    byte for byte (stages, classes, host, forward peak), but for AMP's GradScaler, which runs only on
    real tensors: its scalars (found_inf, the inverse scale: 4 bytes each) are "other" bytes the
    estimate lacks."""
    est, meas = ledger_measure.track(TINY, ledger.LedgerConfig(strategy=strategy), fake=True), measured[strategy]
    assert (est.host, est.forward_peak) == (meas.host, meas.forward_peak)
    for stage in ledger.STAGES:
        diff = {c: meas.stages[stage][c] - est.stages[stage][c] for c in ledger.CLASSES}
        scaler = diff.pop("other")
        assert set(diff.values()) == {0} and (scaler == 0 if strategy != "amp" else 0 <= scaler <= 8), (stage, diff)


def test_what_offload_moves_arrives_on_the_host(measured):
    """Saved activations and logits the offload moved are exactly the host bytes in use after the forward."""
    plain, off = measured["plain"].stages["forward"], measured["offload"]
    moved = sum(plain[c] - off.stages["forward"][c] for c in ("saved_activations", "logits_loss"))
    assert off.host["forward"] == moved > 0 and off.host["load"] == 0


def test_host_buffers_are_host_bytes_even_when_allocated_inside_the_step():
    """The offload's pool allocates its host buffers under ``tracking.host_side()`` in its first step; the
    tracker books them as host bytes (never as device bytes) there as in a steady step that reuses them."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    cfg = ledger.LedgerConfig(strategy="offload")
    opt = ledger_measure.make_optimizer(model.parameters(), cfg, "cpu")
    hooks = ledger_measure.offload_hooks(model, cfg, "cpu")
    seen = []
    for _ in range(2):  # first step: the pool allocates; second: it reuses its buffers
        tr = StorageTracker("cpu")
        with tr:
            ledger_measure.train_step(model, opt, batch, cfg, tr, hooks=hooks)
        seen.append((tr.marks["forward"][0], sum(tr.host.values()), tr.marks["forward"][2]))
    (dev1, host1, in_use1), (dev2, host2, in_use2) = seen
    assert dev1 == dev2 and host1 == host2 == hooks.pool.allocated > 0 and in_use1 == in_use2 > 0


@pytest.mark.parametrize("strategy", ["plain", "amp"])
def test_formula_follows_the_peak_to_the_end_of_the_backward(strategy):
    """Short sequences: the tied embedding's three gradient-sized tensors set the peak."""
    w = parse_workload("tiny-b1s32")
    formula = _formula(w, ledger.LedgerConfig(strategy=strategy))
    assert formula.moment.startswith("the end of the backward")
    _assert_agrees(formula, ledger_measure.track(w, ledger.LedgerConfig(strategy=strategy)))


def test_fused_adamw_updates_in_place():
    """The GPU runs' AdamW is fused: no temporaries, its step counters on the device; the CPU has the
    kernel too, so the formula's fused line is checked on real tensors here."""
    cfg = ledger.LedgerConfig(adamw="fused")
    led = ledger_measure.track(TINY, cfg)
    _assert_agrees(_formula(TINY, cfg), led)
    assert led.total("optimizer_peak") == led.total("backward")
    foreach = ledger_measure.track(TINY)
    assert foreach.total("optimizer_peak") - foreach.total("backward") == ledger.param_bytes(ARCHITECTURES["tiny"])


@pytest.mark.parametrize("strategy", ledger.STRATEGIES)
def test_formula_matches_the_fake_tensor_estimate_at_qwen05(strategy):
    """The full Qwen2.5-0.5B step under fake tensors, with the GPU's settings (fused AdamW, offload
    threshold 1 MiB), per stage and per class."""
    w = parse_workload("qwen05-b2s512")
    cfg = ledger.LedgerConfig(strategy=strategy).for_device("cuda")
    est = ledger_measure.track(w, cfg, fake=True)
    _assert_agrees(_formula(w, cfg, "cuda"), est)
    if strategy == "plain":  # the lines the chapter names: fp32 log-softmax output B*T*V*4, 2P of AdamW
        assert est.stages["forward"]["logits_loss"] >= 4 * w.batch * w.seq * 151936
        assert est.stages["zero_grad"]["optimizer_states"] >= 2 * ledger.param_bytes(ARCHITECTURES["qwen05"])
    if strategy == "offload":  # at 1 MiB the 512 KiB k and v of every layer stay on the device
        kv = 2 * 4 * w.batch * w.seq * 128 * ARCHITECTURES["qwen05"]["num_hidden_layers"]
        assert kv <= est.stages["forward"]["saved_activations"] < 1.1 * kv and est.host["forward"] > 3e9


def test_layer_storages_sum_to_the_block_formula():
    for arch in ("tiny", "qwen05"):
        a = ARCHITECTURES[arch]
        assert sum(ledger.layer_saved_storages(a, 2, 64)) == ledger.block_saved_bytes(a, 2, 64)


def test_tracker_peak_equals_the_shared_peak_memory_tool():
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = ledger_measure.make_optimizer(model.parameters(), ledger.LedgerConfig(), "cpu")
    ledger_measure.train_step(model, opt, batch, ledger.LedgerConfig(), StorageTracker("cpu"))  # warm-up
    state = [v for st in opt.state.values() for v in st.values()]
    with PeakMemory("cpu", resident=[model.parameters(), model.buffers(), state, batch.values()]) as pm:
        ledger_measure.train_step(model, opt, batch, ledger.LedgerConfig(), StorageTracker("cpu"))
    assert pm.peak_allocated == ledger_measure.track(TINY).peak


def test_classes_mean_what_they_say(measured):
    P = ledger.param_bytes(ARCHITECTURES["tiny"])
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
    
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    cfg = ledger.LedgerConfig(strategy=strategy, lr=LR)
    opt = ledger_measure.make_optimizer(model.parameters(), cfg, "cpu")
    grads, before = [], [p.detach().clone() for p in model.parameters()]
    opt.register_step_pre_hook(lambda *_: grads.extend(p.grad.detach().clone() for p in model.parameters()))
    hooks = ledger_measure.offload_hooks(model, cfg, "cpu") if strategy == "offload" else None
    with checkpointing.configure(model, cfg.checkpoint):
        loss = ledger_measure.train_step(model, opt, batch, cfg, StorageTracker("cpu"), hooks=hooks)
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


def test_formula_exposes_the_gpt_constant_gap():
    """The Qwen2 block is not GPT's sbh(34 + 5as/h) (fp16 bytes, with dropout masks and the
    s x s attention matrix): the real layer saves something else entirely."""
    cfg = ex43._config(ex43.SHAPES[0])
    B, T = 2, 16
    measured = ex43.measure_block_saved_bytes(cfg, B, T)
    assert ledger.block_saved_bytes(cfg, B, T) == measured
    s, b, h, a = T, B, cfg.hidden_size, cfg.num_attention_heads
    assert abs(s * b * h * (34 + 5 * a * s / h) - measured) / measured > 0.05


# --- the CUDA paths, exercised on the CPU ---------------------------------------------



def test_tracker_reads_the_allocator_around_every_phase(fake_cuda):
    """On CUDA a phase's start resets the allocator's peak and the next start reads it (after a
    synchronize); a stage mark reads the allocated bytes. The device decides; tensors stay on the CPU."""
    model, batch = build_model(TINY), make_batches(TINY, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tr = StorageTracker("cuda")
    ledger_measure.train_step(model, opt, batch, ledger.LedgerConfig(), tr)
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
    tr = StorageTracker("cpu")
    with tr:
        ledger_measure.train_step(model, opt, batch, ledger.LedgerConfig(), tr)
    param = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    del model, opt
    gc.collect()
    assert param() is None and not tr.loss_nodes


def test_a_skipped_warm_up_step_is_retried_and_counted(monkeypatch):
    """AMP: a step the GradScaler skips (inf/NaN) allocates no AdamW state. track() warms up again,
    so the measured step is still steady-state, and the skip is counted."""
    class SkipOnce(torch.amp.GradScaler):  # an infinite first scale: the first step overflows
        def __init__(self, device):
            super().__init__(device, init_scale=float("inf"))

        def update(self, new_scale=None):
            super().update(2.0**16 if self.get_scale() == float("inf") else new_scale)

    monkeypatch.setattr(torch.amp, "GradScaler", SkipOnce)
    led = ledger_measure.track(TINY, ledger.LedgerConfig(strategy="amp"))
    assert (led.updates, led.skipped, led.finite) == (3, 1, True)
    formula = ledger.theoretical(ARCHITECTURES["tiny"], TINY.batch, TINY.seq, ledger.LedgerConfig(strategy="amp"))
    assert max(abs(e) for e in experiment.stage_errors(formula, led).values()) <= experiment.STAGE_TOL


def test_formula_on_cuda_counts_the_step_counters_where_adamw_keeps_them():
    """Fused (the GPU runs' default): counters on the device, no temporaries. foreach on CUDA: the
    counters are host scalars, and the update takes one temporary per tensor (W in all)."""
    a = ARCHITECTURES["qwen05"]
    cpu, fused, foreach = (ledger.theoretical(a, 2, 512, ledger.LedgerConfig(adamw=f), dev)
                           for f, dev in (("foreach", "cpu"), ("fused", "cuda"), ("foreach", "cuda")))
    n_tensors = 2 + a["num_hidden_layers"] * 12  # embedding (tied), final norm, 12 per layer
    assert cpu.total("zero_grad") == fused.total("zero_grad") == foreach.total("zero_grad") + 4 * n_tensors
    assert fused.total("optimizer_peak") == fused.total("backward")
    assert foreach.total("optimizer_peak") == foreach.total("backward") + ledger.param_bytes(a)
    assert ledger.theoretical(a, 2, 512, ledger.LedgerConfig(), "cuda").stages == fused.stages  # fused by default
    assert ledger.LedgerConfig().for_device("cpu").adamw == "foreach"


# --- the exercise checks catch the classic mistakes -----------------------------------

def _solutions(**overrides):
    m = types.SimpleNamespace(param_bytes=ledger.param_bytes, grad_bytes=ledger.grad_bytes,
                              adam_state_bytes=ledger.adam_state_bytes, block_saved_bytes=ledger.block_saved_bytes)
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


def _tied_twice(cfg, nb=4):
    extra = cfg.vocab_size * cfg.hidden_size * nb if cfg.tie_word_embeddings else 0
    return ledger.param_bytes(cfg, nb) + extra


def _no_biases(cfg, nb=4):
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    return ledger.param_bytes(cfg, nb) - cfg.num_hidden_layers * (cfg.hidden_size + 2 * kv) * nb


def _sdpa_output_copied(cfg, batch, seq):  # counts o_proj's input as a second storage
    return ledger.block_saved_bytes(cfg, batch, seq) + 4 * batch * seq * cfg.hidden_size


def _forgot_lse(cfg, batch, seq):
    return ledger.block_saved_bytes(cfg, batch, seq) - 4 * batch * cfg.num_attention_heads * seq


def _gpt_constant(cfg, batch, seq):
    s, b, h, a = seq, batch, cfg.hidden_size, cfg.num_attention_heads
    return int(s * b * h * (34 + 5 * a * s / h))


def test_checks_pass_on_a_correct_solution():
    for check in ex43.CHECKS:
        check(_solutions())


@pytest.mark.parametrize("check, mutant", [
    (ex43.check_param_bytes, {"param_bytes": _tied_twice}),
    (ex43.check_param_bytes, {"param_bytes": _no_biases}),
    (ex43.check_grad_bytes, {"grad_bytes": lambda cfg, nb=4: 2 * ledger.param_bytes(cfg, nb)}),
    (ex43.check_grad_bytes, {"grad_bytes": _tied_twice}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: ledger.param_bytes(cfg, nb)}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: 2 * _tied_twice(cfg, nb)}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _sdpa_output_copied}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _forgot_lse}),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _gpt_constant}),
    (ex43.check_grad_bytes, {"grad_bytes": lambda cfg, nb=4: ledger.grad_bytes(cfg, 4)}),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": lambda cfg, nb=4: ledger.adam_state_bytes(cfg, 4)}),
], ids=["tied-counted-twice", "no-qkv-biases", "grads-counted-twice", "tied-grad-twice", "adam-one-moment",
        "adam-tied-twice", "sdpa-output-copied", "forgot-lse", "gpt-constant", "grads-always-float32",
        "adam-moments-always-float32"])
def test_checks_catch_the_classic_mistakes(check, mutant):
    function = check.__name__.removeprefix("check_")
    with pytest.raises(AssertionError, match=f"^{function}: "):
        check(_solutions(**mutant))
