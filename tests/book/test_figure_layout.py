"""The data figures stay readable at their extremes: a peak at the panel's right end or at its top (19, 42, 43),
fp16's neighbouring landmarks (12b), a legend of fourteen entries (74), the state per GPU (76): no text on top of
another, nothing cut at the figure's edge, and a phase of one operator still visible."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from book.layout import outside, overlaps  # noqa: E402
from bp_mech.book import project_plots  # noqa: E402
from bp_mech.book.amp_plots import StepGradients, plot_fp16_range  # noqa: E402
from bp_mech.book.step_memory import plot_memory_over_step  # noqa: E402
from bp_mech.ledger_table import CLASSES  # noqa: E402
from bp_mech.projects.step_profile import CATEGORIES, StepProfile  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _timeline(n, peak_at, optimizer=1, zero_grad=1):
    phases = ["forward"] * (n // 2) + ["backward"] * (n - n // 2 - optimizer - zero_grad)
    phases += ["optimizer"] * optimizer + ["zero_grad"] * zero_grad
    return [(p, 3_400_000 if i == peak_at else 1_000_000 + 1000 * i) for i, p in enumerate(phases)]


@pytest.mark.parametrize("peak_at", [0, 500, 995, 999])
def test_a_peak_at_either_end_or_the_top_keeps_its_label_inside_and_off_the_title(peak_at):
    fig = plot_memory_over_step({"plain": _timeline(1000, 600), "checkpoint-all": _timeline(1000, peak_at)},
                                "a long title above both panels, as the chapters give it")
    assert overlaps(fig) == [] and outside(fig) == []


def test_a_phase_of_one_operator_is_shaded_wide_enough_to_see():
    fig = plot_memory_over_step({"plain": _timeline(2000, 5)}, "t")
    fig.canvas.draw()
    widths = [p.get_window_extent().width for p in fig.axes[0].patches]  # the phases' shading, in pixels
    assert len(widths) == 4 and min(widths) >= 5, widths  # one operator of two thousand would be < 1


def test_fp16_s_landmarks_do_not_overwrite_each_other():
    g = StepGradients(torch.logspace(-120, 4, 500, base=2.0), 0, "x")
    fig = plot_fp16_range(g, 2.0**16, "gradients against fp16's range")
    assert overlaps(fig) == [] and outside(fig) == []


def _profile():
    t = [float(i) for i in range(50)]
    return StepProfile("cpu", t, {c: [1000 * (k + 1)] * 50 for k, c in enumerate(CATEGORIES)},
                       [("forward", 0, 20), ("backward", 20, 45), ("optimizer", 45, 49), ("zero_grad", 49, 50)],
                       {}, [], {}, 1.0, 1.0)


def test_74_s_legends_are_outside_the_plot_and_inside_the_figure():
    p = _profile()
    fig = project_plots.plot_memory_timeline(p, "Live memory by the profiler's category, tiny-b2s64 (CPU)")
    assert overlaps(fig) == [] and outside(fig) == []
    rows = {pt: {c: 2**20 * (i + 1) for i, c in enumerate(CLASSES)} for pt in ("forward", "backward_peak")}
    profiled = {pt: {c: 2**20 * (i + 1) for i, c in enumerate(CATEGORIES)} for pt in rows}
    fig = project_plots.plot_cross_check(rows, profiled, "Ledger classes | profiler categories, tiny-b2s64")
    assert overlaps(fig) == [] and outside(fig) == []
    legend = (fig.legends or [fig.axes[0].get_legend()])[0]
    assert len(legend.texts) == len(CLASSES) + len(CATEGORIES) and min(t.get_fontsize() for t in legend.texts) >= 8
    tallest = max(b.get_y() + b.get_height() for b in fig.axes[0].patches)
    assert tallest < fig.axes[0].get_ylim()[1]  # no bar cut at the top


def test_76_s_state_per_gpu():
    fig = project_plots.plot_state_per_gpu(7_615_616_512, {8: 16 * 7_615_616_512 / 8},
                                           "Qwen2.5-7B, float32 AdamW: model state per GPU")
    assert overlaps(fig) == [] and outside(fig) == []
