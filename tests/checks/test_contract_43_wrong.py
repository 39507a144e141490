"""Part 02 · 43: wrong solutions a reader of the stubs' docstrings might write (not wrappers of the answers: each is
written from ``exercises/ex43_state_ledger.py`` alone, with one slip), and the check that rejects each."""

import pytest
from conftest import mutant

from bp_mech.checks import ex43
from tests.checks.mutants import caught_by

EX = "ex43_state_ledger"


def _sizes(cfg):
    C, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    return C, C // H * KV, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.tie_word_embeddings


def _params(cfg, *, tied_twice=False, biases=True, kv_as_heads=False, final_norm=True, norms=2, o_bias=False):
    """The parameter count as the docstring of ``param_bytes`` walks it, with the slips as switches."""
    C, Ckv, I, V, L, tied = _sizes(cfg)
    Ckv = C if kv_as_heads else Ckv
    layer = C * C + 2 * Ckv * C + C * C + 3 * C * I + norms * C + (C + 2 * Ckv if biases else 0) + (C if o_bias else 0)
    return V * C * (1 if tied and not tied_twice else 2) + L * layer + (C if final_norm else 0)


def _bytes(**slip):
    def f(cfg, bytes_per_value=4):
        return _params(cfg, **slip) * bytes_per_value
    return f


def _fp16_as_4(cfg, bytes_per_value=4):  # "16 bits is half of float32... of float64": 2 read as 4
    return _params(cfg) * (4 if bytes_per_value == 2 else bytes_per_value)


def _grads_plus_tied(cfg, bytes_per_value=4):  # "contributions from two places": two .grad for a tied weight
    C, _, _, V, _, tied = _sizes(cfg)
    return (_params(cfg) + (V * C if tied else 0)) * bytes_per_value


def _grads_trainable_layers_only(cfg, bytes_per_value=4):  # the embedding "is a lookup, not a matmul": no .grad
    C, _, _, V, _, tied = _sizes(cfg)
    return (_params(cfg) - V * C * (1 if tied else 2)) * bytes_per_value


def _adam(moments=2, counters=False, nb=None):
    def f(cfg, bytes_per_value=4):
        n = moments * _params(cfg) * (nb or bytes_per_value)
        return n + (4 * (2 + 12 * cfg.num_hidden_layers) if counters else 0)  # + the step counters left out
    return f


def _block(*, lse=True, rsqrt=True, input_=True, kv_as_heads=False, probs=False, o_copy=False, swiglu=4,
           lse_bytes=4, residual_twice=False):
    """The walk of ``block_saved_bytes``'s docstring, float32, with the slips as switches."""
    def f(cfg, batch, seq):
        C, Ckv, I, _, _, _ = _sizes(cfg)
        H, n = cfg.num_attention_heads, batch * seq
        Ckv = C if kv_as_heads else Ckv
        norm = 3 * C + (1 if rsqrt else 0)  # x, x * rsqrt, the output; the (n, 1) rsqrt
        values = 2 * norm + (C + 2 * Ckv) + C + swiglu * I + (C if o_copy else 0) + (C if residual_twice else 0)
        values -= 0 if input_ else C
        out = 4 * n * values + (lse_bytes * batch * H * seq if lse else 0)
        return out + (4 * batch * H * seq * seq if probs else 0)
    return f


def _gelu(c=1, i=2, nb=None):
    def f(hidden, intermediate, batch, seq, bytes_per_value=4):
        return batch * seq * (c * hidden + i * intermediate) * (nb or bytes_per_value)
    return f


def _gelu_seq_only(hidden, intermediate, batch, seq, bytes_per_value=4):  # n read as seq (one sequence)
    return seq * (hidden + 2 * intermediate) * bytes_per_value


def _predict(moments=2, grads=0, logits=4, norm=True, layers_minus=0):
    def f(cfg, batch, seq):
        C, _, _, V, L, _ = _sizes(cfg)
        n = batch * seq
        saved = (L - layers_minus) * _block()(cfg, batch, seq)
        return (1 + moments + grads) * _params(cfg) * 4 + saved + (4 * n * (3 * C + 1) if norm else 0) + logits * n * V
    return f


WRONG = {
    "param_bytes": [_bytes(tied_twice=True), _bytes(biases=False), _bytes(kv_as_heads=True), _bytes(final_norm=False),
                    _bytes(norms=1), _bytes(o_bias=True), _fp16_as_4],
    "grad_bytes": [_grads_plus_tied, _grads_trainable_layers_only, _bytes(kv_as_heads=True), _fp16_as_4,
                   lambda cfg, bytes_per_value=4: _params(cfg) * 4],
    "adam_state_bytes": [_adam(moments=1), _adam(counters=True), _adam(nb=4), _adam(moments=3),
                         lambda cfg, bytes_per_value=4: 2 * _bytes(tied_twice=True)(cfg, bytes_per_value)],
    "block_saved_bytes": [_block(lse=False), _block(rsqrt=False), _block(input_=False), _block(kv_as_heads=True),
                          _block(probs=True), _block(o_copy=True), _block(swiglu=3), _block(lse_bytes=2),
                          _block(residual_twice=True)],
    "gelu_mlp_saved_bytes": [_gelu(c=2), _gelu(c=0), _gelu(i=1), _gelu(nb=4), _gelu_seq_only, _gelu(i=3)],
    "predict_forward_bytes": [_predict(moments=0), _predict(grads=1), _predict(logits=2), _predict(norm=False),
                              _predict(layers_minus=1), _predict(logits=8)],
}
CASES = [(fn, i) for fn, wrongs in WRONG.items() for i in range(len(wrongs))]


@pytest.mark.parametrize("fn, i", CASES, ids=[f"{fn}-{i}" for fn, i in CASES])
def test_a_wrong_solution_from_the_docstring_is_rejected(fn, i):
    checks = [c for c in ex43.CHECKS if c.tests == fn]
    assert caught_by(checks, mutant(EX, **{fn: WRONG[fn][i]}), fn) == len(checks)


def test_the_slips_are_off_in_the_right_walks():
    """Every switch off, each walk is the docstring's (the answers' counts): the slips above are the only change."""
    ans = mutant(EX)
    for shape in ex43.SHAPES:
        cfg = ex43.shape_config(shape)
        assert _bytes()(cfg, 2) == ans.param_bytes(cfg, 2) and _adam()(cfg, 8) == ans.adam_state_bytes(cfg, 8)
        assert _block()(cfg, 2, 7) == ans.block_saved_bytes(cfg, 2, 7)
        assert _gelu()(3, 5, 2, 7, 2) == ans.gelu_mlp_saved_bytes(3, 5, 2, 7, 2)
        assert _predict()(cfg, 2, 7) == ans.predict_forward_bytes(cfg, 2, 7)
