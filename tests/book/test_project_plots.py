"""``book.project_plots``: what the project pages' figures draw, read back against the values given (the
resumed run's steps placed at the end of the main run's, the Pareto staircase, savings in MiB). Project 73's
rank check: ``tests/projects/test_baseline_page.py``."""

from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
import torch

from bp_mech.book import project_plots

MIB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _lines(fig):
    return {ln.get_label(): ln for ln in fig.axes[0].get_lines()}


def test_gain_and_drift_per_update():
    evals = [dict(update=0, domain=4.0, holdout=2.0), dict(update=5, domain=3.0, holdout=2.2)]
    lines = _lines(project_plots.plot_gain_drift(evals, "t"))
    assert list(lines["domain (its held-out part): down = gain"].get_ydata()) == [0.0, -1.0]
    assert list(lines["holdout (general text): up = drift"].get_xdata()) == [0, 5]
    assert abs(lines["holdout (general text): up = drift"].get_ydata()[-1] - 0.2) < 1e-12
    bounded = _lines(project_plots.plot_gain_drift(evals, "t", bounds=dict(domain=-0.5, holdout=0.1)))
    assert list(bounded["the rule's gain bound"].get_ydata()) == [-0.5, -0.5]
    assert list(bounded["the rule's drift bound"].get_ydata()) == [0.1, 0.1] and "the rule's gain bound" not in lines


def test_the_resumed_steps_sit_on_the_last_steps_of_the_uninterrupted_run():
    main, resumed = [dict(loss=x) for x in (5.0, 4.0, 3.0, 2.0)], [dict(loss=x) for x in (3.0, 2.0)]
    lines = _lines(project_plots.plot_resume(main, resumed, at=2, title="t"))
    assert list(lines["resumed from the checkpoint"].get_xdata()) == [3, 4]
    assert list(lines["checkpoint (update 2)"].get_xdata()) == [2.5, 2.5]


def test_a_loss_curve_with_the_holdout_before_and_after():
    rec = SimpleNamespace(candidate="a", metrics=dict(curve=dict(loss=[3.0, None]), holdout_before=3.5,
                                                      holdout_after=2.5))
    lines = _lines(project_plots.plot_loss_curves([rec]))
    assert list(lines["a: training"].get_xdata()) == [1, 2]
    assert list(lines["a: holdout before / after"].get_ydata()) == [3.5, 2.5]


def test_savings_in_mib_with_none_drawn_as_zero():
    outcomes = [SimpleNamespace(remedy="ckpt", naive_saving=0, predicted_saving=2 * MIB, measured_saving=None)]
    assert [b.get_height() for b in project_plots.plot_savings(outcomes, "t").axes[0].patches] == [0.0, 2.0, 0.0]


def test_the_frontier_joins_the_pareto_set_and_rings_the_pick():
    points = {"plain": (4 * MIB, 0.010, 0.011), "ckpt": (2 * MIB, 0.013, 0.014), "slow": (3 * MIB, 0.020, 0.030)}
    fig = project_plots.plot_frontier(points, ["ckpt", "plain"], "t", max_peak=3.5 * MIB, pick="plain")
    lines = _lines(fig)
    assert lines["Pareto set"].get_xdata().tolist() == pytest.approx([10.0, 13.0])  # by time
    assert lines["Pareto set"].get_ydata().tolist() == [4.0, 2.0]
    assert list(lines["largest peak that fits the budget"].get_ydata()) == [3.5, 3.5]
    assert list(lines["pick"].get_ydata()) == [4.0]
    assert "1: slow" in fig.axes[0].texts[-1].get_text()  # the dominated one, numbered in the key


def test_the_epsilon_line_is_float64_s():
    assert project_plots.torch_eps() == torch.finfo(torch.float64).eps == 2.0 ** -52


def test_model_state_per_gpu_one_line_per_stage_and_the_traced_point_on_top():
    lines = _lines(project_plots.plot_state_per_gpu(2**30, {8: 2 * 2**30}, "t"))
    assert lines["DDP"].get_ydata().tolist()[0] == lines["ZeRO-3"].get_ydata().tolist()[0] == 16.0  # one GPU: all
    assert lines["ZeRO-3"].get_ydata().tolist()[3] == 2.0  # 16 Ψ / 8
    assert list(lines["FSDP2, traced (bp-mech plan)"].get_ydata()) == [2.0]
