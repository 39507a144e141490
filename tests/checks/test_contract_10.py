"""Part 02 · 10: every property the exercise checks hold (``ex10``'s declarations, derived by ``checks.engine``) is broken by one mutant
(an otherwise right solution), and the check rejects it with its message; the classic value mistakes
are in tests/test_attention_backward.py."""

import math

import pytest
import torch
from conftest import mutant as _mutant

from bp_mech import attention_backward
from bp_mech.checks import ex10
from checks.mutants import contiguous_only, modifies_input, storage_order_only

pytestmark = pytest.mark.usefixtures("one_thread")  # hypothesis shrinks a failure over many tiny cases


def mutant(**overrides):
    return _mutant("ex10_attention_backward", **overrides)


A = mutant()


def _upcast(f):  # computes in float64 and returns float64 whatever came in
    return lambda *a: f(*[t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in a])


def _softmax_reuses_dP(P, dP):  # dP as the buffer: right value, the caller's dP overwritten and returned
    return dP.sub_((dP * P).sum(-1, keepdim=True)).mul_(P)


def _head_scales_q_in_place(q, k, v, dO):
    scale = q.shape[-1] ** -0.5
    q = q.mul_(scale)  # the classic pre-scaling, on the caller's q
    T = q.shape[0]
    P = torch.softmax((q @ k.T).masked_fill(~attention_backward.causal_mask(T, T), float("-inf")), -1)
    dS = attention_backward.softmax_backward(P, dO @ v.T)
    return dS @ k * scale, dS.T @ q, P.T @ dO


def _naive_softmax(S):  # no row maximum: exp(1000) = inf, inf / inf = NaN
    e = S.exp()
    return e / e.sum(-1, keepdim=True)


def _one_max_softmax(S):  # S.max() without dim: one maximum for all rows; rows far below it underflow, 0 / 0
    e = (S - S.max()).exp()
    return e / e.sum(-1, keepdim=True)


def _head_with(softmax):
    def head(q, k, v, dO):
        T = q.shape[0]
        P = softmax((q @ k.T * q.shape[-1] ** -0.5).masked_fill(~attention_backward.causal_mask(T, T), -math.inf))
        return attention_backward.attention_backward(q, k, v, P, dO)
    return head


_head_naive_softmax = _head_with(_naive_softmax)


def _gqa_returns_dx_when_mha(dx, kv_heads):
    return dx if dx.shape[1] == kv_heads else A.gqa_reduce(dx, kv_heads)


def _blockwise_exp_over_exp(q, k, v, o, lse, dO, block):  # exp(S) / exp(L): inf / inf once S > 709
    T, scale = q.shape[-2], q.shape[-1] ** -0.5
    s = (q @ k.transpose(-2, -1) * scale).masked_fill(~attention_backward.causal_mask(T, T), -math.inf)
    return attention_backward.attention_backward(q, k, v, s.exp() / lse[..., None].exp(), dO)


def _window(offset=0, ignore=False, after_softmax=False, scale=True, softmax=torch.softmax):
    def head(q, k, v, dO, window):
        T, c = q.shape[-2], q.shape[-1] ** -0.5
        i = torch.arange(T)
        band = (i[None, :] <= i[:, None]) & (ignore or (i[None, :] > i[:, None] - window - offset))
        S = q @ k.transpose(-2, -1) * c
        P = softmax(S.masked_fill(~attention_backward.causal_mask(T, T), -math.inf), -1) * band if after_softmax \
            else softmax(S.masked_fill(~band, -math.inf), -1)
        dS = attention_backward.softmax_backward(P, dO @ v.transpose(-2, -1)) * (c if scale else 1.0)
        return dS @ k, dS.transpose(-2, -1) @ q, P.transpose(-2, -1) @ dO
    return head


def _predict(f):
    return lambda B, H, T, d, dtype: f(B * H, T, d, dtype.itemsize)


