"""``planner.costs``: the forward FLOPs of a fake tiny Qwen2 by hand (2 x inputs x outputs per matmul, SDPA's
causal core 2 B T^2 H d), SDPA's core, and a strategy's cost from counts made up by hand. The cached GPU
ratios beside the plan: ``tests/planner/test_plan.py``."""

from types import SimpleNamespace

import pytest

from bp_mech.bench.rates import ASSUMED_FLOPS
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import ARCHITECTURES, parse_workload
from bp_mech.ledger_table import Counts
from bp_mech.planner import lifecycle
from bp_mech.planner.costs import Flops, cached_ratios, cost, forward_flops, sdpa_core


def test_the_forward_flops_of_a_tiny_qwen2_by_hand():
    w = parse_workload("tiny-b2s16")
    a = ARCHITECTURES["tiny"]
    n, C, I, V, H = w.batch * w.seq, a["hidden_size"], a["intermediate_size"], a["vocab_size"], a["num_attention_heads"]
    Ckv, L = a["num_key_value_heads"] * C // H, a["num_hidden_layers"]
    attn = 2 * n * (C * C + 2 * C * Ckv + C * C) + 2 * w.batch * w.seq ** 2 * H * (C // H)  # q, k, v, o + core
    mlp = 2 * n * 3 * C * I
    head = 2 * n * C * V
    f = forward_flops(lifecycle.Session(w, fake=True))
    assert (f.attn, f.mlp, f.head) == ([attn] * L, [mlp] * L, head)
    rope = 2 * (C // H // 2) * w.seq  # the rotary embedding's angles: inv_freq (d/2, 1) @ positions (1, T)
    assert f.total == L * (attn + mlp) + head + rope


def test_the_sdpa_core_per_module_or_config():
    cfg = SimpleNamespace(num_attention_heads=8, hidden_size=64)
    assert sdpa_core(SimpleNamespace(), cfg, 2, 10) == 2 * 2 * 10 * 10 * 8 * 8
    assert sdpa_core(SimpleNamespace(num_heads=4, head_dim=32), cfg, 1, 4) == 2 * 1 * 4 * 4 * 4 * 32
    assert sdpa_core(None, cfg, 2, 10) == 0  # a block without attention


def test_a_strategy_s_cost_from_its_counts():
    flops = Flops(attn=[10, 10], mlp=[30, 30], head=50, total=200)
    led = SimpleNamespace(counts=Counts(recomputes=4, attn_calls=4, mlp_calls=4, d2h_bytes=0, h2d_bytes=0))
    c = cost(led, parse("checkpoint-all"), flops, link=1.0)  # every attention and MLP once more
    assert c.recompute_flops == 10 + 10 + 30 + 30 and c.extra == pytest.approx(80 / 600) and c.transfer_s == 0
    led = SimpleNamespace(counts=Counts(0, 4, 4, d2h_bytes=300, h2d_bytes=100))
    c = cost(led, parse("micro2+chunked-loss"), flops, link=200.0)  # 2 micro-batches: 4 calls are no recompute
    plain_s = 3 * 200 / ASSUMED_FLOPS["cuda"]["float32"]
    assert c.recompute_flops == 50 and c.transfer_s == 2.0  # the second lm_head matmul; 400 B at 200 B/s
    assert c.extra == pytest.approx(50 / 600 + 2.0 / plain_s)


def test_no_cached_records_no_ratios(tmp_path):
    assert cached_ratios(results_dir=tmp_path) == ({}, [])
