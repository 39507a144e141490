"""Part 02 · 55's figure: update-to-parameter ratios per parameter group against a reference band.

The band runs from a rule of thumb for a healthy run (lower edge) to the book's bound on one update
(upper edge, ``experiments.update_dynamics.MAX_UPDATE_RATIO``); the chapter states where each edge
comes from. ``updates_above`` counts, per candidate, the updates that left the band upwards.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

Ratios = dict[str, dict[str, list[float]]]  # {candidate: {group: [ratio per update]}}


def ratios_of(traces: dict[str, list[dict]]) -> Ratios:
    """``{candidate: {group: [ratio per update]}}`` from the traces' rows (None: not finite)."""
    return {c: {g: [r["groups"][g]["ratio"] for r in rows] for g in rows[0]["groups"]}
            for c, rows in traces.items() if rows}


def updates_above(ratios: Ratios, bound: float) -> dict[str, list[int]]:
    """Per candidate, the updates (0-based) in which some group's ratio exceeds ``bound``
    (a non-finite ratio counts as above)."""
    def above(r):
        return r is None or math.isnan(r) or r > bound

    return {c: [t for t in range(len(next(iter(per.values()))))
                if any(above(per[g][t]) for g in per)] for c, per in ratios.items()}


def plot_ratio_band(ratios: Ratios, band: tuple[float, float], labels: tuple[str, str], title: str):
    """One panel per group, one line per candidate (log scale), the band shaded between its edges.

    Args: ``ratios`` as ``ratios_of`` gives them; ``band`` (low, high); ``labels`` the edges' legend
    texts. Returns the figure.
    """
    groups = list(next(iter(ratios.values())))
    fig, axes = plt.subplots(1, len(groups), figsize=(2.6 * len(groups), 3.8), sharey=True,
                             constrained_layout=True)
    for ax, g in zip(axes, groups):
        ax.axhspan(*band, color="tab:green", alpha=0.12)
        ax.axhline(band[0], color="tab:green", ls=":", lw=1, label=labels[0])
        ax.axhline(band[1], color="tab:red", ls="--", lw=1, label=labels[1])
        for i, (name, per) in enumerate(ratios.items()):
            ys = [math.nan if y is None else y for y in per[g]]
            ax.plot(range(len(ys)), ys, marker="o^s"[i % 3], ms=3, ls=("-", "--", ":")[i % 3],
                    label=name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_title(g, fontsize=9)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel("update")
    axes[0].set_ylabel("||Δp|| / ||p||  (log scale)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=len(names), fontsize=7)
    fig.suptitle(title)
    return fig
