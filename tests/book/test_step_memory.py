"""Memory over one step: the timeline is the tracker's own count, phase by phase."""

import torch

from bp_mech.bench.optimizer import StepOptions
from bp_mech.planner.lifecycle import Session, track
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.book.step_memory import PHASES, fake_steps, memory_over_step, phase_spans, plot_memory_over_step


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


def test_fake_steps_are_the_fresh_sessions_ledgers_on_one_model_with_the_device_s_options():
    """One shared session gives each strategy the ledger of its own fresh fake session (what page 43 used to
    trace per strategy), under CUDA's step options; only the asked-for timelines are kept."""
    w, cuda = parse_workload("tiny-b2s64"), StepOptions().for_device("cuda")
    steps = fake_steps("tiny-b2s64", ["plain", "offload", "fp16"], "cuda", timelines=["offload"])
    for name, st in steps.items():
        assert st.ledger == track(w, parse(name), fake=True, options=cuda)
    assert steps["offload"].timeline and max(b for _, b in steps["offload"].timeline) == steps["offload"].peak
    assert steps["plain"].timeline == () == steps["fp16"].timeline
