"""Shared matplotlib helpers for the chapters (one figure per call, axes with units).

Chapter-specific plots live here too, one function each, named ``plot_<what>``; they take
computed values or records and return the figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

MIB = 2**20


def figure(width: float = 6.4, height: float = 3.6):
    """A new figure and axes with the book's defaults."""
    fig, ax = plt.subplots(figsize=(width, height), constrained_layout=True)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_error_bars(rows: dict[str, dict[str, float]], title: str, ylabel: str = "relative error"):
    """Grouped log-scale bars: rows = {group: {series: value}} (e.g. op -> {float64: e, float32: e})."""
    fig, ax = figure(7.0, 3.6)
    groups = list(rows)
    series = list(next(iter(rows.values())))
    width = 0.8 / len(series)
    for k, s in enumerate(series):
        vals = [max(rows[g][s], 1e-18) for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], vals, width, label=s)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return fig
