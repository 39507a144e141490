"""Part 02 · 43: every property the contract checks hold (``checks/ex43_contract.py``) rejects a solution
that breaks exactly it, and the variant's and the prediction's checks reject the classic mistakes."""

import pytest
from conftest import mutant

from bp_mech import state_bytes
from bp_mech.checks import ex43, ex43_contract
from tests.checks.mutants import as_tensor

EX = "ex43_state_ledger"
ANS = mutant(EX)


def _bad(**over):
    return mutant(EX, **over)


# --- contract properties of the four ledger lines ------------------------------------------

def _float_params(cfg, nb=4):  # a division on the way: 1.2e5 bytes, a float
    return state_bytes.param_bytes(cfg, nb) / 1


def _untie(cfg, nb=4):  # "count lm_head separately": the config untied for the rest of the run
    out = state_bytes.adam_state_bytes(cfg, nb)
    cfg.tie_word_embeddings = False
    return out


def _float64_as_four(cfg, nb=4):  # a dtype table with 4 and 2 only
    return state_bytes.param_bytes(cfg, min(nb, 4))


def _grads_float64_as_four(cfg, nb=4):
    return state_bytes.grad_bytes(cfg, min(nb, 4))


def _single_head(cfg, batch, seq):  # right for the chapter's shapes, wrong with one query head
    extra = 4 * batch * seq if cfg.num_attention_heads == 1 else 0
    return state_bytes.block_saved_bytes(cfg, batch, seq) + extra


def _float_block(cfg, batch, seq):
    return float(state_bytes.block_saved_bytes(cfg, batch, seq))


@pytest.mark.parametrize("check, over, message", [
    (ex43_contract.check_param_bytes__contract, {"param_bytes": _float_params},
     r"^param_bytes: the byte count is a float, expected an int"),
    (ex43_contract.check_grad_bytes__contract, {"grad_bytes": as_tensor(state_bytes.grad_bytes)},
     r"^grad_bytes: the byte count is a int64 tensor of shape \(\), expected an int"),
    (ex43_contract.check_adam_state_bytes__contract, {"adam_state_bytes": _untie},
     r"^adam_state_bytes: cfg was modified \(tie_word_embeddings True -> False\)"),
    (ex43_contract.check_param_bytes__contract, {"param_bytes": _float64_as_four},
     r"^param_bytes: \d+ bytes, PyTorch allocates \d+ \(-\d+\) at .*float64, bytes_per_value=8"),
    (ex43_contract.check_grad_bytes__contract, {"grad_bytes": _grads_float64_as_four},
     r"^grad_bytes: \d+ bytes, PyTorch allocates \d+ .*float64"),
    (ex43_contract.check_block_saved_bytes__contract, {"block_saved_bytes": _single_head},
     r"^block_saved_bytes: \d+ bytes, PyTorch saves \d+ \(\+\d+\) at hidden \d+, heads 1,"),
    (ex43_contract.check_block_saved_bytes__contract, {"block_saved_bytes": _float_block},
     r"^block_saved_bytes: the byte count is a float, expected an int"),
], ids=["param-float", "grad-tensor", "adam-modifies-cfg", "param-float64-as-4", "grad-float64-as-4",
        "block-one-head", "block-float"])
def test_contract_rejects(check, over, message):
    with pytest.raises(AssertionError, match=message):
        check(_bad(**over))


def _default_bytes(f, default):  # the signature's bytes_per_value default is not 4 (a float32 model)
    def g(cfg, bytes_per_value=default):
        return f(cfg, bytes_per_value)
    return g


@pytest.mark.parametrize("name", ["param_bytes", "grad_bytes", "adam_state_bytes"])
def test_the_default_bytes_per_value_is_checked(name):
    check = getattr(ex43, f"check_{name}")
    with pytest.raises(AssertionError, match=rf"^{name}: \d+ bytes, PyTorch allocates \d+ .* left at its default"):
        check(_bad(**{name: _default_bytes(getattr(state_bytes, name), 2)}))


