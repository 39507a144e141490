"""Drawing primitives for the chapters' opening pictures: a canvas without axes, rounded boxes, arrows, an
operation graph with its saved tensors highlighted; the colours every picture shares (forward, backward, saved).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

FWD, BWD, SAVED, OP = "#1f4e79", "#c0392b", "#f8c471", "#eaf2f8"  # forward, backward, saved, operation fill
D2H, H2D, RECOMPUTE = "#7d3c98", "#1e8449", "#7d3c98"  # the two copy directions; a re-run forward
BOX_H = 0.5  # an operation box's height (data units)


def canvas(width: float, height: float, xlim: tuple[float, float], ylim: tuple[float, float], rows: int = 1):
    fig, axes = plt.subplots(rows, 1, figsize=(width, height), layout="constrained", squeeze=False)
    for ax in axes[:, 0]:
        ax.set_xlim(*xlim)
        ax.set_ylim(*ylim)
        ax.set_axis_off()
    return fig, list(axes[:, 0])


def box(ax, x: float, y: float, w: float, text: str, fc: str = OP, ec: str = FWD, ls: str = "-",
         hatch: str | None = None, size: float = 9, h: float = BOX_H):
    """A rounded box of width ``w`` centred at (x, y) with its text."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                                fc=fc, ec=ec, ls=ls, hatch=hatch, lw=1.2, zorder=2))
    return ax.text(x, y, text, ha="center", va="center", fontsize=size, zorder=3)


def arrow(ax, a, b, color: str, ls: str = "-", rad: float = 0.0, lw: float = 1.4):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=11, color=color, ls=ls, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0, zorder=1))


def edge_point(node: tuple, toward: tuple) -> tuple[float, float]:
    """Where the segment from ``node``'s centre toward a point leaves its box (the centre for a point)."""
    x, y, _, w = node
    dx, dy = toward[0] - x, toward[1] - y
    if w == 0 or (dx == 0 and dy == 0):
        return x, y
    t = min(w / 2 / abs(dx) if dx else float("inf"), BOX_H / 2 / abs(dy) if dy else float("inf"))
    return x + t * dx, y + t * dy


def graph(title: str, nodes: dict[str, tuple], edges: list[tuple], xlim, ylim, size=(8.6, 3.4)):
    """Operations as boxes, tensors as arrows labelled with their names; the saved ones highlighted, each
    forward arrow doubled by a backward one in the second colour, below it."""
    fig, (ax,) = canvas(*size, xlim, ylim)
    for x, y, label, w in nodes.values():
        if w:
            box(ax, x, y, w, label)
    for src, dst, tensor, saved in edges:
        a, b = nodes[src], nodes[dst]
        p, q = edge_point(a, b[:2]), edge_point(b, a[:2])
        dx, dy = q[0] - p[0], q[1] - p[1]
        norm = (dx * dx + dy * dy) ** 0.5
        nx, ny = -dy / norm, dx / norm  # the left normal (above a rightward edge)
        arrow(ax, p, q, FWD)
        off = 0.1
        arrow(ax, (q[0] - off * nx, q[1] - off * ny), (p[0] - off * nx, p[1] - off * ny), BWD, ls="--", lw=1.1)
        if tensor:
            ax.text((p[0] + q[0]) / 2 + 0.24 * nx, (p[1] + q[1]) / 2 + 0.24 * ny, tensor, ha="center",
                    va="center", fontsize=10, zorder=4, fontweight="bold" if saved else "normal",
                    bbox=dict(boxstyle="round,pad=0.2", fc=SAVED if saved else "white",
                              ec="#b9770e" if saved else "none"))
    ax.set_title(title, fontsize=11)
    fig.legend(handles=[Line2D([], [], color=FWD, lw=1.4, label="forward: a tensor flows to the next operation"),
                        Line2D([], [], color=BWD, lw=1.1, ls="--", label="backward: its gradient flows back"),
                        Patch(fc=SAVED, ec="#b9770e", label="saved for the backward")],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig
