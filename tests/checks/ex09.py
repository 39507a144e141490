"""Checks of exercises/ex09_local_backward.py against float64 autograd (never the answer file).

Each ``check_*`` takes the solutions module and raises AssertionError on a wrong answer.
Inputs are fresh random tensors, including a square weight so that a missing transpose
gives wrong numbers rather than a shape error.
"""

import torch
import torch.nn.functional as F

TOL = 1e-10  # float64: hand-written and autograd agree to rounding
SHAPES = [(2, 5, 8, 8), (3, 4, 6, 10)]  # (B, T, C_in, C_out); the first is square


def _close(name, got, want):
    assert got is not None, f"{name}: returned None"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:g} against float64 autograd"


def _grads(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dy)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def check_linear_backward(m):
    for seed, (B, T, ci, co) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(100 + seed)
        x, W, b, dy = _rand(g, B, T, ci), _rand(g, co, ci), _rand(g, co), _rand(g, B, T, co)
        want = _grads(F.linear, [x, W, b], dy)
        got = m.linear_backward(x, W, dy)
        for name, a, w in zip(("dx", "dW", "db"), got, want):
            _close(f"linear_backward {name}", a, w)


def check_silu_backward(m):
    g = torch.Generator().manual_seed(7)
    x, dy = _rand(g, 3, 7, 9) * 3, _rand(g, 3, 7, 9)
    _close("silu_backward dx", m.silu_backward(x, dy), _grads(F.silu, [x], dy)[0])


def check_rmsnorm_backward(m):
    for seed, eps in ((1, 1e-6), (2, 1e-2)):
        g = torch.Generator().manual_seed(seed)
        x, w, dy = _rand(g, 2, 5, 12), 1 + 0.3 * _rand(g, 12), _rand(g, 2, 5, 12)
        want = _grads(lambda x, w: F.rms_norm(x, (12,), w, eps), [x, w], dy)
        dx, dw = m.rmsnorm_backward(x, w, dy, eps)
        _close("rmsnorm_backward dx", dx, want[0])
        _close("rmsnorm_backward dw", dw, want[1])


def check_swiglu_mlp_backward(m):
    g = torch.Generator().manual_seed(3)
    C, I = 8, 8  # square projections: a transposed weight still has the right shape
    x, dy = _rand(g, 2, 4, C), _rand(g, 2, 4, C)
    Wg, Wu, Wd = _rand(g, I, C) / 3, _rand(g, I, C) / 3, _rand(g, C, I) / 3

    def ref(x, Wg, Wu, Wd):
        return F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)

    want = _grads(ref, [x, Wg, Wu, Wd], dy)
    got = m.swiglu_mlp_backward(x, Wg, Wu, Wd, dy)
    for name, a, w in zip(("dx", "dWg", "dWu", "dWd"), got, want):
        _close(f"swiglu_mlp_backward {name}", a, w)


def check_cross_entropy_backward(m):
    g = torch.Generator().manual_seed(5)
    logits = _rand(g, 12, 17) * 2
    targets = torch.randint(0, 17, (12,), generator=g)
    targets[[1, 4, 5]] = -100  # padding: ignored, and not counted in the mean
    want = _grads(lambda z: F.cross_entropy(z, targets, ignore_index=-100), [logits], torch.ones((), dtype=torch.float64))
    _close("cross_entropy_backward dlogits", m.cross_entropy_backward(logits.clone(), targets), want[0])


CHECKS = [check_linear_backward, check_silu_backward, check_rmsnorm_backward, check_swiglu_mlp_backward,
          check_cross_entropy_backward]
