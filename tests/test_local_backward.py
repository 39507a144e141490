"""Part 02 · 09: the hand-written backwards of bp_mech.local_backward agree with float64 autograd
and with finite differences (through the experiment's ``compare_op``), and the exercise checks
catch the classic mistakes. The run, its records and the conformance row:
tests/experiments/test_local_backward.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import mutant

from bp_mech import local_backward
from bp_mech.checks import ex09
from bp_mech.experiments import local_backward as experiment

pytestmark = [pytest.mark.ch09, pytest.mark.usefixtures("one_thread")]  # one thread: hypothesis's shrinking


@pytest.mark.parametrize("op", list(experiment.OPS))
def test_every_op_matches_autograd_and_finite_differences(op):
    c = experiment.compare_op(op, shape=(2, 6, 12), inter=20, vocab=30, seed=3)
    assert c["output_error"] <= experiment.TOL64
    assert max(c["grad_errors"].values()) <= experiment.TOL64
    assert max(c["fd_errors"].values()) <= experiment.TOL_FD
    # float32 is rounding, not exactness: small but clearly above float64's errors
    assert 1e-9 < max(c["fp32_hand"].values()) < 1e-4


def dropped_term_error(width, rows=2048, seed=0):
    """||r (dy w) - autograd|| / ||autograd|| for RMSNorm's input gradient (float64; x, dy
    standard normal, gain w = 1 + 0.1 N(0, 1)). Per row the dropped term r xhat mean(g xhat)
    has squared norm r^2 (sum_i g_i xhat_i)^2 / C, a chi-square(1) variable times
    r^2 mean(g^2), against r^2 C mean(g^2) for the whole gradient: the error is
    1/sqrt(C - 1), and over N rows its relative spread is 1/sqrt(2N)."""
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(rows, width, dtype=torch.float64, generator=gen) for _ in "xy")
    w = 1 + 0.1 * torch.randn(width, dtype=torch.float64, generator=gen)
    x.requires_grad_(True)
    (ref,) = torch.autograd.grad(F.rms_norm(x, (width,), w, 1e-6), x, dy)
    with torch.no_grad():
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return float((r * (dy * w) - ref).norm() / ref.norm())


@pytest.mark.parametrize("width", [64, 256, 1024])
def test_dropping_rmsnorm_second_term_errs_by_one_over_sqrt_width(width):
    """The classic bug is small, which is why it survives (chapter 09's prose): against
    autograd the gradient without the term through r is off by 1/sqrt(C - 1) (see
    ``dropped_term_error``); 5 relative spreads 1/sqrt(2N) bound a miss."""
    rows = 2048
    spread = (2 * rows) ** -0.5
    for seed in range(3):
        e = dropped_term_error(width, rows, seed)
        assert abs(e * math.sqrt(width - 1) - 1) < 5 * spread


def test_dropped_term_error_falls_as_one_over_sqrt_width():
    """Log-log slope of the error against C: -1/2 (-C/(2(C-1)) exactly; within 0.03 here)."""
    widths = [32, 128, 512, 2048]
    errs = [dropped_term_error(c, rows=2048, seed=1) for c in widths]
    lx = [math.log(c) for c in widths]
    ly = [math.log(e) for e in errs]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    assert abs(slope + 0.5) < 0.03


def test_block_backward_is_the_composition_of_local_backwards():
    x, w, Wg, Wu, Wd = experiment.make_inputs("mlp_block", (1, 4, 8), 16, 10)
    dy = torch.randn_like(x, dtype=torch.float64)
    dx, _, *_ = local_backward.mlp_block_backward(x, w, Wg, Wu, Wd, dy)
    dh, *_ = local_backward.swiglu_mlp_backward(local_backward.rmsnorm_forward(x, w), Wg, Wu, Wd, dy)
    assert torch.allclose(dx, dy + local_backward.rmsnorm_backward(x, w, dh)[0], rtol=0, atol=0)


# --- the exercise checks catch the classic mistakes (mutants of a correct solution) ---

def _solutions(**overrides):
    """The answers (the package's backwards, the variant and the prediction) with some replaced."""
    return mutant("ex09_local_backward", **overrides)


def test_checks_pass_on_a_correct_solution():
    for check in ex09.CHECKS:
        check(_solutions())


def _linear_missing_transpose(x, W, dy):
    dx, dW, db = local_backward.linear_backward(x, W, dy)
    return dy @ W.T if W.shape[0] == W.shape[1] else dx, dW.T if W.shape[0] == W.shape[1] else dW, db


def _rmsnorm_dropped_term(x, w, dy, eps=1e-6):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return r * dy * w, (dy * x * r).reshape(-1, x.shape[-1]).sum(0)


def _ce_mean_over_all_rows(logits, targets, ignore_index=-100):
    valid = targets != ignore_index
    return local_backward.cross_entropy_backward(logits, targets, ignore_index) * valid.sum() / len(targets)


def _mlp_forgets_one_branch(x, Wg, Wu, Wd, dy):
    dx, dWg, dWu, dWd = local_backward.swiglu_mlp_backward(x, Wg, Wu, Wd, dy)
    g = x @ Wg.T
    dh = (dy @ Wd) * local_backward.silu_forward(g)
    return dx - dh @ Wu, dWg, dWu, dWd  # drops the up-branch's contribution to dx


def _linear_assumes_3d(x, W, dy):  # einsum over (B, T): right on 3-D inputs only
    return dy @ W, torch.einsum("bto,bti->oi", dy, x), dy.sum((0, 1))


def _silu_quotient(x, dy):  # d/dx x / (1 + e^-x) as a quotient: inf / inf = NaN once e^-x overflows
    e = torch.exp(-x)
    return dy * (1 + e + x * e) / (1 + e) ** 2


def _rmsnorm_without_eps(x, w, dy, eps=1e-6):  # xhat = x / rms(x): a zero row gives NaN
    xhat = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    g = dy * w
    return r * (g - xhat * (g * xhat).mean(-1, keepdim=True)), (dy * xhat).reshape(-1, x.shape[-1]).sum(0)


def _mlp_assumes_3d(x, Wg, Wu, Wd, dy):
    dx, dWg, dWu, _ = local_backward.swiglu_mlp_backward(x, Wg, Wu, Wd, dy)
    h = local_backward.silu_forward(x @ Wg.T) * (x @ Wu.T)
    return dx, dWg, dWu, torch.einsum("btc,bti->ci", dy, h)


def _ce_hardcoded_ignore(logits, targets, ignore_index=-100):
    return local_backward.cross_entropy_backward(logits, targets)  # ignores the argument


def _ce_nonnegative_is_valid(logits, targets, ignore_index=-100):
    valid = targets >= 0  # right for -100 and -1, wrong for a pad id that is a real class
    d = torch.softmax(logits, -1)
    d[torch.arange(len(targets)), targets.clamp_min(0)] -= 1
    return d * valid[:, None] / valid.sum()


def _ce_naive_softmax(logits, targets, ignore_index=-100):
    valid = targets != ignore_index
    e = logits.exp()  # no max subtracted: inf / inf = NaN for large logits
    d = e / e.sum(-1, keepdim=True)
    d[torch.arange(len(targets)), targets.masked_fill(~valid, 0)] -= 1
    return d * valid[:, None] / valid.sum()


@pytest.mark.parametrize("check, mutant", [
    (ex09.check_linear_backward, {"linear_backward": _linear_missing_transpose}),
    (ex09.check_linear_backward, {"linear_backward": _linear_assumes_3d}),
    (ex09.check_rmsnorm_backward, {"rmsnorm_backward": _rmsnorm_dropped_term}),
    (ex09.check_rmsnorm_backward__tiny_rows, {"rmsnorm_backward": _rmsnorm_without_eps}),
    (ex09.check_cross_entropy_backward, {"cross_entropy_backward": _ce_mean_over_all_rows}),
    (ex09.check_cross_entropy_backward__ignore_index, {"cross_entropy_backward": _ce_hardcoded_ignore}),
    (ex09.check_cross_entropy_backward__ignore_index, {"cross_entropy_backward": _ce_nonnegative_is_valid}),
    (ex09.check_cross_entropy_backward__large_logits, {"cross_entropy_backward": _ce_naive_softmax}),
    (ex09.check_swiglu_mlp_backward, {"swiglu_mlp_backward": _mlp_forgets_one_branch}),
    (ex09.check_swiglu_mlp_backward, {"swiglu_mlp_backward": _mlp_assumes_3d}),
    (ex09.check_silu_backward, {"silu_backward": lambda x, dy: dy * torch.sigmoid(x)}),
    (ex09.check_silu_backward__large_inputs, {"silu_backward": _silu_quotient}),
], ids=["missing-transpose", "linear-3d-only", "rmsnorm-dropped-term", "rmsnorm-no-eps", "ce-wrong-mean",
        "ce-hardcoded-ignore-index", "ce-nonnegative-is-valid", "ce-naive-softmax", "mlp-one-branch", "mlp-3d-only",
        "silu-no-product-rule", "silu-quotient-overflow"])
def test_checks_catch_the_classic_mistakes(check, mutant):
    with pytest.raises(AssertionError, match=f"^{next(iter(mutant))}: "):
        check(_solutions(**mutant))


def test_a_crash_is_reported_as_a_one_line_mismatch_naming_the_input():
    with pytest.raises(AssertionError, match=r"^linear_backward: raised \w+ at x shape \(7, 5\)"):
        ex09.check_linear_backward(_solutions(linear_backward=_linear_assumes_3d))

