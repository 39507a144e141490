"""The memory figures: the ledger by stage and source (Part 02 · 43), peak against step time (19, 42),
and the bytes an offload moves (42). Each takes computed values or records and returns the figure."""

from __future__ import annotations

import matplotlib.pyplot as plt

from bp_mech.book.plots import MIB, figure


def plot_ledger_stages(ledgers: dict[str, dict[str, dict[str, int]]], stage_labels: dict[str, str],
                       class_labels: dict[str, str], title: str, unit: int = MIB, unit_name: str = "MiB"):
    """Memory by lifecycle stage, stacked by object class, one panel per strategy.

    ``ledgers`` = {strategy: {stage: {class: bytes}}}; stages and classes in the order of the labels.
    """
    names = list(ledgers)
    fig, axes = plt.subplots(1, len(names), figsize=(2.2 * len(names) + 2.2, 3.8), sharey=True,
                             layout="constrained")
    axes = [axes] if len(names) == 1 else list(axes)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, names):
        bottom = [0.0] * len(stage_labels)
        for k, cls in enumerate(class_labels):
            vals = [ledgers[name][st][cls] / unit for st in stage_labels]
            ax.bar(range(len(vals)), vals, 0.75, bottom=bottom, color=colors[k % len(colors)],
                   label=class_labels[cls])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(stage_labels)), list(stage_labels.values()), rotation=60, ha="right", fontsize=8)
        ax.set_title(name)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(f"memory ({unit_name})")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    fig.suptitle(title)
    return fig


def plot_ledger_sources(totals: dict[str, dict[str, int]], stage_labels: dict[str, str], title: str,
                        unit: int = MIB, unit_name: str = "MiB"):
    """The same ledger from several sources side by side: totals = {source: {stage: bytes}}."""
    fig, ax = figure(7.0, 3.6)
    width = 0.8 / len(totals)
    for k, (src, vals) in enumerate(totals.items()):
        ax.bar([i + k * width for i in range(len(stage_labels))], [vals[s] / unit for s in stage_labels], width,
               label=src)
    ax.set_xticks([i + width * (len(totals) - 1) / 2 for i in range(len(stage_labels))],
                  list(stage_labels.values()), rotation=20, ha="right")
    ax.set_ylabel(f"memory ({unit_name})")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def _byte_unit(values) -> tuple[float, str]:
    top = max((abs(v) for v in values if v is not None), default=0)
    return (MIB, "MiB") if top >= MIB else (1024, "KiB")


def plot_memory_time(points: dict[str, tuple[int, float, float]], baseline: str, title: str):
    """The memory–time frontier (Part 02 · 19, 42): one point per candidate at (median step, peak).

    ``points`` = {candidate: (peak bytes, median step s, P95 step s)}; the whisker reaches the P95.
    """
    fig, ax = figure(6.4, 3.8)
    scale, unit = _byte_unit([p for p, _, _ in points.values()])
    for k, (name, (peak, med, p95)) in enumerate(points.items()):
        x, y = med * 1e3, peak / scale
        ax.errorbar([x], [y], xerr=[[0], [max(p95 - med, 0) * 1e3]], fmt="s" if name == baseline else "o",
                    capsize=3, color="black" if name == baseline else None)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 5 if k % 2 else -11), fontsize=8)
    ax.set_xlabel("median step time (ms); whisker to P95")
    ax.set_ylabel(f"allocated peak ({unit})")
    ax.set_title(title)
    return fig


def plot_transfer_bytes(rows: dict[str, dict[str, int]], title: str):
    """Grouped bars per candidate (Part 02 · 42): e.g. counted saved activations, D2H, H2D bytes."""
    fig, ax = figure(6.8, 3.6)
    groups = list(rows)
    series = list(next(iter(rows.values())))
    scale, unit = _byte_unit([v for r in rows.values() for v in r.values()])
    width = 0.8 / len(series)
    for k, s in enumerate(series):
        ax.bar([i + k * width for i in range(len(groups))], [rows[g].get(s, 0) / scale for g in groups], width,
               label=s)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax.set_ylabel(f"bytes per step ({unit})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
