"""Part 02 · 09: every property the exercise checks hold (``ex09_contract``) is broken by one mutant
(an otherwise right solution), and the check rejects it with its message; the classic value mistakes
are in tests/test_local_backward.py."""

import pytest
import torch
from conftest import mutant

from bp_mech.checks import ex09, ex09_contract
from checks.mutants import contiguous_only, modifies_input, storage_order_only

pytestmark = pytest.mark.usefixtures("one_thread")  # hypothesis shrinks a failure over many tiny cases


def _solutions(**overrides):
    return mutant("ex09_local_backward", **overrides)


A = _solutions()


def _upcast(f):  # computes in float64 and returns float64 whatever came in
    return lambda *a: f(*[t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in a])


def _linear_db_squeezed(x, W, dy):  # one position: db "is" dy, returned as a view of it
    dx, dW, db = A.linear_backward(x, W, dy)
    flat = dy.reshape(-1, dy.shape[-1])
    return dx, dW, flat[0] if len(flat) == 1 else db


def _ce_masks_targets_in_place(logits, targets, ignore_index=-100):
    valid = targets != ignore_index
    targets[~valid] = 0  # the classic: a valid index for the gather, written into the caller's tensor
    d = torch.softmax(logits, -1)
    d[torch.arange(len(targets)), targets] -= 1
    return d * valid[:, None] / valid.sum()


def _ce_shifts_logits_in_place(logits, targets, ignore_index=-100):
    logits.sub_(logits.amax(-1, keepdim=True))  # a stable softmax, on the caller's logits
    return A.cross_entropy_backward(logits, targets, ignore_index)


def _layernorm(var, mean_g=True, xhat_term=True, center_in_place=False):
    def ln(x, w, b, dy, eps=1e-5):
        mu = x.mean(-1, keepdim=True)
        if center_in_place:
            x = x.sub_(mu)
            mu = 0.0
        r = torch.rsqrt(var(x, mu) + eps)
        xhat, g = (x - mu) * r, dy * w
        dx = r * (g - (g.mean(-1, keepdim=True) if mean_g else 0)
                  - (xhat * (g * xhat).mean(-1, keepdim=True) if xhat_term else 0))
        return dx, (dy * xhat).reshape(-1, x.shape[-1]).sum(0), dy.reshape(-1, x.shape[-1]).sum(0)
    return ln


def _centred(x, mu):
    return (x - mu).pow(2).mean(-1, keepdim=True)


def _one_pass(x, mu):
    return x.pow(2).mean(-1, keepdim=True) - mu * mu  # E[x^2] - E[x]^2: cancellation at a large offset


def _unbiased(x, mu):
    return (x - mu).pow(2).sum(-1, keepdim=True) / (x.shape[-1] - 1)  # torch.var's default


def _predict(f):
    return lambda B, T, C, I, dtype: f(B * T, C, I, dtype.itemsize)


