"""Part 02 · 09: every property the exercise checks hold (``ex09``'s declarations, derived by
``checks.engine``) is broken by one mutant (an otherwise right solution), and the check rejects it with its
message; the classic value mistakes are in tests/test_local_backward.py."""

import pytest
import torch
from conftest import mutant

from bp_mech.checks import ex09
from checks.mutants import contiguous_only, leaks, modifies_input, storage_order_only

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
    "linear: modifies dy": (ex09.check_linear_backward,
                            {"linear_backward": modifies_input(A.linear_backward, 2)}, "dy was modified in place"),
    "linear: db a view of dy": (ex09.check_linear_backward,
                                {"linear_backward": _linear_db_squeezed}, "db shares its storage with the input dy"),
    "linear: float64 out": (ex09.check_linear_backward, {"linear_backward": _upcast(
        A.linear_backward)}, "dx has dtype torch.float64, expected torch.float32 at float32 inputs"),
    "silu: storage order": (ex09.check_silu_backward,
                            {"silu_backward": storage_order_only(A.silu_backward)}, "differs .* non-contiguous"),
    "silu: modifies x": (ex09.check_silu_backward,
                         {"silu_backward": modifies_input(A.silu_backward, 0)}, "x was modified in place"),
    "rmsnorm: modifies dy": (ex09.check_rmsnorm_backward,
                             {"rmsnorm_backward": modifies_input(A.rmsnorm_backward, 2)}, "dy was modified"),
    "rmsnorm: contiguous only": (ex09.check_rmsnorm_backward,
                                 {"rmsnorm_backward": contiguous_only(A.rmsnorm_backward)},
                                 "raised RuntimeError at .* non-contiguous"),
    "swiglu: contiguous only": (ex09.check_swiglu_mlp_backward,
                                {"swiglu_mlp_backward": contiguous_only(A.swiglu_mlp_backward)},
                                "raised RuntimeError at .* non-contiguous"),
    "swiglu: modifies Wd": (ex09.check_swiglu_mlp_backward,
                            {"swiglu_mlp_backward": modifies_input(A.swiglu_mlp_backward, 3)}, "Wd was modified"),
    "ce: masks targets in place": (ex09.check_cross_entropy_backward,
                                   {"cross_entropy_backward": _ce_masks_targets_in_place}, "targets was modified"),
    "ce: shifts logits in place": (ex09.check_cross_entropy_backward,
                                   {"cross_entropy_backward": _ce_shifts_logits_in_place}, "logits was modified"),
    "ce: storage order": (ex09.check_cross_entropy_backward,
                          {"cross_entropy_backward": storage_order_only(A.cross_entropy_backward)}, "non-contiguous"),
    "layernorm: E[x^2] - E[x]^2": (ex09.check_layernorm_backward__offset_and_constant_rows,
                                   {"layernorm_backward": _layernorm(_one_pass)}, "differs from .* offset by 1e4"),
    "layernorm: unbiased variance": (ex09.check_layernorm_backward,
                                     {"layernorm_backward": _layernorm(_unbiased)}, "dx differs from float64 autograd"),
    "layernorm: no mean(g) term": (ex09.check_layernorm_backward,
                                   {"layernorm_backward": _layernorm(_centred, mean_g=False)}, "dx differs"),
    "layernorm: RMSNorm's dx": (ex09.check_layernorm_backward,
                                {"layernorm_backward": _layernorm(_centred, xhat_term=False)}, "dx differs"),
    "layernorm: centres x in place": (ex09.check_layernorm_backward, {
        "layernorm_backward": _layernorm(_centred, center_in_place=True)}, "x was modified in place"),
    "layernorm: float64 out": (ex09.check_layernorm_backward, {
        "layernorm_backward": _upcast(A.layernorm_backward)}, "dtype torch.float64, expected torch.float32"),
    "predict: forgets x": (ex09.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: 4 * n * I * s)}, "the prediction is .* the saved-tensor hooks' measurement gives"),
    "predict: h and a*u twice, no x": (ex09.check_predict_mlp_saved_bytes, {
        "predict_mlp_saved_bytes": _predict(lambda n, C, I, s: 5 * n * I * s)}, "prediction is"),
    "predict: weights counted": (ex09.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: (n * C + 4 * n * I + 3 * C * I) * s)}, "prediction is"),
    "predict: float32 bytes always": (ex09.check_predict_mlp_saved_bytes, {
        "predict_mlp_saved_bytes": _predict(lambda n, C, I, s: (n * C + 4 * n * I) * 4)}, "prediction is"),
    "predict: a float": (ex09.check_predict_mlp_saved_bytes, {"predict_mlp_saved_bytes": _predict(
        lambda n, C, I, s: float((n * C + 4 * n * I) * s))}, "the prediction is a float, expected an int"),
}


@pytest.mark.parametrize("name", list(CONTRACT_MUTANTS))
def test_contract_checks_reject_a_solution_that_breaks_one_property(name):
    check, overrides, message = CONTRACT_MUTANTS[name]
    function = next(iter(overrides))
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(_solutions(**overrides))


