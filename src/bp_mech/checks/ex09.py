"""Checks of exercises/ex09_local_backward.py against float64 autograd (never the answer file).

Each ``check_*`` takes the solutions module and raises AssertionError on a wrong answer. Inputs are
fresh random tensors with every leading shape the docstrings allow (2-D, 3-D and 4-D), a square
weight so that a missing transpose gives wrong numbers rather than a shape error, rows where RMSNorm's
eps decides, ``ignore_index`` at values other than -100, and inputs large enough that a formula
without a stable softmax or sigmoid overflows. The contract around the numbers (inputs unchanged,
strided views, no aliasing, float32 in float32 out), the LayerNorm variant and the saved-bytes
prediction: ``ex09_contract``.
"""

import torch
import torch.nn.functional as F

from bp_mech.checks import ex09_contract
from bp_mech.checks.common import (
    assert_all_close,
    assert_close,
    autograd_grads,
    call,
    randn64,
)

TOL = 1e-10  # float64: hand-written and autograd agree to rounding
REF = "float64 autograd"
# (leading shape, C_in, C_out): 3-D square, 3-D wide, 2-D square, 4-D
LINEAR_SHAPES = [((2, 5), 8, 8), ((3, 4), 6, 10), ((7,), 5, 5), ((2, 3, 2), 6, 4)]


def check_linear_backward(m):
    for seed, (lead, ci, co) in enumerate(LINEAR_SHAPES):
        g = torch.Generator().manual_seed(100 + seed)
        x, W, b, dy = randn64(g, *lead, ci), randn64(g, co, ci), randn64(g, co), randn64(g, *lead, co)
        at = f"x shape {tuple(x.shape)}, W shape {tuple(W.shape)}"
        got = call("linear_backward", m.linear_backward, x, W, dy, at=at)
        want = autograd_grads(F.linear, [x, W, b], dy)
        assert_all_close("linear_backward", ("dx", "dW", "db"), got, want, tol=TOL, ref=REF, at=at)


def check_silu_backward(m):
    for seed, shape in enumerate([(3, 7, 9), (11,), (4, 6), (2, 3, 2, 5)]):
        g = torch.Generator().manual_seed(7 + seed)
        x, dy = randn64(g, *shape) * 3, randn64(g, *shape)
        at = f"shape {shape}"
        got = call("silu_backward", m.silu_backward, x, dy, at=at)
        assert_close("silu_backward", "dx", got, autograd_grads(F.silu, [x], dy)[0], tol=TOL, ref=REF, at=at)


def check_silu_backward__large_inputs(m):
    x = torch.tensor([-1000.0, -750.0, -100.0, -40.0, 0.0, 40.0, 100.0, 750.0, 1000.0], dtype=torch.float64)
    dy = torch.linspace(-1, 1, len(x), dtype=torch.float64) + 0.3
    at = "x = ±40, ±100, ±750, ±1000 (exp(-x) overflows: use sigmoid, not a quotient of exponentials)"
    got = call("silu_backward", m.silu_backward, x, dy, at=at)
    assert_close("silu_backward", "dx", got, autograd_grads(F.silu, [x], dy)[0], tol=TOL, ref=REF, at=at)


def _rmsnorm_case(m, x, w, dy, eps, at):
    C = x.shape[-1]
    want = autograd_grads(lambda x, w: F.rms_norm(x, (C,), w, eps), [x, w], dy)
    got = call("rmsnorm_backward", m.rmsnorm_backward, x, w, dy, eps, at=at)
    assert_all_close("rmsnorm_backward", ("dx", "dw"), got, want, tol=TOL, ref=REF, at=at)


def check_rmsnorm_backward(m):
    for seed, (lead, eps) in enumerate((((2, 5), 1e-6), ((7,), 1e-2), ((2, 2, 3), 1e-6))):
        g = torch.Generator().manual_seed(1 + seed)
        x, w, dy = randn64(g, *lead, 12), 1 + 0.3 * randn64(g, 12), randn64(g, *lead, 12)
        _rmsnorm_case(m, x, w, dy, eps, f"x shape {tuple(x.shape)}, eps {eps:g}")


