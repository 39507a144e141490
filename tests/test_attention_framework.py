"""``attention_framework``: the framework's attentions and the strategies under autograd, each against a
brute force written from the definitions (every query row by itself: rotate q and k pair by pair, score
the keys up to its position, softmax, weigh the values of its KV group), in float64."""

import math

import pytest
import torch

from bp_mech.attention_framework import FRAMEWORK, attention_fn, autograd_attention, sdpa_attention
from bp_mech.attention_rope import rope_cos_sin
from bp_mech.attention_strategies import STRATEGIES

THETA = 1e4


def _rotated(x: torch.Tensor, t: int) -> torch.Tensor:
    """The vector x (d,) at position t: pair (x_i, x_{i+d/2}) turned by t·theta^(-2i/d)."""
    d, out = x.shape[-1], x.clone()
    for i in range(d // 2):
        a = t * THETA ** (-2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


def brute_attention(q, k, v):
    """O (B, H, T, d), one query row at a time; differentiable (torch ops on rows)."""
    B, H, T, d = q.shape
    group = H // k.shape[1]
    rows = []
    for b in range(B):
        for h in range(H):
            keys = [_rotated(k[b, h // group, s], s) for s in range(T)]
            for t in range(T):
                qt = _rotated(q[b, h, t], t)
                scores = torch.stack([qt @ keys[s] for s in range(t + 1)]) / math.sqrt(d)
                p = torch.exp(scores - scores.max())
                rows.append((p / p.sum()) @ v[b, h // group, : t + 1])
    return torch.stack(rows).reshape(B, H, T, d)


def inputs(B=2, H=4, Hkv=2, T=6, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, d, dtype=torch.float64, generator=g) for n in (H, Hkv, Hkv))
    return q, k, v, *rope_cos_sin(T, d, THETA, torch.float64)


@pytest.mark.parametrize("name", [*FRAMEWORK, *STRATEGIES])
def test_every_attention_equals_the_brute_force(name):
    q, k, v, cos, sin = inputs()
    torch.testing.assert_close(attention_fn(name, block=4)(q, k, v, cos, sin), brute_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_multi_head_attention_is_the_group_of_one():
    q, k, v, cos, sin = inputs(H=2, Hkv=2, T=5, seed=1)
    want = brute_attention(q, k, v)
    for fn in (autograd_attention, sdpa_attention):
        torch.testing.assert_close(fn(q, k, v, cos, sin), want, rtol=1e-12, atol=1e-12)


def test_position_zero_attends_to_itself_alone():
    q, k, v, cos, sin = inputs(T=4, seed=2)
    torch.testing.assert_close(sdpa_attention(q, k, v, cos, sin)[:, :, 0], v.repeat_interleave(2, 1)[:, :, 0])


def test_an_unknown_name_is_refused():
    with pytest.raises(KeyError):
        attention_fn("flash")
