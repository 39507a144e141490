"""bp_mech.book.clock_plots: the WSD phases, the training run behind chapter 12's figure
(its rates against ``scheduler.wsd_lr``, an independent formula) and what the figure draws."""

import math

import matplotlib.pyplot as plt
import pytest

from bp_mech.book import clock_plots
from bp_mech.scheduler import WSDConfig, wsd_lr


@pytest.mark.parametrize("w, s, d", [(6, 10, 8), (0, 3, 4), (2, 0, 3), (1, 2, 0)])
def test_phases_tile_the_schedule_and_match_its_boundaries(w, s, d):
    cfg = WSDConfig(warmup=w, stable=s, decay=d)
    phases = clock_plots.wsd_phases(cfg)
    assert all(end > start for _, start, end in phases)  # no empty phase
    assert [p[1] for p in phases[1:]] == [p[2] for p in phases[:-1]]  # contiguous
    assert phases[0][1] == 0 and phases[-1][2] == cfg.total
    ends = dict((name, end) for name, _, end in phases)
    if w:
        assert ends["warmup"] == cfg.boundaries["warmup_end"]
    if d:
        assert ends["decay"] == cfg.boundaries["end"]


def test_training_run_follows_the_schedule_exactly():
    cfg = WSDConfig(base_lr=2e-3, warmup=2, stable=3, decay=2, decay_type="cosine", min_lr_ratio=0.1)
    rows = clock_plots.train_through_wsd("tiny-b1s8", cfg, seed=0)
    assert [r["update"] for r in rows] == list(range(1, cfg.total + 1))
    assert all(r["applied"] for r in rows) and {r["scale"] for r in rows} == {None}  # float32: no scaler skips
    assert [r["lr"] for r in rows] == [wsd_lr(k, cfg) for k in range(cfg.total)]
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_training_run_refuses_a_linear_decay():
    with pytest.raises(ValueError, match="cosine"):
        clock_plots.train_through_wsd("tiny-b1s8", WSDConfig(decay_type="linear"))


def test_figure_draws_applied_updates_and_shades_each_phase():
    cfg = WSDConfig(base_lr=1.0, warmup=2, stable=1, decay=2, decay_type="cosine", min_lr_ratio=0.1)
    rows = [dict(update=k + 1, lr=wsd_lr(k, cfg), loss=5.0 - k, applied=True) for k in range(cfg.total)]
    rows.insert(2, dict(update=2, lr=wsd_lr(2, cfg), loss=99.0, applied=False))  # a skipped step
    evals = [dict(update=0, domain=6.0, holdout=6.5), dict(update=5, domain=4.0, holdout=6.1)]
    fig = clock_plots.plot_wsd_run(rows, cfg, "t", evals=evals)
    ax_lr, ax_loss = fig.axes
    (lr_line,) = ax_lr.get_lines()
    assert list(lr_line.get_xdata()) == list(range(cfg.total))
    assert list(lr_line.get_ydata()) == [wsd_lr(k, cfg) for k in range(cfg.total)]
    loss_line = ax_loss.get_lines()[0]
    assert 99.0 not in list(loss_line.get_ydata())  # the skipped step is not drawn
    assert list(ax_loss.get_lines()[1].get_ydata()) == [6.0, 4.0]  # domain evaluations
    assert len(ax_lr.patches) == len(clock_plots.wsd_phases(cfg)) == 3
    assert [t.get_text() for t in ax_lr.texts] == ["warmup", "stable", "decay"]
    plt.close(fig)
