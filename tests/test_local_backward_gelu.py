"""``local_backward_gelu``: exact GELU against ``math.erf`` in Python floats, and its backward against
central finite differences (float64) and ``F.gelu``'s autograd on extreme inputs."""

import math

import torch
import torch.nn.functional as F

from bp_mech.local_backward_gelu import gelu_backward, gelu_forward

X = [-30.0, -3.5, -1.0, -1e-8, 0.0, 0.3, 2.0, 40.0]


def test_the_forward_is_x_times_the_normal_cdf():
    y = gelu_forward(torch.tensor(X, dtype=torch.float64))
    for x, got in zip(X, y.tolist()):
        assert math.isclose(got, x * 0.5 * (1 + math.erf(x / math.sqrt(2))), rel_tol=1e-15, abs_tol=1e-300)


def test_the_backward_is_the_central_difference_of_the_forward():
    x, h = torch.tensor(X, dtype=torch.float64), 1e-6
    fd = (gelu_forward(x + h) - gelu_forward(x - h)) / (2 * h)
    torch.testing.assert_close(gelu_backward(x, torch.ones_like(x)), fd, rtol=1e-8, atol=1e-9)


def test_the_backward_matches_torch_s_exact_gelu_in_float32_without_overflow():
    x = torch.tensor(X + [-100.0, 100.0], requires_grad=True)
    dy = torch.linspace(-2, 2, len(X) + 2)
    F.gelu(x).backward(dy)
    got = gelu_backward(x.detach(), dy)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, x.grad, rtol=1e-6, atol=1e-7)
