"""The opening pictures of the chapters about one training step's memory (issue 29): the state ledger (Part 02 · 43),
profiling and diagnosis (project 74), the choice of a memory strategy (project 76).

Each function returns a figure drawn before any code of its page runs. What a picture shows as a number or a height
comes from the package when it is drawn: the bytes per parameter from ``state_bytes``, the bars of one step from
``ledger.theoretical``, the saving at the peak from ``diagnosis.predicted_saving``, the Pareto set and the pick from
``pareto``. Every patch that stands for a ledger line carries a ``gid`` naming it, so tests can read what is drawn.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from bp_mech import ledger
from bp_mech.book.drawing import FWD, OP, SAVED, arrow, box, canvas
from bp_mech.instruments.workload import ARCHITECTURES, parse_workload
from bp_mech.ledger_table import CLASS_LABELS, CLASSES, STAGE_LABELS
from bp_mech.projects import diagnosis, pareto
from bp_mech.state_bytes import adam_state_bytes, grad_bytes, param_bytes

STACK = ("parameters", "optimizer_states", "gradients", "saved_activations", "logits_loss", "other")  # bottom up
# the instants of one steady-state step: it starts where the previous one's zero_grad left it
INSTANTS = (("zero_grad", "step starts\n(last zero_grad)"), ("forward", "after\nforward"),
            ("backward_peak", "peak in\nbackward"), ("backward", "after\nbackward"),
            ("optimizer_peak", "in the\noptimizer step"), ("zero_grad", "after\nzero_grad"))
PHASES = (("forward\nsaves activations", 0, 1), ("backward\nfrees them as gradients appear", 1, 3),
          ("optimizer\nupdates W, m, v", 3, 4), ("zero_grad\nfrees gradients", 4, 5))  # (label, from, to instant)


def class_colour(cls: str, light: float = 0.45) -> tuple:
    """A ledger class's colour, the one the chapters' ledger plots give it (the colour cycle in ``CLASSES`` order),
    mixed with white by ``light``."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rgb = to_rgb(cycle[CLASSES.index(cls) % len(cycle)])
    return tuple(c + (1 - c) * light for c in rgb)


