"""The pictures a chapter opens with: what the mechanism is about, drawn before any code (issue 29).

Structural drawings, no measured numbers: the forward graph of a block with the tensors saved for
backward (Part 02 · 09, 10), a layer stack plain and checkpointed (19), the saved tensors' trip to the
host and back (42), data-parallel ranks and their all-reduce (project 73). Each function returns the
figure; the page glues it under its title.
"""

from __future__ import annotations

from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Patch

from bp_mech.book.drawing import (BOX_H, BWD, D2H, FWD, H2D, OP, RECOMPUTE, SAVED, arrow, box, canvas,
                                    graph)


def mlp_graph():
    """The forward graph of the SwiGLU MLP (Part 02 · 09), the tensors saved for its backward highlighted.

    Operations are boxes (gate, up and down projections, SiLU, the product), tensors the arrows between
    them, named as on the page: $x$, $g$, $u$, $a$, $h$, $y$. Every arrow has a backward twin.

    Returns:
        The matplotlib figure.

    Example:
        >>> fig = mlp_graph()
        >>> sorted(t.get_text() for t in fig.axes[0].texts if t.get_fontweight() == "bold")
        ['$a$', '$g$', '$h$', '$u$', '$x$']
    """
    nodes = {"in": (-0.9, 0, "", 0), "fork": (0.9, 0, "", 0),
             "gate": (2.6, 0.9, r"gate Linear $W_g$", 1.9), "up": (2.6, -0.9, r"up Linear $W_u$", 1.9),
             "silu": (5.0, 0.9, "SiLU", 1.0), "mul": (6.6, 0, r"$\odot$", 0.6),
             "down": (8.6, 0, r"down Linear $W_d$", 2.0), "out": (10.8, 0, "", 0)}
    edges = [("in", "fork", "$x$", True), ("fork", "gate", None, False), ("fork", "up", None, False),
             ("gate", "silu", "$g$", True), ("silu", "mul", "$a$", True), ("up", "mul", "$u$", True),
             ("mul", "down", "$h$", True), ("down", "out", "$y$", False)]
    return graph(r"The SwiGLU MLP's forward: what its backward reads", nodes, edges, (-1.1, 11.0), (-1.6, 1.6))


def attention_graph():
    """The forward graph of one attention head (Part 02 · 10), the tensors an eager backward saves highlighted.

    Projections, RoPE, the scaled masked scores, the softmax and $Pv$ are boxes; $P$, the $T\\times T$
    probabilities, is the one saved tensor that grows with the square of the sequence length.

    Returns:
        The matplotlib figure.

    Example:
        >>> fig = attention_graph()
        >>> [t.get_text() for t in fig.axes[0].texts if "P" in t.get_text() and t.get_fontweight() == "bold"]
        ['$P$ ($T\\\\times T$)']
    """
    nodes = {"in": (-0.8, 0, "", 0), "fork": (0.6, 0, "", 0),
             "q": (2.0, 1.3, r"Linear $W_q$", 1.5), "k": (2.0, 0, r"Linear $W_k$", 1.5),
             "v": (2.0, -1.3, r"Linear $W_v$", 1.5), "rq": (4.3, 1.3, "RoPE", 1.0), "rk": (4.3, 0, "RoPE", 1.0),
             "s": (6.6, 0.65, r"$c\,\tilde q\tilde k^\top + M$", 1.6), "sm": (9.0, 0.65, "softmax", 1.3),
             "pv": (11.7, -0.5, r"$P\,v$", 0.8), "o": (13.6, -0.5, r"Linear $W_o$", 1.5), "out": (15.4, -0.5, "", 0)}
    edges = [("in", "fork", "$x$", True), ("fork", "q", None, False), ("fork", "k", None, False),
             ("fork", "v", None, False), ("q", "rq", "$q$", False), ("k", "rk", "$k$", False),
             ("rq", "s", r"$\tilde q$", True), ("rk", "s", r"$\tilde k$", True), ("s", "sm", "$S$", False),
             ("sm", "pv", r"$P$ ($T\times T$)", True), ("v", "pv", "$v$", True), ("pv", "o", "$O$", True),
             ("o", "out", "$y$", False)]
    return graph("One attention head's forward: what an eager backward reads", nodes, edges, (-1.0, 15.6),
                  (-1.9, 2.0), size=(9.8, 3.8))


