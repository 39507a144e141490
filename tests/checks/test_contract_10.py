"""Part 02 · 10: every property the exercise checks hold (``ex10_contract``) is broken by one mutant
(an otherwise right solution), and the check rejects it with its message; the classic value mistakes
are in tests/test_attention_backward.py."""

import math

import pytest
import torch
from conftest import mutant as _mutant

from bp_mech import attention_backward
from bp_mech.checks import ex10, ex10_contract
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


def _head_naive_softmax(q, k, v, dO):
    T = q.shape[0]
    P = _naive_softmax((q @ k.T * q.shape[-1] ** -0.5).masked_fill(~attention_backward.causal_mask(T, T), -math.inf))
    return attention_backward.attention_backward(q, k, v, P, dO)


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
    "softmax: dP as the buffer": (ex10_contract.check_softmax_backward__contract,
                                  {"softmax_backward": _softmax_reuses_dP}, "dP was modified in place"),
    "softmax: storage order": (ex10_contract.check_softmax_backward__contract,
                               {"softmax_backward": storage_order_only(A.softmax_backward)}, "non-contiguous"),
    "softmax: float64 out": (ex10_contract.check_softmax_backward__contract,
                             {"softmax_backward": _upcast(A.softmax_backward)}, "dtype torch.float64, expected"),
    "head: scales q in place": (ex10_contract.check_attention_head_backward__contract,
                                {"attention_head_backward": _head_scales_q_in_place}, "q was modified in place"),
    "head: contiguous only": (ex10_contract.check_attention_head_backward__contract,
                              {"attention_head_backward": contiguous_only(A.attention_head_backward)},
                              "raised RuntimeError at .*non-contiguous"),
    "head: naive softmax": (ex10_contract.check_attention_head_backward__large_scores,
                            {"attention_head_backward": _head_naive_softmax}, "non-finite values .* scores near"),
    "gqa: returns dx when H = Hkv": (ex10_contract.check_gqa_reduce__contract,
                                     {"gqa_reduce": _gqa_returns_dx_when_mha}, "dkv shares its storage with the input"),
    "gqa: storage order": (ex10_contract.check_gqa_reduce__contract,
                           {"gqa_reduce": storage_order_only(A.gqa_reduce)}, "non-contiguous"),
    "blockwise: modifies dO": (ex10_contract.check_blockwise_backward__contract,
                               {"blockwise_backward": modifies_input(A.blockwise_backward, 5)}, "dO was modified"),
    "blockwise: float64 out": (ex10_contract.check_blockwise_backward__contract,
                               {"blockwise_backward": _upcast(A.blockwise_backward)}, "dtype torch.float64"),
    "blockwise: exp(S) / exp(L)": (ex10_contract.check_blockwise_backward__large_scores,
                                   {"blockwise_backward": _blockwise_exp_over_exp}, "non-finite values"),
    "rope: modifies dy": (ex10_contract.check_rope_backward__contract,
                          {"rope_backward": modifies_input(A.rope_backward, 0)}, "dy was modified in place"),
    "rope: contiguous only": (ex10_contract.check_rope_backward__contract,
                              {"rope_backward": contiguous_only(A.rope_backward)}, "raised RuntimeError .*non-contig"),
    "window: one key too many": (ex10_contract.check_sliding_window_head_backward,
                                 {"sliding_window_head_backward": _window(offset=1)}, "differs from float64 autograd"),
    "window: one key too few": (ex10_contract.check_sliding_window_head_backward,
                                {"sliding_window_head_backward": _window(offset=-1)}, "differs"),
    "window: ignored": (ex10_contract.check_sliding_window_head_backward,
                        {"sliding_window_head_backward": _window(ignore=True)}, "differs"),
    "window: zeroed after the softmax": (ex10_contract.check_sliding_window_head_backward,
                                         {"sliding_window_head_backward": _window(after_softmax=True)}, "differs"),
    "window: missing 1/sqrt(d)": (ex10_contract.check_sliding_window_head_backward,
                                  {"sliding_window_head_backward": _window(scale=False)}, "dq differs"),
    "window: naive softmax": (ex10_contract.check_sliding_window_head_backward__large_scores, {
        "sliding_window_head_backward": _window(softmax=lambda S, dim: _naive_softmax(S))}, "non-finite"),
    "window: modifies k": (ex10_contract.check_sliding_window_head_backward__contract, {
        "sliding_window_head_backward": modifies_input(_window(), 1)}, "k was modified in place"),
    "window: storage order": (ex10_contract.check_sliding_window_head_backward__contract, {
        "sliding_window_head_backward": storage_order_only(_window())}, "non-contiguous"),
    "predict: no mask": (ex10_contract.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + T * T) * s)}, "predicted .* the saved-tensor hooks measure"),
    "predict: a mask per head": (ex10_contract.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + T * T) * s + bh * T * T)}, "predicted"),
    "predict: P twice": (ex10_contract.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: bh * (3 * T * d + 2 * T * T) * s + T * T)}, "predicted"),
    "predict: S kept too, no mask": (ex10_contract.check_predict_eager_saved_bytes, {
        "predict_eager_saved_bytes": _predict(lambda bh, T, d, s: bh * (3 * T * d + 2 * T * T) * s)}, "predicted"),
    "predict: mask in the dtype": (ex10_contract.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes":
                                   _predict(lambda bh, T, d, s: (bh * (3 * T * d + T * T) + T * T) * s)}, "predicted"),
    "predict: a float": (ex10_contract.check_predict_eager_saved_bytes, {"predict_eager_saved_bytes": _predict(
        lambda bh, T, d, s: float(bh * (3 * T * d + T * T) * s + T * T))}, "the prediction is a float, expected an"),
}


@pytest.mark.parametrize("name", list(CONTRACT_MUTANTS))
def test_contract_checks_reject_a_solution_that_breaks_one_property(name):
    check, overrides, message = CONTRACT_MUTANTS[name]
    function = next(iter(overrides))
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(mutant(**overrides))


def test_the_contract_mutants_are_right_on_the_value_checks():
    """Each breaks only its property: the chapter's value checks pass it (the contract check is needed)."""
    for overrides in ({"gqa_reduce": _gqa_returns_dx_when_mha}, {"softmax_backward": _softmax_reuses_dP},
                      {"attention_head_backward": _head_naive_softmax}):
        for check in ex10.CHECKS[:6]:
            check(mutant(**overrides))
