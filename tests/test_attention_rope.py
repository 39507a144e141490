"""``attention_rope``: RoPE as the rotation it is, by hand (each pair (x_i, x_{i+d/2}) turned by the angle
t·theta^(-2i/d), in Python floats), and its backward as the forward's adjoint. The tables against
transformers' ``Qwen2RotaryEmbedding``: ``tests/test_attention_backward.py``."""

import math

import torch

from bp_mech.attention_rope import rope_backward, rope_cos_sin, rope_forward, rotate_half

G = torch.Generator().manual_seed(10)


def test_rotate_half_is_a_quarter_turn_of_each_pair():
    d = 6
    R = rotate_half(torch.eye(d, dtype=torch.float64)).T  # column j: R e_j
    assert torch.equal(R.T, -R) and torch.equal(R @ R, -torch.eye(d, dtype=torch.float64))
    assert R[3, 0] == 1.0 and R[0, 3] == -1.0  # (x_0, x_3) -> (-x_3, x_0)


def test_the_forward_turns_each_pair_by_its_angle():
    T, d, theta = 5, 4, 100.0
    x = torch.randn(T, d, dtype=torch.float64, generator=G)
    y = rope_forward(x, *rope_cos_sin(T, d, theta, torch.float64))
    for t in range(T):
        for i in range(d // 2):
            a = t * theta ** (-2 * i / d)
            x1, x2 = x[t, i].item(), x[t, i + d // 2].item()
            assert math.isclose(y[t, i].item(), x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-12)
            assert math.isclose(y[t, i + d // 2].item(), x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-12)


def test_the_backward_is_the_adjoint_of_the_linear_forward():
    cos, sin = rope_cos_sin(7, 8, 1e4, torch.float64)
    dx, dy = (torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=G) for _ in range(2))
    # <J^T dy, dx> = <dy, J dx>, and J dx = rope_forward(dx): the forward is linear in x
    lhs, rhs = (rope_backward(dy, cos, sin) * dx).sum(), (dy * rope_forward(dx, cos, sin)).sum()
    assert math.isclose(lhs.item(), rhs.item(), rel_tol=1e-12)


def test_the_tables_are_computed_in_float64_then_cast():
    cos, sin = rope_cos_sin(3, 2, 1e4, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert sin[2, 0].item() == torch.tensor(math.sin(2.0)).bfloat16().item()  # one rounding, not several
