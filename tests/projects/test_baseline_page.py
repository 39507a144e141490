"""Project 73's page and its back-of-envelope: the page's TeX holds no control characters (a ``\\t``
and a ``\\r`` from a non-raw Python string once rendered ``g_ ext{1 process} ... Vert``); the model
FLOPs per token agree with torch's own FLOP counter of a real forward and backward; MFU is the
ratio it says; the rank-check figure draws what it is given."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bp_mech.instruments.workload import build_model
from bp_mech.book import project_plots
from bp_mech.projects import baseline_flops
from bp_mech.records import registry

matplotlib.use("Agg")
PAGE = Path(__file__).resolve().parents[2] / "book" / "projects" / "73-baseline.md"
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # every control character but the line feed
MATH = re.compile(r"\$\$(.+?)\$\$|\$([^$\n]+)\$", re.S)


def test_the_page_holds_no_control_characters_and_its_tex_no_broken_commands():
    text = PAGE.read_text(encoding="utf-8")
    bad = [(text.count("\n", 0, m.start()) + 1, repr(m.group())) for m in CONTROL.finditer(text)]
    assert not bad, f"control characters at (line, char): {bad}"
    for m in MATH.finditer(text):
        tex = m.group(1) or m.group(2)
        # \text, \frac, \right, \left, \rVert whose backslash a string escape ate (\t, \f, \r)
        assert not re.search(r"(?<!\\t)ext\{|(?<!\\f)rac\{|(?<!\\[lr])Vert|(?<!\\r)ight\b|(?<!\\l)eft\b",
                             tex), tex
    assert r"$\lVert g - g_\text{1 process}\rVert / \lVert g_\text{1 process}\rVert$" in text


@pytest.fixture(scope="module")
def tiny():
    ctx = registry.make_context("TRAIN-BASELINE", mode="cpu")
    return build_model(ctx.workload), ctx.workload.seq


def test_token_flops_match_torchs_flop_counter_of_a_real_step(tiny):
    """Independent reference: torch counts every matrix product of one forward and backward
    (eager attention, so that attention's products are counted too). The only products the
    formula leaves out are the rotary frequencies' (a few thousand FLOPs)."""
    model, seq = tiny
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    model.config._attn_implementation = "sdpa"
    model.zero_grad(set_to_none=True)
    f = baseline_flops.token_flops(model, seq)
    assert f.total * ids.numel() == pytest.approx(counter.get_total_flops(), rel=1e-4)
    # the weights' term alone is 6 N: all the products but attention's two (bmm)
    mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "bmm" not in str(op))
    assert f.weights * ids.numel() == mm


def test_mfu_is_model_flops_over_the_processes_capacity():
    assert baseline_flops.mfu(1e6, 500.0, 1, 1e10) == pytest.approx(0.05)
    assert baseline_flops.mfu(1e6, 500.0, 2, 1e10) == pytest.approx(0.025)


def test_matmul_throughput_is_a_plausible_rate_on_one_thread():
    before = torch.get_num_threads()
    rate = baseline_flops.matmul_throughput(n=128, repeats=3)
    assert torch.get_num_threads() == before  # the thread count is restored
    assert 1e7 < rate < 1e13  # 10 MFLOP/s .. 10 TFLOP/s: a CPU core, whatever it is


def test_rank_check_figure_draws_the_tokens_and_the_errors():
    tokens = [[10, 12], [11, 11], [9, 14]]
    fig = project_plots.plot_rank_check(tokens, [1e-16, 2e-16, 3e-16], [1e-2, 1e-3, 2e-2], "t")
    left, right = fig.axes
    heights = sorted(p.get_height() for p in left.patches)
    assert heights == sorted(t for row in tokens for t in row)
    naive, divisor = right.get_lines()[:2]
    assert list(naive.get_ydata()) == [1e-2, 1e-3, 2e-2]
    assert list(divisor.get_ydata()) == [1e-16, 2e-16, 3e-16]
    assert right.get_yscale() == "log"
