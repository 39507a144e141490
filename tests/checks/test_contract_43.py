"""Part 02 · 43: every property the checks hold (``checks/ex43.py``'s declarations, derived by ``checks.engine``)
rejects a solution that breaks exactly it, and the variant's and the prediction's checks reject the classic mistakes.
The wrong solutions a reader of the stubs' docstrings might write: ``test_contract_43_wrong.py``."""

import pytest
import torch
from conftest import mutant

from bp_mech import state_bytes
from bp_mech.checks import ex43
from tests.checks.mutants import as_tensor, leaks, rejects

EX = "ex43_state_ledger"
ANS = mutant(EX)
VALUE = r"the byte count is \d+, a real Qwen2ForCausalLM .* gives \d+ at "  # a ledger line's wrong count


def _bad(**over):
    return mutant(EX, **over)


# --- contract properties of the four ledger lines ------------------------------------------

def _float_params(cfg, nb=4):  # a division on the way: 1.2e5 bytes, a float
    return state_bytes.param_bytes(cfg, nb) / 1


def _untie(cfg, nb=4):  # "count lm_head separately": the config untied for the rest of the run
    out = state_bytes.adam_state_bytes(cfg, nb)
    cfg.tie_word_embeddings = False
    return out


def _head_dim(cfg, batch, seq):  # d stashed on the config, a field it did not have
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    return state_bytes.block_saved_bytes(cfg, batch, seq)


def _float64_as_four(cfg, nb=4):  # a dtype table with 4 and 2 only
    return state_bytes.param_bytes(cfg, min(nb, 4))


def _grads_float64_as_four(cfg, nb=4):
    return state_bytes.grad_bytes(cfg, min(nb, 4))


def _single_head(cfg, batch, seq):  # right for the chapter's shapes, wrong with one query head
    extra = 4 * batch * seq if cfg.num_attention_heads == 1 else 0
    return state_bytes.block_saved_bytes(cfg, batch, seq) + extra


def _float_block(cfg, batch, seq):
    return float(state_bytes.block_saved_bytes(cfg, batch, seq))


def _default_bytes(f, default):  # the signature's bytes_per_value default is not 4 (a float32 model)
    def g(cfg, bytes_per_value=default):
        return f(cfg, bytes_per_value)
    return g


@pytest.mark.parametrize("check, over, message", [
    (ex43.check_param_bytes, {"param_bytes": _float_params}, r"^param_bytes: the byte count is a float, expected an int"),
    (ex43.check_grad_bytes, {"grad_bytes": as_tensor(state_bytes.grad_bytes)},
     r"^grad_bytes: the byte count is a int64 tensor of shape \(\), expected an int"),
    (ex43.check_adam_state_bytes, {"adam_state_bytes": _untie},
     r"^adam_state_bytes: cfg.tie_word_embeddings was modified in place, True -> False at "),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _head_dim},
     r"^block_saved_bytes: cfg.head_dim was modified in place, None -> \d+ at cfg a Qwen2Config, batch"),
    (ex43.check_param_bytes, {"param_bytes": _float64_as_four}, rf"^param_bytes: {VALUE}.*bytes_per_value 8"),
    (ex43.check_grad_bytes, {"grad_bytes": _grads_float64_as_four}, rf"^grad_bytes: {VALUE}.*bytes_per_value 8"),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _single_head},
     r"^block_saved_bytes: the byte count is \d+, a real float32 Qwen2DecoderLayer .* gives \d+ at .*\(hidden \d+, "
     r"heads 1,"),
    (ex43.check_block_saved_bytes, {"block_saved_bytes": _float_block},
     r"^block_saved_bytes: the byte count is a float, expected an int"),
    *[(getattr(ex43, f"check_{name}"), {name: _default_bytes(getattr(state_bytes, name), 2)},
       rf"^{name}: {VALUE}cfg a Qwen2Config, bytes_per_value left out \(default 4\)")
      for name in ("param_bytes", "grad_bytes", "adam_state_bytes")],
], ids=["param-float", "grad-tensor", "adam-modifies-cfg", "block-adds-a-cfg-field", "param-float64-as-4",
        "grad-float64-as-4", "block-one-head", "block-float", "param-default-2", "grad-default-2", "adam-default-2"])
def test_contract_rejects(check, over, message):
    with pytest.raises(AssertionError, match=message):
        check(_bad(**over))


