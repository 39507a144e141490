"""``book.plots``: what each figure draws, read back from its artists against the values given (units by
hand: MiB, ms, x from update 1). The AMP, clock and update figures of their own modules: their own tests."""

import math

import matplotlib.pyplot as plt
import pytest

from bp_mech.book import plots

MIB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_error_bars_group_the_series_and_floor_a_zero_for_the_log_axis():
    fig = plots.plot_error_bars({"linear": {"f64": 1e-16, "f32": 1e-7}, "silu": {"f64": 0.0, "f32": 2e-7}}, "t")
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1e-16, 1e-18, 1e-7, 2e-7]  # series by series; 0 drawn at 1e-18
    assert ax.get_yscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["linear", "silu"]


def test_saved_bytes_in_mib_with_guides_of_slope_one_and_two_through_the_first_point():
    fig = plots.plot_saved_bytes({"a": {64: MIB, 256: 4 * MIB}, "b": {64: 2 * MIB, 256: 32 * MIB}})
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert list(lines["a"].get_ydata()) == [1.0, 4.0] and list(lines["b"].get_xdata()) == [64, 256]
    assert list(lines["∝ T^1"].get_ydata()) == [1.0, 4.0]  # from the lowest first point, x4 in T
    assert list(lines["∝ T^2"].get_ydata()) == [1.0, 16.0]


def test_backward_times_in_ms_with_a_whisker_to_the_p95():
    fig = plots.plot_backward_times({"a": (0.010, 0.015), "b": (0.002, 0.002)}, "t")
    ax = fig.axes[0]
    dots = ax.get_lines()[0]
    assert list(dots.get_ydata()) == pytest.approx([10.0, 2.0])
    whiskers = ax.collections[0].get_segments()
    assert [tuple(s[:, 1]) for s in whiskers] == [pytest.approx((10.0, 15.0)), pytest.approx((2.0, 2.0))]


def test_accumulation_peaks_stack_the_increment_on_the_resident_bytes():
    fig = plots.plot_accumulation_peaks({"T=128": {"full": (2 * MIB, 3 * MIB), "micro2": (2 * MIB, MIB)}}, "t")
    bars = fig.axes[0].patches
    assert [(b.get_y(), b.get_height()) for b in bars] == [(0, 2.0), (0, 2.0), (2.0, 3.0), (2.0, 1.0)]


def test_an_update_trace_starts_at_update_one_and_draws_a_missing_value_as_a_gap():
    fig = plots.plot_update_trace({"base": [1.0, None, 3.0]}, "loss", "t", hline=2.0, hlabel="bound")
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert list(lines["base"].get_xdata()) == [1, 2, 3] and math.isnan(lines["base"].get_ydata()[1])
    assert list(lines["bound"].get_ydata()) == [2.0, 2.0]
