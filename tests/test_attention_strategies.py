"""``attention_strategies``: each hand-written strategy's forward and backward called directly, against
autograd through the brute-force attention of ``test_attention_framework`` (float64), and what each saves,
by hand. The strategies inside autograd (gradcheck, Qwen2's layer, peaks): ``tests/test_attention_backward.py``."""

import pytest
import torch

from bp_mech.attention_strategies import STRATEGIES, saved_bytes, saved_bytes_formula
from bp_mech.attention_config import AttnConfig
from bp_mech.attention_framework import attention_fn
from test_attention_framework import brute_attention, inputs


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("T, block", [(6, 4), (5, 2), (3, 8)])  # a short last tile, several, one bigger than T
def test_forward_then_backward_by_hand_equal_autograd_of_the_brute_force(name, T, block):
    q, k, v, cos, sin = inputs(B=1, T=T, seed=T)
    forward, backward = STRATEGIES[name]
    o, saved = forward(q, k, v, cos, sin, block)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = brute_attention(*leaves)
    dO = torch.randn_like(ref)
    torch.testing.assert_close(o, ref.detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(backward(saved, dO, block), torch.autograd.grad(ref, leaves, dO)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_saved_bytes_by_hand():
    cfg, T = AttnConfig(batch=1, heads=2, kv_heads=1, head_dim=4, rope_theta=1e4), 3
    # RoPE'd q 1·2·3·4 = 24, k and v 2·(1·1·3·4) = 24, cos and sin 2·3·4 = 24: 72 values in both
    assert saved_bytes_formula(cfg, T, "saved_probs") == (72 + 1 * 2 * 3 * 3) * 4  # + P (B, H, T, T)
    assert saved_bytes_formula(cfg, T, "recompute") == (72 + 24 + 1 * 2 * 3) * 4  # + O (B, H, T, d) and L (B, H, T)
    assert saved_bytes_formula(cfg, T, "recompute", itemsize=8) == 2 * saved_bytes_formula(cfg, T, "recompute")
    q, k, v, cos, sin = (t.float() for t in inputs(B=1, H=2, Hkv=1, T=3))
    for name in STRATEGIES:
        assert saved_bytes(attention_fn(name, 2), (q, k, v, cos, sin)) == saved_bytes_formula(cfg, T, name)