CONTRACT_MUTANTS = {
    "softmax: dP as the buffer": (ex10.check_softmax_backward,
                                  {"softmax_backward": _softmax_reuses_dP}, "dP was modified in place"),
    "softmax: storage order": (ex10.check_softmax_backward,
                               {"softmax_backward": storage_order_only(A.softmax_backward)}, "non-contiguous"),
    "softmax: float64 out": (ex10.check_softmax_backward,
                             {"softmax_backward": _upcast(A.softmax_backward)}, "dtype torch.float64, expected"),
    "head: scales q in place": (ex10.check_attention_head_backward,
                                {"attention_head_backward": _head_scales_q_in_place}, "q was modified in place"),
    "head: contiguous only": (ex10.check_attention_head_backward,
                              {"attention_head_backward": contiguous_only(A.attention_head_backward)},
                              "raised RuntimeError at .*non-contiguous"),
    "head: naive softmax": (ex10.check_attention_head_backward__large_scores,
                            {"attention_head_backward": _head_naive_softmax}, "non-finite values .* scores near"),
    "head: one max for all rows": (ex10.check_attention_head_backward__large_scores,
                                   {"attention_head_backward": _head_with(_one_max_softmax)}, "non-finite .* every other"),
    "gqa: returns dx when H = Hkv": (ex10.check_gqa_reduce,
                                     {"gqa_reduce": _gqa_returns_dx_when_mha}, "dkv shares its storage with the input"),
    "gqa: storage order": (ex10.check_gqa_reduce,
                           {"gqa_reduce": storage_order_only(A.gqa_reduce)}, "non-contiguous"),
    "blockwise: modifies dO": (ex10.check_blockwise_backward,
                               {"blockwise_backward": modifies_input(A.blockwise_backward, 5)}, "dO was modified"),
    "blockwise: float64 out": (ex10.check_blockwise_backward,
                               {"blockwise_backward": _upcast(A.blockwise_backward)}, "dtype torch.float64"),
    "blockwise: exp(S) / exp(L)": (ex10.check_blockwise_backward__large_scores,
                                   {"blockwise_backward": _blockwise_exp_over_exp}, "non-finite values"),
    "rope: modifies dy": (ex10.check_rope_backward,
                          {"rope_backward": modifies_input(A.rope_backward, 0)}, "dy was modified in place"),
    "rope: contiguous only": (ex10.check_rope_backward,
                              {"rope_backward": contiguous_only(A.rope_backward)}, "raised RuntimeError .*non-contig"),
    "window: one key too many": (ex10.check_sliding_window_head_backward,
                                 {"sliding_window_head_backward": _window(offset=1)}, "differs from float64 autograd"),
    "window: one key too few": (ex10.check_sliding_window_head_backward,
                                {"sliding_window_head_backward": _window(offset=-1)}, "differs"),
    "window: ignored": (ex10.check_sliding_window_head_backward,
                        {"sliding_window_head_backward": _window(ignore=True)}, "differs"),
    "window: zeroed after the softmax": (ex10.check_sliding_window_head_backward,
                                         {"sliding_window_head_backward": _window(after_softmax=True)}, "differs"),
    "window: missing 1/sqrt(d)": (ex10.check_sliding_window_head_backward,
                                  {"sliding_window_head_backward": _window(scale=False)}, "dq differs"),
    "window: naive softmax": (ex10.check_sliding_window_head_backward__large_scores, {
        "sliding_window_head_backward": _window(softmax=lambda S, dim: _naive_softmax(S))}, "non-finite"),
    "window: one max for all rows": (ex10.check_sliding_window_head_backward__large_scores, {
        "sliding_window_head_backward": _window(softmax=lambda S, dim: _one_max_softmax(S))}, "non-finite"),
    "window: modifies k": (ex10.check_sliding_window_head_backward, {
        "sliding_window_head_backward": modifies_input(_window(), 1)}, "k was modified in place"),
    "window: storage order": (ex10.check_sliding_window_head_backward, {
        "sliding_window_head_backward": storage_order_only(_window())}, "non-contiguous"),
    "predict: no mask": (ex10.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + T * T) * s)}, "the prediction is .* the saved-tensor hooks' measurement gives"),
    "predict: a mask per head": (ex10.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + T * T) * s + bh * T * T)}, "prediction is"),
    "predict: P twice": (ex10.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + 2 * T * T) * s + T * T)}, "prediction is"),
    "predict: S kept too, no mask": (ex10.check_predict_eager_saved_bytes, {
        "predict_eager_saved_bytes": _predict(lambda bh, T, d, s: bh * (3 * T * d + 2 * T * T) * s)}, "prediction is"),
    "predict: mask in the dtype": (ex10.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes":
                                   _predict(lambda bh, T, d, s: (bh * (3 * T * d + T * T) + T * T) * s)}, "prediction is"),
    "predict: a float": (ex10.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: float(bh * (3 * T * d + T * T) * s + T * T))}, "the prediction is a float, expected an"),
}


