"""Part 02 · 55's figure helpers (bp_mech.book.update_plots): the ratios read from a trace, the
updates that leave the band, and the band drawn where it is given."""

import math

import matplotlib.pyplot as plt

from bp_mech.book import update_plots


def _trace(ratios):
    return [dict(groups={"mlp": dict(ratio=r), "norms": dict(ratio=r / 100)}) for r in ratios]


def test_ratios_of_reads_each_group_per_update():
    got = update_plots.ratios_of({"a": _trace([0.5, 0.01]), "empty": None})
    assert got == {"a": {"mlp": [0.5, 0.01], "norms": [0.005, 0.0001]}}


def test_updates_above_counts_any_group_and_non_finite():
    ratios = {"a": {"mlp": [5.0, 0.2, 0.1, 0.01], "norms": [0.01, 0.01, 0.01, 0.3]},
              "b": {"mlp": [None, math.nan, 0.01, 0.01], "norms": [0.0, 0.0, 0.0, 0.0]}}
    assert update_plots.updates_above(ratios, 0.1) == {"a": [0, 1, 3], "b": [0, 1]}  # 0.1: not above


def test_the_band_is_drawn_between_its_edges():
    ratios = update_plots.ratios_of({"a": _trace([0.5, 0.01]), "b": _trace([0.05, 0.02])})
    fig = update_plots.plot_ratio_band(ratios, (1e-3, 0.1), ("low", "high"), "t")
    try:
        assert len(fig.axes) == 2
        ax = fig.axes[0]
        span = ax.patches[0]  # a Rectangle from axhspan: y in data coordinates
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert lines["low"].get_ydata()[0] == 1e-3 and lines["high"].get_ydata()[0] == 0.1
        assert list(lines["a"].get_ydata()) == [0.5, 0.01] and ax.get_yscale() == "log"
        assert math.isclose(span.get_y(), 1e-3) and math.isclose(span.get_y() + span.get_height(), 0.1)
    finally:
        plt.close(fig)