CONTRACT_MUTANTS = {
    "linear: modifies dy": (ex09_contract.check_linear_backward__contract,
                            {"linear_backward": modifies_input(A.linear_backward, 2)}, "dy was modified in place"),
    "linear: db a view of dy": (ex09_contract.check_linear_backward__contract,
                                {"linear_backward": _linear_db_squeezed}, "db shares its storage with the input dy"),
    "linear: float64 out": (ex09_contract.check_linear_backward__contract, {"linear_backward": _upcast(
        A.linear_backward)}, "dx has dtype torch.float64, expected torch.float32 at float32 inputs"),
    "silu: storage order": (ex09_contract.check_silu_backward__contract,
                            {"silu_backward": storage_order_only(A.silu_backward)}, "differs .* non-contiguous"),
    "silu: modifies x": (ex09_contract.check_silu_backward__contract,
                         {"silu_backward": modifies_input(A.silu_backward, 0)}, "x was modified in place"),
    "rmsnorm: modifies dy": (ex09_contract.check_rmsnorm_backward__contract,
                             {"rmsnorm_backward": modifies_input(A.rmsnorm_backward, 2)}, "dy was modified"),
    "rmsnorm: contiguous only": (ex09_contract.check_rmsnorm_backward__contract,
                                 {"rmsnorm_backward": contiguous_only(A.rmsnorm_backward)},
                                 "raised RuntimeError at .* non-contiguous"),
    "swiglu: contiguous only": (ex09_contract.check_swiglu_mlp_backward__contract,
                                {"swiglu_mlp_backward": contiguous_only(A.swiglu_mlp_backward)},
                                "raised RuntimeError at .* non-contiguous"),
    "swiglu: modifies Wd": (ex09_contract.check_swiglu_mlp_backward__contract,
                            {"swiglu_mlp_backward": modifies_input(A.swiglu_mlp_backward, 3)}, "Wd was modified"),
    "ce: masks targets in place": (ex09_contract.check_cross_entropy_backward__contract,
                                   {"cross_entropy_backward": _ce_masks_targets_in_place}, "targets was modified"),
    "ce: shifts logits in place": (ex09_contract.check_cross_entropy_backward__contract,
                                   {"cross_entropy_backward": _ce_shifts_logits_in_place}, "logits was modified"),
    "ce: storage order": (ex09_contract.check_cross_entropy_backward__contract,
                          {"cross_entropy_backward": storage_order_only(A.cross_entropy_backward)}, "non-contiguous"),
    "layernorm: E[x^2] - E[x]^2": (ex09_contract.check_layernorm_backward__offset_and_constant_rows,
                                   {"layernorm_backward": _layernorm(_one_pass)}, "differs from .* offset by 1e4"),
    "layernorm: unbiased variance": (ex09_contract.check_layernorm_backward,
                                     {"layernorm_backward": _layernorm(_unbiased)}, "dx differs from float64 autograd"),
    "layernorm: no mean(g) term": (ex09_contract.check_layernorm_backward,
                                   {"layernorm_backward": _layernorm(_centred, mean_g=False)}, "dx differs"),
    "layernorm: RMSNorm's dx": (ex09_contract.check_layernorm_backward,
                                {"layernorm_backward": _layernorm(_centred, xhat_term=False)}, "dx differs"),
    "layernorm: centres x in place": (ex09_contract.check_layernorm_backward__contract, {
        "layernorm_backward": _layernorm(_centred, center_in_place=True)}, "x was modified in place"),
    "layernorm: float64 out": (ex09_contract.check_layernorm_backward__contract, {
        "layernorm_backward": _upcast(A.layernorm_backward)}, "dtype torch.float64, expected torch.float32"),
    "predict: forgets x": (ex09_contract.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: 4 * n * I * s)}, "predicted .* the saved-tensor hooks measure"),
    "predict: h and a*u twice, no x": (ex09_contract.check_predict_mlp_saved_bytes, {
        "predict_mlp_saved_bytes": _predict(lambda n, C, I, s: 5 * n * I * s)}, "predicted"),
    "predict: weights counted": (ex09_contract.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: (n * C + 4 * n * I + 3 * C * I) * s)}, "predicted"),
    "predict: float32 bytes always": (ex09_contract.check_predict_mlp_saved_bytes, {
        "predict_mlp_saved_bytes": _predict(lambda n, C, I, s: (n * C + 4 * n * I) * 4)}, "predicted"),
    "predict: a float": (ex09_contract.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: float((n * C + 4 * n * I) * s))}, "the prediction is a float, expected an int"),
}


@pytest.mark.parametrize("name", list(CONTRACT_MUTANTS))
def test_contract_checks_reject_a_solution_that_breaks_one_property(name):
    check, overrides, message = CONTRACT_MUTANTS[name]
    function = next(iter(overrides))
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(_solutions(**overrides))


def test_the_contract_mutants_are_right_on_the_value_checks():
    """Each breaks only its property: the plain value checks pass it (the contract check is needed)."""
    for overrides in ({"linear_backward": _linear_db_squeezed}, {"cross_entropy_backward": _ce_masks_targets_in_place},
                      {"cross_entropy_backward": _ce_shifts_logits_in_place}):
        for check in ex09.CHECKS[:9]:
            check(_solutions(**overrides))