def checkpoint_stack(layers: int = 4):
    """A stack of layers, plain against checkpointed (Part 02 · 19): what each keeps for the backward.

    Plain keeps every layer's inner activations until its backward; checkpointed keeps only each layer's
    input $h_\\ell$ and re-runs the layer's forward from it when the backward reaches it.

    Args:
        layers: how many layers to draw.

    Returns:
        The matplotlib figure, one panel per variant (plain above).

    Example:
        >>> fig = checkpoint_stack(3)
        >>> [ax.get_title() for ax in fig.axes][1].startswith("checkpointed")
        True
    """
    step = 2.6
    fig, axes = canvas(8.8, 4.6, (-0.7, step * layers + 1.0), (-1.75, 0.75), rows=2)
    for ax, ckpt in zip(axes, (False, True)):
        for i in range(layers + 1):  # the layer inputs (and the last output)
            ax.text(i * step, 0, f"$h_{i}$", ha="center", va="center", fontsize=10, fontweight="bold",
                    bbox=dict(boxstyle="round,pad=0.2", fc=SAVED, ec="#b9770e"))
        for i in range(layers):
            x = i * step + step / 2
            box(ax, x, 0, 1.5, f"layer {i + 1}")
            arrow(ax, (i * step + 0.3, 0), (x - 0.75, 0), FWD)
            arrow(ax, (x + 0.75, 0), ((i + 1) * step - 0.3, 0), FWD)
            if ckpt:
                box(ax, x, -0.85, 1.5, "recomputed", fc="white", ec="grey", ls="--", size=8)
                arrow(ax, (i * step + 0.05, -0.25), (x - 0.78, -0.85), RECOMPUTE, ls=":", rad=0.3, lw=1.2)
            else:
                box(ax, x, -0.85, 1.5, "activations", fc=SAVED, ec="#b9770e", size=8)
                ax.plot([x, x], [-0.25, -0.6], color="#b9770e", lw=1, ls=":")
        arrow(ax, (layers * step + 0.6, -1.45), (0.3, -1.45), BWD, ls="--", lw=1.1)
        ax.text(layers * step / 2 + 0.4, -1.45, "backward, last layer first", fontsize=8, color=BWD,
                ha="center", va="center", bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"))
        ax.set_title("checkpointed: each layer keeps only its input $h$; backward re-runs its forward" if ckpt
                     else "plain: every layer keeps its inner activations until its backward", fontsize=10)
    fig.legend(handles=[Patch(fc=SAVED, ec="#b9770e", label="kept from forward to backward"),
                        Patch(fc="white", ec="grey", ls="--", label="dropped in forward, rebuilt in backward"),
                        Line2D([], [], color=RECOMPUTE, ls=":", label="the layer's forward, run again")],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig


def offload_timeline(layers: int = 4):
    """The saved tensors' trip on a timeline of layers (Part 02 · 42): to the host in forward, back in backward.

    The device runs forward layer by layer, the loss, then backward in reverse; each layer's saved tensors
    $a_\\ell$ are copied to host memory as forward produces them (device to host) and back just before
    backward needs them (host to device), so they wait on the host, the first in the longest.

    Args:
        layers: how many layers to draw.

    Returns:
        The matplotlib figure.

    Example:
        >>> fig = offload_timeline(3)
        >>> sorted(t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("$a"))
        ['$a_1$ on the host', '$a_2$ on the host', '$a_3$ on the host']
    """
    n = 2 * layers + 1  # forward, the loss, backward
    fig, (ax,) = canvas(8.8, 3.6, (-1.9, n + 0.1), (-0.55 - 0.5 * layers, 1.9))
    slots = [f"fwd {i + 1}" for i in range(layers)] + ["loss"] + [f"bwd {layers - i}" for i in range(layers)]
    for k, name in enumerate(slots):
        back = k > layers
        box(ax, k + 0.5, 1.2, 0.8, name, fc="#fdedec" if back else OP, ec=BWD if back else FWD, size=8)
    arrow(ax, (0.1, 1.75), (n - 0.1, 1.75), "black", lw=1)
    ax.text(-1.8, 1.75, "time", fontsize=8, va="center")
    ax.text(-1.8, 1.2, "device", fontsize=9, va="center", fontweight="bold")
    ax.text(-1.8, -0.25 - 0.25 * layers, "host\nmemory", fontsize=9, va="center", fontweight="bold")
    ax.axhline(0.55, color="grey", lw=0.8, ls=":")
    for i in range(layers):  # layer i + 1
        start, end = i + 0.9, n - 1 - i + 0.1  # after its forward, before its backward
        y = -0.2 - 0.5 * (layers - 1 - i)
        ax.add_patch(FancyBboxPatch((start, y - 0.15), end - start, 0.3, boxstyle="round,pad=0,rounding_size=0.05",
                                    fc=SAVED, ec="#b9770e", zorder=2))
        ax.text((start + end) / 2, y, f"$a_{i + 1}$ on the host", ha="center", va="center", fontsize=8, zorder=3)
        arrow(ax, (start - 0.02, 0.93), (start, y + 0.15), D2H)
        arrow(ax, (end, y + 0.15), (end + 0.02, 0.93), H2D)
    ax.set_title("Offload: each layer's saved tensors wait on the host between its forward and its backward",
                 fontsize=10)
    fig.legend(handles=[Line2D([], [], color=D2H, label="copy device → host (forward, pack)"),
                        Line2D([], [], color=H2D, label="copy host → device (backward, unpack)"),
                        Patch(fc=SAVED, ec="#b9770e", label="saved tensors held in host memory")],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig


def data_parallel():
    """Data-parallel ranks (project 73): a model copy each, its own rows, local gradients, one all-reduce,
    the same update everywhere.

    Three columns stand for the $P$ ranks (rank $0$, rank $1$, rank $P-1$); the all-reduce spans them.

    Returns:
        The matplotlib figure.

    Example:
        >>> fig = data_parallel()
        >>> any("all-reduce" in t.get_text() for t in fig.axes[0].texts)
        True
    """
    fig, (ax,) = canvas(8.4, 4.8, (-0.3, 9.3), (-0.3, 6.6))
    cols = {"rank $0$": 1.4, "rank $1$": 4.5, "rank $P-1$": 7.6}
    box(ax, 4.5, 6.2, 6.4, "one update's rows: $k$ micro-batches of $G$ rows", fc="white")
    ax.text(6.05, 3.95, r"$\cdots$", ha="center", va="center", fontsize=14)
    rows = [(5.05, "its $G/P$ rows of each\nmicro-batch", "white", 0.6), (3.95, "model copy $\\theta$", OP, BOX_H),
            (2.85, "local gradient $g_r$", "#fdedec", BOX_H)]
    for name, x in cols.items():
        ax.text(x - 1.25, 5.65, name, fontsize=9, fontweight="bold", va="center")
        arrow(ax, (x, 5.95), (x, 5.35), FWD)
        for (y, text, fc, h), (y2, *_, h2) in zip(rows, rows[1:] + [(1.75, "", "", 0.6)]):
            box(ax, x, y, 2.4, text, fc=fc, h=h, size=8)
            arrow(ax, (x, y - h / 2), (x, y2 + h2 / 2), BWD if y2 <= 2.85 else FWD)
        box(ax, x, 0.2, 2.4, r"update $\theta \leftarrow$ AdamW$(\theta, \bar g)$", fc=OP, size=8)
        arrow(ax, (x, 1.45), (x, 0.45), FWD)
    ax.add_patch(FancyBboxPatch((0.1, 1.45), 8.8, 0.6, boxstyle="round,pad=0,rounding_size=0.1", fc=SAVED,
                                ec="#b9770e", zorder=2))
    ax.text(4.5, 1.75, r"all-reduce (mean): every rank receives $\bar g = (g_0 + g_1 + \cdots + g_{P-1})\,/\,P$", ha="center",
            va="center", fontsize=9, zorder=3)
    ax.set_title("Data parallelism: P copies, P shares of the rows, one averaged gradient, one update",
                 fontsize=10)
    fig.legend(handles=[Line2D([], [], color=FWD, label="forward and update"),
                        Line2D([], [], color=BWD, label="backward and gradient exchange"),
                        Patch(fc=SAVED, ec="#b9770e", label="the one collective of the update")],
               loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig
