"""Tests of bp_mech.attention_backward: values against autograd, finite differences and
transformers (through the experiment's comparisons); saved bytes against the formula; and mutants
that the exercise checks (src/bp_mech/checks/ex10.py) must catch. The run, its plan and the conformance
row: tests/experiments/test_attention_backward.py."""

import math
import types

import pytest
import torch
from conftest import ROOT, load_solution

from bp_mech import attention_backward, attention_framework, attention_strategies
from bp_mech import attention_config, attention_rope
from bp_mech.instruments.peak import PeakMemory
from bp_mech.checks import ex10
from bp_mech.experiments import attention_backward as experiment

CFG = attention_config.AttnConfig(batch=2, heads=4, kv_heads=2, head_dim=8, rope_theta=1e4, block=8)


def test_both_strategies_match_autograd_float64_and_sdpa_float32():
    errs = experiment.errors(CFG, 21)  # 21: the last tile is short
    for name in attention_strategies.STRATEGIES:
        assert max(errs[name]["float64_vs_autograd"].values()) <= experiment.TOL64, errs[name]
        assert max(errs[name]["float32_vs_sdpa"].values()) <= experiment.TOL32, errs[name]
        assert errs[name]["finite"]


@pytest.mark.parametrize("strategy", list(attention_strategies.STRATEGIES))
def test_hand_attention_gradcheck(strategy):
    """Finite differences, independent of any autograd formula (RoPE, GQA, mask, scale)."""
    cfg = attention_config.AttnConfig(batch=1, heads=4, kv_heads=2, head_dim=4, rope_theta=1e4, block=2)
    (q, k, v, cos, sin), _ = experiment.make_inputs(cfg, 5, torch.float64, seed=3)
    fn = attention_framework.attention_fn(strategy, cfg.block)
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v, cos, sin),
                                    [t.requires_grad_() for t in (q, k, v)])


def test_rope_tables_match_transformers():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from bp_mech.instruments.workload import qwen2_config

    cfg = qwen2_config("tiny")
    d, T = cfg.hidden_size // cfg.num_attention_heads, 64
    x = torch.zeros(1, T, cfg.hidden_size)
    cos_ref, sin_ref = Qwen2RotaryEmbedding(cfg)(x, torch.arange(T)[None])
    cos, sin = attention_rope.rope_cos_sin(T, d, cfg.rope_parameters["rope_theta"])
    torch.testing.assert_close(cos, cos_ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, sin_ref[0], atol=1e-5, rtol=0)


def test_saved_bytes_match_formula_and_grow_as_claimed():
    cfg = attention_config.AttnConfig.from_arch("tiny", 1)
    Ts = (64, 128, 256)
    swept = experiment.sweep_saved_bytes(cfg, Ts)
    for s in attention_strategies.STRATEGIES:
        assert [swept[s][T] for T in Ts] == [attention_strategies.saved_bytes_formula(cfg, T, s) for T in Ts]
    rec, probs = swept["recompute"], swept["saved_probs"]
    assert rec[128] == 2 * rec[64] and rec[256] == 2 * rec[128]  # linear in T
    quad = cfg.batch * cfg.heads * 4  # bytes per T^2 of P (float32)
    assert probs[128] - 2 * probs[64] == quad * (128**2 - 2 * 64**2)  # exactly one T^2 term
    assert swept["autograd"][256] > probs[256] > rec[256]
    assert experiment.growth_exponent(rec) == pytest.approx(1.0)


def test_saved_bytes_counts_each_storage_once():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, x[1:], x)  # one storage, three saved tensors
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.zeros(10)
    assert attention_strategies.saved_bytes(lambda q, k, v: Twice.apply(q), (x, x, x)) == 40


def test_recompute_never_holds_a_full_score_matrix():
    cfg = attention_config.AttnConfig(batch=1, heads=4, kv_heads=2, head_dim=8, rope_theta=1e4, block=32)
    T = 512  # long enough that one (H, T, T) matrix outweighs all the (H, T, d) tensors
    inputs, dO = experiment.make_inputs(cfg, T, torch.float32)
    full = cfg.batch * cfg.heads * T * T * 4
    peaks = {}
    for s in attention_strategies.STRATEGIES:
        with PeakMemory("cpu") as pm:
            experiment.grads(attention_framework.attention_fn(s, cfg.block), inputs, dO)
        peaks[s] = pm.peak.allocated
    assert peaks["recompute"] < full / 4 < full <= peaks["saved_probs"], peaks


@pytest.mark.parametrize("strategy", list(attention_strategies.STRATEGIES))
def test_whole_qwen2_attention_layer(strategy):
    assert experiment.qwen2_module_error(strategy, T=40, block=16) <= experiment.TOL_MODULE


