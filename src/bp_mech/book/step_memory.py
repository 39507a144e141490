"""Memory over one training step (Part 02 · 19, 42, 43): the storage tracker's live device bytes after
every operator of one steady-state step, per strategy, and the figure that shows them phase by phase."""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from bp_mech.bench.optimizer import StepOptions
from bp_mech.planner.definitions import StepLedger
from bp_mech.planner.lifecycle import Session
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.book.plots import MIB

PHASES = ("forward", "backward", "optimizer", "zero_grad")  # in the order a step runs them
_SHADE = dict(forward="#dbe9f6", backward="#fbe3d6", optimizer="#e2f0d9", zero_grad="#eeeeee")


def memory_over_step(workload: str = "tiny-b2s64", strategies=("plain", "checkpoint-all", "offload"),
                     fake: bool = False) -> dict[str, tuple[tuple[str, int], ...]]:
    """{strategy: ((phase, live bytes), ...)}: one tracked steady-state step of each strategy on one
    model (real CPU tensors, or fake ones for a full-size workload), from the same weights."""
    session = Session(parse_workload(workload), "cpu", fake)
    return {name: session.step(parse(name)).timeline for name in strategies}


def fake_steps(workload: str, strategies: list[str], device: str = "cuda",
               timelines: list[str] = ()) -> dict[str, StepLedger]:
    """{strategy: its steady-state ``StepLedger``}: one fake-tensor step of each strategy on one model and one
    AdamW (``Session``), with ``device``'s step options (``StepOptions().for_device``: on "cuda" fused AdamW,
    CUDA's offload threshold and autocast lists); the operator timeline kept for ``timelines`` only."""
    session = Session(parse_workload(workload), "cpu", fake=True, options=StepOptions().for_device(device))
    steps = {name: session.step(parse(name)) for name in strategies}
    return {name: st if name in timelines else dataclasses.replace(st, timeline=()) for name, st in steps.items()}


def phase_spans(timeline) -> list[tuple[str, int, int]]:
    """(phase, first operator, last operator + 1) of each run of one phase in ``timeline``.

    >>> phase_spans([("forward", 1), ("forward", 2), ("backward", 3), ("optimizer", 2)])
    [('forward', 0, 2), ('backward', 2, 3), ('optimizer', 3, 4)]
    """
    spans: list[tuple[str, int, int]] = []
    for i, (phase, _) in enumerate(timeline):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], i + 1)
        else:
            spans.append((phase, i, i + 1))
    return spans


def _visible(spans: list, least: float) -> list:
    """The phases' spans with each at least ``least`` operators wide, laid out from the step's end backwards: a phase
    of a few operators (the optimizer's, zero_grad's) is shaded over the end of the one before it, not hidden."""
    out, cursor = [], spans[-1][2] if spans else 0
    for phase, a, b in reversed(spans):
        b = min(b, cursor)
        a = min(a, b - least)
        out.append((phase, max(a, 0), b))
        cursor = a
    return out[::-1]


def plot_memory_over_step(timelines: dict, title: str, baseline: str = "plain", unit: int = MIB,
                          unit_name: str = "MiB"):
    """One panel per strategy: live device bytes after each operator, its phases shaded, the
    baseline's peak as a dashed line in every panel and each panel's own peak marked."""
    names = list(timelines)
    fig, axes = plt.subplots(1, len(names), figsize=(3.0 * len(names) + 0.6, 3.4), sharey=True,
                             layout="constrained", squeeze=False)
    base_peak = max(b for _, b in timelines[baseline]) / unit if baseline in timelines else None
    top_all = max(b for tl in timelines.values() for _, b in tl) / unit
    for ax, name in zip(axes[0], names):
        tl = timelines[name]
        ys = [b / unit for _, b in tl]
        for phase, a, b in _visible(phase_spans(tl), least=0.025 * len(ys)):
            ax.axvspan(a, b, color=_SHADE.get(phase, "#ffffff"), lw=0)
        ax.plot(range(len(ys)), ys, color="black", lw=1.0)
        top = max(range(len(ys)), key=ys.__getitem__)
        ax.plot([top], [ys[top]], "v", color="crimson")
        side = "right" if top > 0.75 * len(ys) else "left" if top < 0.25 * len(ys) else "center"
        ax.annotate(f"peak {ys[top]:.1f}", (top, ys[top]), textcoords="offset points", xytext=(0, 6),
                    ha=side, fontsize=8, color="crimson")  # inside the panel, whichever end the peak is at
        if base_peak is not None and name != baseline:
            ax.axhline(base_peak, ls="--", lw=0.8, color="grey")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("operator of the step")
        ax.set_ylim(0, 1.18 * top_all)  # room for the label above the highest peak, below the panel's title
        ax.set_xlim(0, len(ys))
    axes[0][0].set_ylabel(f"live device memory ({unit_name})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_SHADE[p]) for p in PHASES]
    fig.legend(handles, [p.replace("_", " ") for p in PHASES], loc="outside lower center", ncols=4,
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    return fig