def bytes_per_parameter(arch: str = "tiny") -> dict[str, int]:
    """What a float32 training step with AdamW holds for each parameter, from the package's byte counts.

    Args:
        arch: any ``ARCHITECTURES`` name (the ratio is the same for all).

    Returns:
        {"weight", "gradient", "moment m", "moment v": bytes}.

    Example:
        >>> bytes_per_parameter()
        {'weight': 4, 'gradient': 4, 'moment m': 4, 'moment v': 4}
    """
    a = ARCHITECTURES[arch]
    n = param_bytes(a, 1)
    moment = adam_state_bytes(a) // 2 // n
    return {"weight": param_bytes(a) // n, "gradient": grad_bytes(a) // n, "moment m": moment, "moment v": moment}


def ledger_step(workload: str = "qwen05-b2s512"):
    """One steady-state step's memory (Part 02 · 43): the state each parameter costs, and the ledger's lines at
    every instant of the step, stacked, from the chapter's formula (``ledger.theoretical``, a GPU run's fused AdamW).

    Args:
        workload: the workload whose formula ledger sets the bars' heights.

    Returns:
        The matplotlib figure; each bar segment's ``gid`` is ``"<instant index>/<class>"``.

    Example:
        >>> fig = ledger_step()
        >>> sorted({p.get_gid().split("/")[1] for p in fig.axes[0].patches if p.get_gid() and "/" in p.get_gid()
        ...         and p.get_gid()[0] == "2"})
        ['logits_loss', 'optimizer_states', 'other', 'parameters', 'saved_activations']
    """
    w = parse_workload(workload)
    led = ledger.theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, None, "cuda")
    per = bytes_per_parameter(w.arch)
    fig, (ax,) = canvas(9.6, 5.2, (-0.3, 15.0), (-1.35, 7.0))
    totals = [sum(led.stages[s].values()) for s, _ in INSTANTS]
    scale = 5.4 / max(totals)
    unit = totals[3] * scale / sum(per.values())  # the parameter's column: the bar after the backward, per parameter
    y, cls = 0.0, ("parameters", "optimizer_states", "optimizer_states", "gradients")
    for name, c in zip(("weight", "moment m", "moment v", "gradient"), cls):
        b = per[name]
        ax.add_patch(Rectangle((0.5, y), 1.8, b * unit, fc=class_colour(c, 0.2), ec="white", gid=f"param/{name}"))
        ax.text(1.4, y + b * unit / 2, f"{name}\n{b} B", ha="center", va="center", fontsize=9.5)
        y += b * unit
    ax.text(1.4, y + 0.45, "one parameter", ha="center", va="center", fontsize=10.5, fontweight="bold")
    ax.text(1.4, -0.45, f"= {sum(per.values())} bytes", ha="center", va="center", fontsize=11.5, fontweight="bold")
    ax.text(1.4, -1.05, "× every parameter", ha="center", va="center", fontsize=9.5)
    xs = [4.0 + 2.05 * i for i in range(len(INSTANTS))]
    for i, ((stage, label), x) in enumerate(zip(INSTANTS, xs)):
        bottom = 0.0
        for c in STACK:
            h = led.stages[stage][c] * scale
            if h > 0:
                ax.add_patch(Rectangle((x - 0.5, bottom), 1.0, h, fc=class_colour(c, 0.2), ec="white", lw=0.6,
                                       gid=f"{i}/{c}"))
                bottom += h
        ax.text(x, -0.55, label, ha="center", va="center", fontsize=9.5)
        if stage == led.peak_stage:
            ax.plot([x], [bottom + 0.18], "v", color="crimson", ms=7)
            ax.text(x + 0.62, bottom + 0.05, "the peak:\none moment", fontsize=9.5, color="crimson", va="top")
    floor = sum(led.stages["zero_grad"][c] for c in ("parameters", "optimizer_states")) * scale
    ax.plot([xs[0] - 0.6, xs[-1] + 0.6], [floor, floor], color="black", lw=0.9, ls=":")
    for label, a, b in PHASES:
        box(ax, (xs[a] + xs[b]) / 2, 6.45, xs[b] - xs[a] - 0.12, label, fc=OP, size=9.5, h=0.85)
    ax.set_title(f"One step's memory, {workload}, from the chapter's formula: what stays, what comes and goes",
                 fontsize=11.5)
    shown = [c for c in STACK if max(led.stages[s][c] for s in led.stages) > 0.01 * max(totals)]
    fig.legend(handles=[Patch(fc=class_colour(c, 0.2), label=CLASS_LABELS[c]) for c in shown]
               + [Line2D([], [], color="black", ls=":", lw=0.9, label="weights and moments: always there")],
               loc="outside lower center", ncol=(len(shown) + 2) // 2, fontsize=9.5, frameon=False)
    return fig


# a toy ledger (bytes) whose peak moves when the logits go: Part 02 · 74's own example, in tenths
TOY = {"forward": dict(parameters=1, optimizer_states=2, saved_activations=5, logits_loss=1),
       "backward_peak": dict(parameters=1, optimizer_states=2, saved_activations=4, logits_loss=3)}


def diagnosis_questions(toy: dict | None = None):
    """Project 74's diagnosis in one picture: a profiled step, its three questions, and how each is answered.

    Which line dominates the peak (the ledger's classes beside the profiler's categories), where the time goes
    (operators by self time) and what a remedy would save (the peak taken again after the change: it may move).

    Args:
        toy: {stage: {class: bytes}} for the third panel, two stages (None: ``TOY``); its logits are removed.

    Returns:
        The matplotlib figure; the brackets' ``gid`` are ``"naive"`` and ``"predicted"``.

    Example:
        >>> fig = diagnosis_questions()
        >>> [t.get_text() for t in fig.axes[0].texts if t.get_text().endswith("?")][:1]
        ['What dominates the peak?']
    """
    toy = TOY if toy is None else toy
    fig, (ax,) = canvas(9.6, 6.0, (0, 15), (0.6, 9.25))
    ax.text(0.15, 8.55, "torch.profiler\nrecords one step:", fontsize=10, va="center", fontweight="bold")
    for label, a, b in (("forward", 3.3, 6.4), ("backward", 6.4, 10.7), ("optimizer", 10.7, 12.6),
                        ("zero_grad", 12.6, 14.5)):
        box(ax, (a + b) / 2, 8.55, b - a - 0.06, label, fc=OP, size=10)
    ax.text(8.9, 7.85, "every allocation and free · each operator's time and shapes · one range per phase",
            ha="center", va="center", fontsize=9.5, color="dimgrey")
    cols = (2.5, 7.5, 12.5)
    for x, q in zip(cols, ("What dominates the peak?", "Where does the time go?", "What would each remedy save?")):
        arrow(ax, (x, 7.55), (x, 7.05), FWD)
        box(ax, x, 6.75, 4.5, q, fc=SAVED, ec="#b9770e", size=10.5, h=0.55)
    # the peak: the same bytes under the ledger's classes and the profiler's categories
    views = (("ledger's\nclasses", 1.4, ("parameters", "optimizer states", "saved activations", "logits & loss")),
             ("profiler's\ncategories", 3.6, ("parameter", "optimizer state", "activation",
                                              "activation + autograd detail")))
    for title, x, names in views:
        bottom = 2.6
        for cls, name, h in zip(("parameters", "optimizer_states", "saved_activations", "logits_loss"), names,
                                (0.6, 1.0, 0.9, 0.8)):
            ax.add_patch(Rectangle((x - 0.95, bottom), 1.9, h, fc=class_colour(cls), ec="white", gid=f"view/{cls}"))
            ax.text(x, bottom + h / 2, name.replace(" + ", "\n+ "), ha="center", va="center", fontsize=8.5)
            bottom += h
        ax.text(x, 2.2, title, ha="center", va="center", fontsize=9.5)
    ax.text(2.5, 1.35, "two instruments, one total;\nwhere they differ: known lines", ha="center", va="center",
            fontsize=9.5)
    # the time: a hot-spot list
    for k, length in enumerate((3.6, 2.5, 1.8, 1.2, 0.8, 0.5, 0.3)):
        ax.add_patch(Rectangle((5.6, 5.75 - 0.45 * k), length, 0.32, fc=FWD, alpha=0.75, gid=f"hotspot/{k}"))
    ax.text(5.6, 2.35, "operators, by self time", fontsize=9.5, va="center")
    ax.text(7.5, 1.35, "a hot-spot list,\nnot a critical path", ha="center", va="center", fontsize=9.5)
    # the remedy: remove the logits at the backward's peak and take the peak again
    order = ("parameters", "optimizer_states", "saved_activations", "logits_loss")
    first, second = list(toy)
    scale = 3.3 / max(sum(r.values()) for r in toy.values())
    for stage, x in ((first, 10.3), (second, 11.9)):
        bottom = 2.6
        for c in order:
            h = toy[stage].get(c, 0) * scale
            removed = stage == second and c == "logits_loss"
            ax.add_patch(Rectangle((x - 0.55, bottom), 1.1, h, fc="white" if removed else class_colour(c), lw=1,
                                   ec="crimson" if removed else "white", ls="--" if removed else "-",
                                   hatch="//" if removed else None, gid=f"toy/{stage}/{c}"))
            bottom += h
        ax.text(x, 2.2, STAGE_LABELS[stage].replace("after ", "after\n").replace(" in ", "\nin "), ha="center",
                va="center", fontsize=9.5)
    change = {second: {"logits_loss": -toy[second]["logits_loss"]}}
    before = max(sum(r.values()) for r in toy.values())
    after = before - diagnosis.predicted_saving(toy, change)
    ax.plot([9.7, 13.65], [2.6 + after * scale] * 2, color="crimson", lw=1, ls=":")
    top, naive_lo = 2.6 + before * scale, 2.6 + (before - toy[second]["logits_loss"]) * scale
    for gid, x, lo in (("naive", 12.6, naive_lo), ("predicted", 13.55, 2.6 + after * scale)):
        ax.add_patch(Rectangle((x, lo), 0.08, top - lo, fc="crimson" if gid == "predicted" else "grey", gid=gid))
        ax.text(x + 0.15, (lo + top) / 2, gid, va="center", fontsize=9,
                color="crimson" if gid == "predicted" else "dimgrey")
    ax.text(12.3, 1.35, "the peak may move: predict from\nthe ledger, apply, measure, compare", ha="center",
            va="center", fontsize=9.5)
    ax.set_title("Profiling a training step: three questions, each answered with a number", fontsize=11.5)
    fig.legend(handles=[Patch(fc="white", ec="crimson", ls="--", hatch="//", label="a remedy removes a line"),
                        Line2D([], [], color="crimson", ls=":", label="the peak after it, over every stage")],
               loc="outside lower center", ncol=2, fontsize=9.5, frameon=False)
    return fig


# (strategy, what it does | its cost, the lines it acts on); sharding last, on the state the others leave alone
LEVERS = (("chunked loss", "one chunk's logits at a time\ncost: one more lm_head matmul", ("logits_loss",)),
          ("accumulation, k micro-batches", "A and Z to about 1/k\ncost: k smaller passes",
           ("logits_loss", "saved_activations")),
          ("checkpointing", "keeps each layer's input only\ncost: one more forward per layer", ("saved_activations",)),
          ("offload", "saved activations to host memory\ncost: copies over the host link", ("saved_activations",)),
          ("fp16 autocast", "saved matmul inputs in 16 bits\ncost: rounding, a loss scale", ("saved_activations",)),
          ("sharding (FSDP2, ZeRO)", "W, G, m, v split over the ranks\ncost: gathers, reduce-scatters", ("state",)))
LINES = (("logits_loss", "logits and their gradient  Z"), ("saved_activations", "saved activations  A"),
         ("optimizer_states", "AdamW's moments m, v  2W"), ("gradients", "gradients  G"),
         ("parameters", "weights  W"))  # top down
# schematic candidates (peak, step time), plain first: where the rule's picture puts them
RULE_POINTS = {"plain": (0.95, 1.0), "a": (0.82, 1.05), "b": (0.64, 1.3), "c": (0.5, 2.1), "d": (0.4, 2.9),
               "e": (0.76, 1.7), "f": (0.88, 1.5), "g": (0.55, 2.6)}


def memory_levers(budget: float = 0.7):
    """Project 76 in one picture: each memory strategy is a lever on one line of the step's ledger, with its cost;
    the state lines are a floor only sharding moves; and the rule that picks the fastest candidate that fits.

    Args:
        budget: the rule panel's budget, as a peak on the schematic candidates' scale (``RULE_POINTS``).

    Returns:
        The matplotlib figure; each lever's arrow has ``gid`` ``"lever/<strategy>/<line>"``, the rule's points
        ``"point/<name>"`` and the ring ``"pick/<name>"``.

    Example:
        >>> fig = memory_levers()
        >>> sorted({g.split("/")[2] for p in fig.axes[0].patches if (g := p.get_gid() or "").startswith("lever")})
        ['logits_loss', 'saved_activations', 'state']
    """
    per = sum(bytes_per_parameter().values())
    fig, (ax,) = canvas(9.8, 6.0, (0, 16.2), (0.35, 8.7))
    ys = dict(zip((c for c, _ in LINES), (7.3, 6.2, 3.6, 2.6, 1.6)))
    for c, label in LINES:
        ax.add_patch(Rectangle((0.3, ys[c] - 0.4), 3.9, 0.8, fc=class_colour(c), ec="white", gid=f"line/{c}"))
        ax.text(2.25, ys[c], label, ha="center", va="center", fontsize=9.5)
    ax.text(2.25, 8.3, "what the strategies cut", ha="center", va="center", fontsize=10, fontweight="bold")
    ax.text(2.25, 4.7, f"the model's state: {per} bytes\nper parameter, a floor", ha="center", va="center",
            fontsize=10, fontweight="bold")
    state_y = (ys["parameters"] - 0.4 + ys["optimizer_states"] + 0.4) / 2
    for k, (name, text, lines) in enumerate(LEVERS):
        y = 7.9 - 1.3 * k
        sharding = lines == ("state",)
        box(ax, 7.45, y, 4.5, "", fc="white" if sharding else OP, ec="grey" if sharding else FWD,
            ls="--" if sharding else "-", h=1.05)
        ax.text(5.35, y + 0.28, name, fontsize=9.5, fontweight="bold", va="center")
        ax.text(5.35, y - 0.2, text, fontsize=9, va="center", linespacing=1.1)
        for c in lines:
            target = state_y if c == "state" else ys[c]
            arrow(ax, (5.2, y), (4.45, target), "grey" if sharding else FWD, ls="--" if sharding else "-", lw=1.1)
            ax.patches[-1].set_gid(f"lever/{name}/{c}")
    ax.plot([4.35, 4.35], [ys["parameters"] - 0.4, ys["optimizer_states"] + 0.4], color="grey", lw=2)
    # the rule: the fastest candidate that fits the budget (schematic candidates, the package's rule)
    x0, y0, sx, sy = 10.6, 1.0, 4.6 / 3.0, 6.0 / 1.0
    at = {n: (x0 + t * sx - 1.2, y0 + p * sy) for n, (p, t) in RULE_POINTS.items()}
    front = pareto.pareto_front(RULE_POINTS)
    pick = pareto.choose_for_budget(RULE_POINTS, budget, 0.0, 0.0)
    ax.add_patch(Rectangle((x0, y0), 5.3, budget * sy, fc="#e9f7ef", ec="none", gid="fits"))
    ax.plot([x0, x0 + 5.3], [y0 + budget * sy] * 2, color="#1e8449", ls="--", lw=1.2)
    ax.text(x0 + 5.25, y0 + budget * sy + 0.12, "budget", ha="right", va="bottom", fontsize=9.5, color="#1e8449")
    arrow(ax, (x0, y0), (x0 + 5.4, y0), "black", lw=1)
    arrow(ax, (x0, y0), (x0, y0 + 6.4), "black", lw=1)
    ax.text(x0 + 5.4, y0 - 0.3, "step time", ha="right", va="center", fontsize=9.5)
    ax.text(x0 - 0.15, y0 + 6.4, "peak", ha="right", va="top", fontsize=9.5, rotation=90)
    steps = sorted(front, key=lambda n: RULE_POINTS[n][1])
    ax.step([at[n][0] for n in steps], [at[n][1] for n in steps], where="post", color="crimson", lw=1)
    for n, (x, y) in at.items():
        ax.plot([x], [y], "o", ms=6, color="crimson" if n in front else "grey",
                mfc="crimson" if n in front else "white", gid=f"point/{n}")
    px, py = at[pick]
    ax.plot([px], [py], "o", ms=16, mfc="none", color="#1e8449", mew=1.6, gid=f"pick/{pick}")
    ax.text(x0 + 0.3, y0 + 0.9, "the pick: the fastest\nthat fits", fontsize=9.5, color="#1e8449", va="center")
    arrow(ax, (x0 + 0.8, y0 + 1.3), (px - 0.05, py - 0.3), "#1e8449", lw=1)
    ax.text(at["plain"][0] + 0.2, at["plain"][1], "plain", fontsize=9.5, va="center")
    ax.text(x0 + 2.65, 8.3, "the rule for a budget", ha="center", va="center", fontsize=10, fontweight="bold")
    ax.set_title("Choosing a memory strategy: levers on the ledger, then the fastest that fits", fontsize=11.5)
    fig.legend(handles=[Line2D([], [], color="crimson", marker="o", lw=1, label="Pareto set: no other is both "
                               "leaner and faster"),
                        Line2D([], [], color="grey", marker="o", mfc="white", lw=0, label="dominated"),
                        Patch(fc="#e9f7ef", label="fits the budget (with headroom)")],
               loc="outside lower center", ncol=3, fontsize=9.5, frameon=False)
    return fig