def check_rmsnorm_backward__tiny_rows(m):
    g = torch.Generator().manual_seed(4)
    x, w, dy = randn64(g, 2, 4, 12), 1 + 0.3 * randn64(g, 12), randn64(g, 2, 4, 12)
    x[0, 1] = 0.0  # a zero row (a padding vector): only eps keeps r finite
    x[1, 2] *= 1e-4  # mean(x^2) ~ 1e-8, far below eps: eps decides r
    _rmsnorm_case(m, x, w, dy, 1e-6, f"x shape {tuple(x.shape)} with a zero row and a row of ~1e-4, eps 1e-06")


def check_swiglu_mlp_backward(m):
    # (leading shape, C, I): square projections (a transposed weight keeps its shape), 2-D wide, 4-D
    for seed, (lead, C, I) in enumerate([((2, 4), 8, 8), ((5,), 6, 10), ((2, 3, 2), 4, 7)]):
        g = torch.Generator().manual_seed(3 + seed)
        x, dy = randn64(g, *lead, C), randn64(g, *lead, C)
        Wg, Wu, Wd = randn64(g, I, C) / 3, randn64(g, I, C) / 3, randn64(g, C, I) / 3

        def ref(x, Wg, Wu, Wd):
            return F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)

        at = f"x shape {tuple(x.shape)}, I = {I}"
        got = call("swiglu_mlp_backward", m.swiglu_mlp_backward, x, Wg, Wu, Wd, dy, at=at)
        want = autograd_grads(ref, [x, Wg, Wu, Wd], dy)
        assert_all_close("swiglu_mlp_backward", ("dx", "dWg", "dWu", "dWd"), got, want, tol=TOL, ref=REF, at=at)


def _ce_case(m, logits, targets, ignore_index, at, pass_default=False):
    want = autograd_grads(lambda z: F.cross_entropy(z, targets, ignore_index=ignore_index), [logits],
                          torch.ones((), dtype=torch.float64))[0]
    args = (logits.clone(), targets.clone()) + (() if pass_default else (ignore_index,))
    got = call("cross_entropy_backward", m.cross_entropy_backward, *args, at=at)
    assert_close("cross_entropy_backward", "dlogits", got, want, tol=TOL, ref=REF, at=at)


def check_cross_entropy_backward(m):
    g = torch.Generator().manual_seed(5)
    logits = randn64(g, 12, 17) * 2
    targets = torch.randint(0, 17, (12,), generator=g)
    targets[[1, 4, 5]] = -100  # padding: ignored, and not counted in the mean
    _ce_case(m, logits, targets, -100, "logits shape (12, 17), 3 of 12 targets -100 (default ignore_index)",
             pass_default=True)


def check_cross_entropy_backward__ignore_index(m):
    V = 17
    for seed, ignore in enumerate((-1, 3, V)):  # negative, a real class id (a pad token), past the vocabulary
        g = torch.Generator().manual_seed(50 + seed)
        logits = randn64(g, 12, V) * 2
        targets = torch.randint(0, V, (12,), generator=g)
        targets[targets == ignore] = (ignore + 1) % V  # the real targets avoid the ignored id ...
        targets[[0, 6, 7, 11]] = ignore  # ... and four rows carry it
        _ce_case(m, logits, targets, ignore, f"logits shape (12, {V}), ignore_index={ignore} on 4 of 12 rows")


def check_cross_entropy_backward__large_logits(m):
    g = torch.Generator().manual_seed(6)
    shift = torch.tensor([1000.0, -1000.0, 0.0, 800.0, -800.0, 0.0], dtype=torch.float64)
    logits = randn64(g, 6, 11) * 2 + shift[:, None]
    targets = torch.randint(0, 11, (6,), generator=g)
    _ce_case(m, logits, targets, -100, "logits shape (6, 11) with rows shifted by ±800 and ±1000 "
                                       "(exp overflows: subtract the row max)")


CHECKS = [check_linear_backward, check_silu_backward, check_silu_backward__large_inputs, check_rmsnorm_backward,
          check_rmsnorm_backward__tiny_rows, check_swiglu_mlp_backward, check_cross_entropy_backward,
          check_cross_entropy_backward__ignore_index, check_cross_entropy_backward__large_logits,
          *ex09_contract.CHECKS]  # the contract, the LayerNorm variant and the saved-bytes prediction