@pytest.mark.parametrize("name", list(CONTRACT_MUTANTS))
def test_contract_checks_reject_a_solution_that_breaks_one_property(name):
    check, overrides, message = CONTRACT_MUTANTS[name]
    function = next(iter(overrides))
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(mutant(**overrides))


def test_the_contract_mutants_give_the_right_values():
    """Each breaks only its property: on fresh inputs its values are the reference's (the property is needed)."""
    for k, f in ((ex10.GQA, _gqa_returns_dx_when_mha), (ex10.SOFTMAX, _softmax_reuses_dP),
                 (ex10.HEAD, _head_naive_softmax), (ex10.HEAD, _head_with(_one_max_softmax))):
        for case in k.examples[""]:
            args = k.inputs(case)
            got = f(*[a.clone() if torch.is_tensor(a) else a for a in args.values()])
            for a, w in zip(got if isinstance(got, tuple) else (got,), k.ref(**args)):
                torch.testing.assert_close(a, w)


def _head_in_default_dtype(q, k, v, dO):  # dq rounded through the default dtype: right only when it is float64
    dq, dk, dv = A.attention_head_backward(q, k, v, dO)
    return dq.to(torch.get_default_dtype()).to(dq.dtype), dk, dv


def _leaves_grad_off(f):
    def g(*args):
        torch.set_grad_enabled(False)
        return f(*args)
    return g


DERIVED_MUTANTS = {
    "head: dq in the default dtype": (ex10.check_attention_head_backward,
                                      {"attention_head_backward": _head_in_default_dtype}, "dq differs"),
    "blockwise: grad mode left off": (ex10.check_blockwise_backward,
                                      {"blockwise_backward": _leaves_grad_off(A.blockwise_backward)},
                                      "left the grad mode changed"),
    "rope: reseeds torch": (ex10.check_rope_backward, {"rope_backward": lambda *a: (torch.manual_seed(1),
                                                                                   A.rope_backward(*a))[1]},
                            "left the torch RNG state changed"),
    "gqa: a list of one": (ex10.check_gqa_reduce, {"gqa_reduce": lambda dx, h: [A.gqa_reduce(dx, h)]},
                           "dkv is a list, expected a tensor"),
    "window: a list": (ex10.check_sliding_window_head_backward, {"sliding_window_head_backward": lambda *a: list(
        A.sliding_window_head_backward(*a))}, r"returned a list, expected a tuple \(dq, dk, dv\)"),
}


@pytest.mark.parametrize("name", list(DERIVED_MUTANTS))
def test_the_derived_properties_reject_their_mutant(name):
    check, overrides, message = DERIVED_MUTANTS[name]
    with pytest.raises(AssertionError, match=f"^{next(iter(overrides))}: .*{message}"):
        check(mutant(**overrides))
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


def test_a_check_after_a_float64_default_still_rejects_the_default_dtype_mutant():
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(AssertionError, match="^attention_head_backward: dq differs"):
            ex10.check_attention_head_backward(mutant(attention_head_backward=_head_in_default_dtype))
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