@pytest.mark.parametrize("check, name, leak, message", [
    (ex43.check_param_bytes, "param_bytes", lambda: torch.set_grad_enabled(False), "left the grad mode changed"),
    (ex43.check_grad_bytes, "grad_bytes", lambda: torch.set_default_dtype(torch.float64),
     "left the default dtype changed"),
    (ex43.check_adam_state_bytes, "adam_state_bytes", lambda: torch.manual_seed(0), "left the torch RNG state changed"),
    (ex43.check_block_saved_bytes, "block_saved_bytes", lambda: torch.set_autocast_enabled("cpu", True),
     "left the CPU autocast changed"),
    (ex43.check_gelu_mlp_saved_bytes, "gelu_mlp_saved_bytes", lambda: torch.rand(1), "left the torch RNG state"),
    (ex43.check_predict_forward_bytes, "predict_forward_bytes", lambda: torch.set_grad_enabled(False),
     "left the grad mode changed"),
], ids=["param-grad-mode", "grad-default-dtype", "adam-reseeds", "block-autocast", "gelu-draws", "predict-grad-mode"])
def test_the_global_state_is_restored(check, name, leak, message):
    rejects(EX, check, message, **{name: leaks(getattr(ANS, name), leak)})


def test_the_global_state_is_restored_also_when_raising():
    rejects(EX, ex43.check_param_bytes, r"left the grad mode changed .*also when raising",
            param_bytes=leaks(state_bytes.param_bytes, lambda: torch.set_grad_enabled(False), then=ValueError("no")))


# --- Exercise 43.5 (variant): a GELU MLP -----------------------------------------------------

def _gelu(extra_c=0, extra_i=0, nb=None, cast=int, default=4):
    def f(C, I, B, T, bytes_per_value=default):
        n = B * T
        return cast(n * (C + 2 * I + extra_c * C + extra_i * I) * (nb or bytes_per_value))
    return f


GELU_VALUE = r"the byte count is \d+, torch.nn's Linear, GELU, Linear .* gives \d+ at hidden"


@pytest.mark.parametrize("f, message", [
    (_gelu(extra_c=1), GELU_VALUE),  # the output y too
    (_gelu(extra_c=-1), GELU_VALUE),  # forgot the input x
    (_gelu(extra_i=-1), GELU_VALUE),  # h and GELU(h) as one
    (_gelu(extra_i=1), GELU_VALUE),  # GELU(h) counted twice
    (_gelu(nb=4), GELU_VALUE + r".*bytes_per_value 2"),  # always float32
    (_gelu(cast=float), r"the byte count is a float, expected an int"),
    (_gelu(default=2), GELU_VALUE + r".*bytes_per_value left out \(default 4\)"),
], ids=["output-saved", "input-forgotten", "h-and-g-one-storage", "g-twice", "always-fp32", "float", "default-2"])
def test_gelu_mlp_checks_catch_the_classic_mistakes(f, message):
    rejects(EX, ex43.check_gelu_mlp_saved_bytes, message, gelu_mlp_saved_bytes=f)


# --- Exercise 43.6 (predict, then measure) ---------------------------------------------------

def _predict(W=3, saved=1, norm=1, logits=4, cast=int):
    def f(cfg, B, T):
        n, C, V = B * T, cfg.hidden_size, cfg.vocab_size
        return cast(W * state_bytes.param_bytes(cfg) + saved * cfg.num_hidden_layers * state_bytes.block_saved_bytes(cfg, B, T)
                    + norm * 4 * n * (3 * C + 1) + logits * n * V)
    return f


def _predict_unties(cfg, B, T):  # the prediction of an untied model, by untying the config
    cfg.tie_word_embeddings = False
    return _predict()(cfg, B, T)


PREDICTED = r"the prediction is \d+, a real steady-state float32 step .* gives \d+ \(rel error .* > 0.02\) at cfg"


@pytest.mark.parametrize("f, message", [
    (_predict(W=1), PREDICTED),  # no moments
    (_predict(W=2), PREDICTED),  # one moment
    (_predict(W=4), PREDICTED),  # gradients still alive
    (_predict(saved=0), PREDICTED),  # no saved activations
    (_predict(norm=0), PREDICTED),  # the final norm forgotten
    (_predict(norm=1.25), PREDICTED),  # the final norm at 5 bytes per value
    (_predict(logits=0), PREDICTED),  # no log-probabilities
    (_predict(logits=2), PREDICTED),  # log-probabilities in 16 bits
    (_predict(cast=float), r"the prediction is a float, expected an int \(bytes\) at hidden"),
    (_predict_unties, r"cfg.tie_word_embeddings was modified in place, True -> False"),
], ids=["no-moments", "one-moment", "grads-alive", "no-activations", "no-final-norm", "norm-5-bytes", "no-logits",
        "half-logits", "float", "unties-cfg"])
def test_prediction_check_catches_the_classic_mistakes(f, message):
    rejects(EX, ex43.check_predict_forward_bytes, message, predict_forward_bytes=f)


def test_checks_pass_on_the_answers_and_every_function_has_its_check():
    for check in ex43.CHECKS:
        check(ANS)
    assert [c.tests for c in ex43.CHECKS] == ["param_bytes", "grad_bytes", "adam_state_bytes", "block_saved_bytes",
                                              "gelu_mlp_saved_bytes", "predict_forward_bytes"]
