"""``book.memory_plots``: the ledger stacked by class per stage, the sources side by side, the frontier's
points and the transfer bars, read back in the unit each picks (MiB from 1 MiB up, else KiB)."""

import matplotlib.pyplot as plt
import pytest

from bp_mech.book import memory_plots

MIB = 2**20
STAGES = {"load": "after load", "forward": "after forward"}
CLASSES = {"parameters": "params", "gradients": "grads"}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_the_ledger_stacks_the_classes_per_stage_one_panel_per_strategy():
    led = {"load": {"parameters": 2 * MIB, "gradients": 0}, "forward": {"parameters": 2 * MIB, "gradients": MIB}}
    fig = memory_plots.plot_ledger_stages({"plain": led, "ckpt": led}, STAGES, CLASSES, "t")
    ax = fig.axes[0]
    assert len(fig.axes) == 2 and ax.get_title() == "plain"
    bars = [(b.get_x() + b.get_width() / 2, b.get_y(), b.get_height()) for b in ax.patches]
    assert bars == [(0, 0, 2.0), (1, 0, 2.0), (0, 2.0, 0.0), (1, 2.0, 1.0)]  # params, then grads on top


def test_the_sources_side_by_side():
    fig = memory_plots.plot_ledger_sources({"formula": {"load": MIB, "forward": 3 * MIB},
                                            "tracked": {"load": MIB, "forward": 4 * MIB}}, STAGES, "t")
    assert [b.get_height() for b in fig.axes[0].patches] == [1.0, 3.0, 1.0, 4.0]


def test_the_frontier_in_ms_and_kib_below_a_mib():
    fig = memory_plots.plot_memory_time({"plain": (512 * 1024, 0.010, 0.012), "ckpt": (256 * 1024, 0.013, 0.011)},
                                        "plain", "t")
    ax = fig.axes[0]
    points = [(ln.get_xdata()[0], ln.get_ydata()[0]) for ln in ax.get_lines() if ln.get_marker() in ("s", "o")]
    assert points == [pytest.approx((10.0, 512.0)), pytest.approx((13.0, 256.0))]
    assert ax.get_ylabel() == "allocated peak (KiB)"  # a P95 below the median draws no whisker: max(0, ...)


def test_transfer_bars_treat_a_missing_series_as_zero():
    fig = memory_plots.plot_transfer_bytes({"offload": {"d2h": 2 * MIB, "h2d": 2 * MIB}, "plain": {"d2h": 0}}, "t")
    assert [b.get_height() for b in fig.axes[0].patches] == [2.0, 0.0, 2.0, 0.0]
    assert fig.axes[0].get_ylabel() == "bytes per step (MiB)"