def test_the_contract_mutants_give_the_right_values():
    """Each breaks only its property: on fresh inputs its values are the reference's (the property is needed)."""
    for k, f in ((ex09.LINEAR, _linear_db_squeezed), (ex09.CROSS_ENTROPY, _ce_masks_targets_in_place),
                 (ex09.CROSS_ENTROPY, _ce_shifts_logits_in_place)):
        for case in k.examples[""]:
            args = k.inputs(case)
            got = f(*[a.clone() if torch.is_tensor(a) else a for a in args.values()])
            for a, w in zip(got if isinstance(got, tuple) else (got,), k.ref(**args)):
                torch.testing.assert_close(a, w)




def _linear_default_dtype(x, W, dy):  # db accumulated in the default dtype: right only when it is float64
    dx, dW, db = A.linear_backward(x, W, dy)
    return dx, dW, db.to(torch.get_default_dtype()).to(db.dtype)


DERIVED_MUTANTS = {
    "rmsnorm: default eps 1e-5": (ex09.check_rmsnorm_backward, {
        "rmsnorm_backward": lambda x, w, dy, eps=1e-5: A.rmsnorm_backward(x, w, dy, eps)},
        r"dx differs from float64 autograd.*eps left out \(default 1e-06\)"),
    "rmsnorm: eps required": (ex09.check_rmsnorm_backward, {
        "rmsnorm_backward": lambda x, w, dy, eps: A.rmsnorm_backward(x, w, dy, eps)}, "raised TypeError at .*eps left out"),
    "ce: default ignore_index -1": (ex09.check_cross_entropy_backward, {
        "cross_entropy_backward": lambda z, t, ignore_index=-1: A.cross_entropy_backward(z, t, ignore_index)},
        "ignore_index left out"),
    "layernorm: default eps 1e-6": (ex09.check_layernorm_backward, {
        "layernorm_backward": lambda x, w, b, dy, eps=1e-6: A.layernorm_backward(x, w, b, dy, eps)}, "eps left out"),
    "silu: grad mode left off": (ex09.check_silu_backward, {
        "silu_backward": leaks(A.silu_backward, lambda: torch.set_grad_enabled(False))}, "left the grad mode changed"),
    "linear: float64 default left": (ex09.check_linear_backward, {
        "linear_backward": leaks(A.linear_backward, lambda: torch.set_default_dtype(torch.float64))},
        "left the default dtype changed"),
    "swiglu: reseeds torch": (ex09.check_swiglu_mlp_backward, {
        "swiglu_mlp_backward": leaks(A.swiglu_mlp_backward, lambda: torch.manual_seed(0))},
        "left the torch RNG state changed"),
    "ce: draws from torch's RNG": (ex09.check_cross_entropy_backward, {
        "cross_entropy_backward": leaks(A.cross_entropy_backward, lambda: torch.rand(1))}, "torch RNG state changed"),
    "layernorm: autocast left on": (ex09.check_layernorm_backward, {
        "layernorm_backward": leaks(A.layernorm_backward, lambda: torch.set_autocast_enabled("cpu", True))},
        "left the CPU autocast changed"),
    "rmsnorm: grad mode off, then raises": (ex09.check_rmsnorm_backward, {"rmsnorm_backward": leaks(
        A.rmsnorm_backward, lambda: torch.set_grad_enabled(False), ValueError("x"))}, "also when raising"),
    "linear: db in the default dtype": (ex09.check_linear_backward, {"linear_backward": _linear_default_dtype},
                                        "db differs from float64 autograd"),
}


@pytest.mark.parametrize("name", list(DERIVED_MUTANTS))
def test_the_derived_properties_reject_their_mutant(name):
    check, overrides, message = DERIVED_MUTANTS[name]
    with pytest.raises(AssertionError, match=f"^{next(iter(overrides))}: .*{message}"):
        check(_solutions(**overrides))
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32  # put back for the next test
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("start", ["float64 default", "grad mode off", "autocast on", "reseeded"])
def test_a_check_s_outcome_does_not_depend_on_the_state_it_starts_from(start):
    """Run after anything (another check, a learner's cell that left a switch flipped): the same verdict, and
    the caller's state is the caller's again after."""
    flip = {"float64 default": lambda: torch.set_default_dtype(torch.float64),
            "grad mode off": lambda: torch.set_grad_enabled(False),
            "autocast on": lambda: torch.set_autocast_enabled("cpu", True), "reseeded": lambda: torch.manual_seed(7)}
    try:
        flip[start]()
        before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
        rng = torch.random.get_rng_state()
        ex09.check_linear_backward(A)
        with pytest.raises(AssertionError, match="^linear_backward: db differs"):
            ex09.check_linear_backward(_solutions(linear_backward=_linear_default_dtype))
        assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")) == before
        assert torch.equal(torch.random.get_rng_state(), rng)
    finally:
        torch.set_default_dtype(torch.float32), torch.set_grad_enabled(True), torch.set_autocast_enabled("cpu", False)