def test_the_fixed_checks_miss_what_the_contract_catches():
    """The explored shapes and dtypes add something: these mutants pass the chapter's fixed cases."""
    ex43.check_param_bytes(_bad(param_bytes=_float64_as_four))
    ex43.check_block_saved_bytes(_bad(block_saved_bytes=_single_head))
    ex43.check_param_bytes(_bad(param_bytes=_float_params))


# --- Exercise 43.5 (variant): a GELU MLP -----------------------------------------------------

def _gelu(extra_c=0, extra_i=0, nb=None, cast=int, default=4):
    def f(C, I, B, T, bytes_per_value=default):
        n = B * T
        return cast(n * (C + 2 * I + extra_c * C + extra_i * I) * (nb or bytes_per_value))
    return f


@pytest.mark.parametrize("check, f, message", [
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(extra_c=1), r"\(\+\d+\) at hidden"),  # the output y too
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(extra_c=-1), r"\(-\d+\) at hidden"),  # forgot the input x
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(extra_i=-1), r"\(-\d+\) at hidden"),  # h and GELU(h) as one
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(extra_i=1), r"\(\+\d+\) at hidden"),  # GELU(h) counted twice
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(nb=4), r"bfloat16, bytes_per_value=2"),  # always float32
    (ex43_contract.check_gelu_mlp_saved_bytes__contract, _gelu(cast=float), r"is a float, expected an int"),
    (ex43_contract.check_gelu_mlp_saved_bytes, _gelu(default=2), r"the default bytes_per_value is 4"),
], ids=["output-saved", "input-forgotten", "h-and-g-one-storage", "g-twice", "always-fp32", "float", "default-2"])
def test_gelu_mlp_checks_catch_the_classic_mistakes(check, f, message):
    with pytest.raises(AssertionError, match="^gelu_mlp_saved_bytes: .*" + message):
        check(_bad(gelu_mlp_saved_bytes=f))


# --- Exercise 43.6 (predict, then measure) ---------------------------------------------------

def _predict(W=3, saved=1, norm=1, logits=4, cast=int):
    def f(cfg, B, T):
        n, C, V = B * T, cfg.hidden_size, cfg.vocab_size
        return cast(W * state_bytes.param_bytes(cfg) + saved * cfg.num_hidden_layers * state_bytes.block_saved_bytes(cfg, B, T)
                    + norm * 4 * n * (3 * C + 1) + logits * n * V)
    return f


@pytest.mark.parametrize("f, message", [
    (_predict(W=1), r"predicted \d+ bytes, a real step holds \d+ after its forward \(-\d+\.\d%"),  # no moments
    (_predict(W=2), r"\(-\d+\.\d%"),  # one moment
    (_predict(W=4), r"\(\+\d+\.\d%"),  # gradients still alive
    (_predict(saved=0), r"\(-\d+\.\d%"),  # no saved activations
    (_predict(norm=0), r"\(-\d+\.\d%"),  # the final norm forgotten
    (_predict(norm=1.25), r"\(\+\d+\.\d%"),  # the final norm at 5 bytes per value
    (_predict(logits=0), r"\(-\d+\.\d%"),  # no log-probabilities
    (_predict(logits=2), r"\(-\d+\.\d%"),  # log-probabilities in 16 bits
    (_predict(cast=float), r"the byte count is a float, expected an int"),
], ids=["no-moments", "one-moment", "grads-alive", "no-activations", "no-final-norm", "norm-5-bytes", "no-logits",
        "half-logits", "float"])
def test_prediction_check_catches_the_classic_mistakes(f, message):
    with pytest.raises(AssertionError, match="^predict_forward_bytes: .*" + message):
        ex43_contract.check_predict_forward_bytes(_bad(predict_forward_bytes=f))


def test_checks_pass_on_the_answers():
    for check in ex43_contract.CHECKS:
        check(ANS)
