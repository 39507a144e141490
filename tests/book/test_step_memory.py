"""Memory over one step: the timeline is the tracker's own count, phase by phase."""

import torch

from bp_mech.planner.lifecycle import Session
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.book.step_memory import PHASES, memory_over_step, phase_spans, plot_memory_over_step


def test_timeline_peak_is_the_ledger_peak_and_phases_run_in_order():
    torch.manual_seed(0)
    session = Session(parse_workload("tiny-b2s64"), "cpu")
    for name in ("plain", "checkpoint-all"):
        step = session.step(parse(name))
        assert max(b for _, b in step.timeline) == step.ledger.peak
        assert [p for p, _, _ in phase_spans(step.timeline)] == list(PHASES)


def test_checkpointing_lowers_the_curve_and_the_figure_has_a_panel_per_strategy():
    timelines = memory_over_step(strategies=("plain", "checkpoint-all"))
    peak = {k: max(b for _, b in v) for k, v in timelines.items()}
    assert peak["checkpoint-all"] < peak["plain"]
    fig = plot_memory_over_step(timelines, "t")
    assert [ax.get_title() for ax in fig.axes] == ["plain", "checkpoint-all"]