def test_eager_qwen2_attention_with_explicit_mask():
    """transformers' eager path with an explicit additive causal mask (no is_causal flag)."""
    from transformers.models.qwen2.modeling_qwen2 import (
        Qwen2Attention,
        Qwen2RotaryEmbedding,
    )

    from bp_mech.instruments.workload import qwen2_config

    cfg = qwen2_config("tiny", attn_implementation="eager")
    torch.manual_seed(1)
    attn, B, T = Qwen2Attention(cfg, layer_idx=0), 1, 19
    x = torch.randn(B, T, cfg.hidden_size, requires_grad=True)
    cos, sin = Qwen2RotaryEmbedding(cfg)(x, torch.arange(T)[None])
    mask = torch.zeros(1, 1, T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y_ref, _ = attn(x, (cos, sin), mask)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    with torch.no_grad():
        y, dx, g = attention_framework.qwen2_attention_backward(x, attn, cos, sin, dy, "recompute", block=4)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, x.grad, atol=1e-5, rtol=1e-5)
    for n, p in attn.named_parameters():
        torch.testing.assert_close(g[n], p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["tiny", "qwen05"])
def test_qwen2_attention_has_biases_on_qkv_only(arch):
    """Qwen2: q/k/v_proj carry a bias, o_proj none (chapter 10's prose), on the real module."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    from bp_mech.instruments.workload import qwen2_config

    attn = Qwen2Attention(qwen2_config(arch), layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(attn, name).bias is not None, name
    assert attn.o_proj.bias is None
    assert "o_proj.bias" not in dict(attn.named_parameters())


# --- the exercise checks catch the classic mistakes ------------------------------------

ANSWERS = types.SimpleNamespace(
    softmax_backward=attention_backward.softmax_backward, gqa_reduce=attention_backward.gqa_reduce,
    blockwise_backward=attention_backward.blockwise_backward,
    rope_backward=attention_rope.rope_backward,
    attention_head_backward=lambda q, k, v, dO: attention_backward.attention_backward(
        q, k, v, attention_backward.attention_forward(q, k, v)[1], dO))


_ANSWER_FILE = load_solution(ROOT / "answers", "ex10_attention_backward")  # the variant and the prediction
ANSWERS.sliding_window_head_backward = _ANSWER_FILE.sliding_window_head_backward
ANSWERS.predict_eager_saved_bytes = _ANSWER_FILE.predict_eager_saved_bytes


def mutant(**overrides):
    return types.SimpleNamespace(**{**vars(ANSWERS), **overrides})


def _head_with_mask(mask_fn):
    def head(q, k, v, dO):
        T, scale = q.shape[0], q.shape[-1] ** -0.5
        s = (q @ k.T * scale).masked_fill(~mask_fn(T), float("-inf"))
        P = torch.softmax(s, -1)
        return attention_backward.attention_backward(q, k, v, P, dO)
    return head


def _no_scale(fn):
    def wrong(q, k, v, *rest):  # dS not multiplied by 1/sqrt(d): dq, dk come out sqrt(d) times too big
        dq, dk, dv = fn(q, k, v, *rest)
        return dq * math.sqrt(q.shape[-1]), dk * math.sqrt(q.shape[-1]), dv
    return wrong


def _blockwise_with_mask(mask):
    def wrong(*args):
        orig = attention_backward.causal_mask
        attention_backward.causal_mask = mask
        try:
            return attention_backward.blockwise_backward(*args)
        finally:
            attention_backward.causal_mask = orig
    return wrong


def _full_matrix_backward(q, k, v, o, lse, dO, block):  # right values, but a (T, T) matrix
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    T = q.shape[-2]
    P = torch.exp(s - lse[..., None]).masked_fill(~attention_backward.causal_mask(T, T), 0.0)
    return attention_backward.attention_backward(q, k, v, P, dO)


def _per_head_full_matrix_backward(q, k, v, o, lse, dO, block):  # one head at a time, but each a full (T, T)
    out = [torch.empty_like(t) for t in (q, k, v)]
    for h in range(q.shape[:-2].numel()):
        idx = (*torch.unravel_index(torch.tensor(h), q.shape[:-2]),)
        grads = _full_matrix_backward(q[idx], k[idx], v[idx], o[idx], lse[idx], dO[idx], block)
        for o_, g_ in zip(out, grads):
            o_[idx] = g_
    return tuple(out)


def _blockwise_4d_only(q, k, v, o, lse, dO, block):
    _B, _H, _T, _d = q.shape  # the classic unpacking: right for (B, H, T, d) only
    return attention_backward.blockwise_backward(q, k, v, o, lse, dO, block)


def _rope_4d_only(dy, cos, sin):
    x1, x2 = (dy * sin).chunk(2, dim=3)  # dimension 3 is the head width only for (B, H, T, d)
    return dy * cos - torch.cat((-x2, x1), 3)


def _rope_tables_as_t_d(dy, cos, sin):  # assumes (T, d) tables and lifts them to (1, 1, T, d)
    return dy * cos[None, None] - attention_rope.rotate_half(dy * sin[None, None])


def _arange_mask(offset):
    return lambda nq, nk, q0=0, k0=0, device="cpu": (
        torch.arange(k0, k0 + nk)[None, :] <= torch.arange(q0, q0 + nq)[:, None] + offset)


MUTANTS = {
    "softmax without the rowsum term": (ex10.check_softmax_backward, mutant(softmax_backward=lambda P, dP: P * dP)),
    "head: missing 1/sqrt(d) in backward": (ex10.check_attention_head_backward,
                                            mutant(attention_head_backward=_no_scale(ANSWERS.attention_head_backward))),
    "head: mask hides the diagonal": (ex10.check_attention_head_backward, mutant(
        attention_head_backward=_head_with_mask(lambda T: torch.ones(T, T, dtype=torch.bool).tril(-1)))),
    "head: mask shows one future key": (ex10.check_attention_head_backward, mutant(
        attention_head_backward=_head_with_mask(lambda T: torch.ones(T, T, dtype=torch.bool).tril(1)))),
    "gqa: mean instead of sum": (ex10.check_gqa_reduce, mutant(
        gqa_reduce=lambda dx, h: dx.unflatten(1, (h, -1)).mean(2))),
    "gqa: interleaved groups": (ex10.check_gqa_reduce, mutant(
        gqa_reduce=lambda dx, h: dx.unflatten(1, (-1, h)).sum(1))),
    "gqa: summed over all heads": (ex10.check_gqa_reduce, mutant(
        gqa_reduce=lambda dx, h: dx.sum(1, keepdim=True).expand(-1, h, -1, -1))),
    "gqa: first head of each group only": (ex10.check_gqa_reduce, mutant(
        gqa_reduce=lambda dx, h: dx[:, :: dx.shape[1] // h])),
    "blockwise: missing 1/sqrt(d)": (ex10.check_blockwise_backward,
                                     mutant(blockwise_backward=_no_scale(attention_backward.blockwise_backward))),
    "blockwise: mask hides the diagonal": (ex10.check_blockwise_backward,
                                           mutant(blockwise_backward=_blockwise_with_mask(_arange_mask(-1)))),
    "blockwise: mask shows one future key": (ex10.check_blockwise_backward,
                                             mutant(blockwise_backward=_blockwise_with_mask(_arange_mask(1)))),
    "blockwise: builds the full T x T matrix": (ex10.check_blockwise_backward__memory,
                                                mutant(blockwise_backward=_full_matrix_backward)),
    "blockwise: one full T x T matrix per head": (ex10.check_blockwise_backward__memory,
                                                  mutant(blockwise_backward=_per_head_full_matrix_backward)),
    "blockwise: (B, H, T, d) only": (ex10.check_blockwise_backward, mutant(blockwise_backward=_blockwise_4d_only)),
    "softmax: row sum over dimension 2": (ex10.check_softmax_backward, mutant(
        softmax_backward=lambda P, dP: P * (dP - (dP * P).sum(2, keepdim=True)))),
    "rope: (B, H, T, d) only": (ex10.check_rope_backward, mutant(rope_backward=_rope_4d_only)),
    "rope: tables taken as (T, d)": (ex10.check_rope_backward, mutant(rope_backward=_rope_tables_as_t_d)),
    "rope: R^T taken as +R": (ex10.check_rope_backward,
                              mutant(rope_backward=lambda dy, c, s: dy * c + attention_rope.rotate_half(dy * s))),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_checks_catch_mistake(name):
    check, m = MUTANTS[name]
    function = check.__name__.removeprefix("check_").split("__")[0]
    with pytest.raises(AssertionError, match=f"^{function}: "):  # one line that names the function
        check(m)


def test_the_per_head_full_matrix_mutant_is_right_in_value():
    """What the tightened memory check rejects is memory only: its values pass."""
    ex10.check_blockwise_backward(mutant(blockwise_backward=_per_head_full_matrix_backward))


@pytest.mark.parametrize("check", ex10.CHECKS, ids=lambda c: c.__name__)
def test_checks_pass_on_the_package(check):
    check(ANSWERS)

