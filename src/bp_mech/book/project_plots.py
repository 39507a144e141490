"""The figures of the pages that combine mechanisms: 56 (continual pretraining), 73 (the training
baseline), 74 (the profiling diagnosis) and 76 (the memory strategy). Each takes computed numbers or
records and draws; nothing here measures."""

from __future__ import annotations

from bp_mech.book.plots import figure
from bp_mech.ledger_table import CLASS_LABELS, CLASSES
from bp_mech.projects.diagnosis import POINT_LABELS
from bp_mech.projects.step_profile import CATEGORIES, StepProfile


def plot_gain_drift(evals: list[dict], title: str, bounds: dict[str, float] | None = None):
    """Each loss's change from the base over the domain updates (nats per token; 0: the base): the domain
    loss's fall is the gain, the holdout loss's rise the drift; the end values are written beside them.
    ``bounds`` (optional): per loss, the change at the rule's bound (the gain's floor as a fall, the drift's
    bound as a rise), drawn as a dotted line in the loss's colour."""
    fig, ax = figure(6.4, 3.4)
    x = [e["update"] for e in evals]
    ax.axhline(0.0, color="grey", lw=1, ls="--", label="the base (update 0)")
    for name, marker, label, word, sign in (("domain", "o", "domain (its held-out part): down = gain", "gain", -1),
                                            ("holdout", "s", "holdout (general text): up = drift", "drift", 1)):
        dy = [e[name] - evals[0][name] for e in evals]
        line, = ax.plot(x, dy, marker=marker, ms=4, label=label)
        ax.annotate(f"{word} {sign * dy[-1]:+.3f}", (x[-1], dy[-1]), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=8, color=line.get_color())
        if bounds and name in bounds:
            ax.axhline(bounds[name], color=line.get_color(), lw=1, ls=":", label=f"the rule's {word} bound")
    ax.set_xlim(x[0], x[-1] + 0.2 * (x[-1] - x[0] or 1))
    ax.set_xlabel("domain update")
    ax.set_ylabel("loss − the base's loss (nats per token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_resume(main_steps: list[dict], resumed_steps: list[dict], at: int, title: str):
    """The training loss per step of the uninterrupted run and, on top of it, of the resumed one."""
    fig, ax = figure(6.4, 3.4)
    ax.plot(range(1, len(main_steps) + 1), [r["loss"] for r in main_steps], lw=2.5, alpha=0.5,
            label="uninterrupted")
    start = len(main_steps) - len(resumed_steps)
    ax.plot(range(start + 1, len(main_steps) + 1), [r["loss"] for r in resumed_steps], "k.", ls=":",
            label="resumed from the checkpoint")
    ax.axvline(at + 0.5, color="grey", ls="--", lw=1, label=f"checkpoint (update {at})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_loss_curves(records, title: str = "Training loss per update"):
    """The loss curve of every record (x = update), the holdout loss before and after as markers."""
    fig, ax = figure(6.4, 3.6)
    for i, r in enumerate(records):
        ys = [float("nan") if y is None else y for y in r.metrics["curve"]["loss"]]
        line, = ax.plot(range(1, len(ys) + 1), ys, ls=("-", "--")[i % 2], lw=1.5, label=f"{r.candidate}: training")
        ax.plot([0, len(ys)], [r.metrics["holdout_before"], r.metrics["holdout_after"]], "os"[i % 2],
                color=line.get_color(), mfc="none", ms=8, label=f"{r.candidate}: holdout before / after")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats per target token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig

def plot_rank_check(tokens: list[list[int]], err_divisor: list[float], err_naive: list[float],
                    title: str):
    """Project 73's distributed check, one update per x position: left, each rank's target tokens
    (grouped bars, ``tokens[u][r]``); right, the gradient's relative error against one process
    (log scale) with the divisor N/P and with the per-rank mean, float64's epsilon dashed."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 3.4), constrained_layout=True)
    x = range(1, len(tokens) + 1)
    ranks = len(tokens[0])
    width = 0.8 / ranks
    for r in range(ranks):
        left.bar([u + (r - (ranks - 1) / 2) * width for u in x], [t[r] for t in tokens], width,
                 label=f"rank {r}")
    low = min(min(t) for t in tokens)
    left.set_ylim(0.9 * low, 1.04 * max(max(t) for t in tokens))  # the differences, not the totals
    left.set_xlabel("update")
    left.set_ylabel("target tokens of the rank")
    left.legend(fontsize=8)
    right.semilogy(list(x), err_naive, "s-", color="C3", label="per-rank mean (divisor n_r)")
    right.semilogy(list(x), err_divisor, "o-", color="C2", label="divisor N / P")
    right.axhline(torch_eps(), color="grey", ls="--", lw=1, label="float64 epsilon")
    right.set_xlabel("update")
    right.set_ylabel("relative L2 error of the gradient")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(list(x))
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return fig


def torch_eps() -> float:
    """float64's machine epsilon, the floor of a rounding-only difference."""
    import torch

    return torch.finfo(torch.float64).eps


# --- figures ---------------------------------------------------------------------------------------

CATEGORY_COLORS = dict(parameter="darkgreen", optimizer_state="goldenrod", gradient="mediumblue",
                       activation="red", autograd_detail="royalblue", temporary="mediumpurple", input="black",
                       unknown="grey")  # torch's own memory-timeline colours
# each ledger class in the colour of the category it maps to (diagnosis.CATEGORY_TO_CLASS); logits & loss apart
LEDGER_COLORS = dict(parameters="darkgreen", optimizer_states="goldenrod", gradients="mediumblue",
                     saved_activations="red", logits_loss="darkorange", other="grey")


def plot_memory_timeline(p: StepProfile, title: str):
    """The profiler's live bytes by category over the active steps (stacked), the phases marked."""
    fig, ax = figure(7.5, 3.8)
    t = [x / 1e3 for x in p.times_us]
    scale = 2**20
    ax.stackplot(t, *[[b / scale for b in p.bytes_by_category[c]] for c in CATEGORIES],
                 labels=[c.replace("_", " ") for c in CATEGORIES], colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
                 step="post", alpha=0.85)
    width = max(end for _, _, end in p.phases)
    for i, (name, start, end) in enumerate(p.phases):
        ax.axvspan(start / 1e3, end / 1e3, color="grey", alpha=0.08 if i % 2 else 0.0)
        if end - start > 0.05 * width:  # (zero_grad is too short to label)
            ax.text((start + end) / 2e3, ax.get_ylim()[1] * 0.97, name, ha="center", va="top", fontsize=7)
    ax.set_xlabel("time since the first profiled step (ms, under the profiler)")
    ax.set_ylabel("live bytes (MiB)")
    ax.set_title(title)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8, frameon=False)
    return fig


def plot_operators(p: StepProfile, title: str):
    """The top operators by self time per step (horizontal bars, largest on top)."""
    fig, ax = figure(7.0, 0.35 * len(p.operators) + 1.2)
    ops = list(reversed(p.operators))
    short = [o["name"].replace("aten::", "") for o in ops]
    ax.barh(range(len(ops)), [o["self_us"] / 1e3 for o in ops], color="tab:blue")
    ax.set_yticks(range(len(ops)), [n if len(n) <= 28 else n[:10] + "…" + n[-17:] for n in short])
    for i, o in enumerate(ops):
        ax.text(o["self_us"] / 1e3, i, f" {o['share']:.1%}", va="center", fontsize=7)
    ax.set_xlim(0, 1.2 * max((o["self_us"] / 1e3 for o in ops), default=1.0))
    ax.set_xlabel(f"self {'CPU' if p.device == 'cpu' else 'device'} time per step (ms, under the profiler)")
    ax.set_title(title)
    return fig


def plot_cross_check(rows: dict, profiled: dict, title: str):
    """At each point the profiler has: the ledger's classes (left bar) beside the profiler's categories
    (right bar), stacked, in MiB."""
    fig, ax = figure(7.5, 3.8)
    points = list(profiled)
    for i, pt in enumerate(points):
        bottom = 0.0
        for c in CLASSES:
            v = rows[pt][c] / 2**20
            ax.bar(i - 0.2, v, 0.38, bottom=bottom, color=LEDGER_COLORS[c], label=CLASS_LABELS[c] if i == 0 else None)
            bottom += v
        bottom = 0.0
        for c in CATEGORIES:
            v = profiled[pt].get(c, 0) / 2**20
            ax.bar(i + 0.2, v, 0.38, bottom=bottom, color=CATEGORY_COLORS[c], hatch="//", edgecolor="white",
                   label=f"profiler: {c.replace('_', ' ')}" if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(points)), [POINT_LABELS[p].replace("in the ", "").replace(" ", "\n", 1) for p in points],
                  fontsize=7)
    ax.set_ylabel("live bytes (MiB): ledger | profiler")
    ax.set_ylim(0, 1.06 * ax.get_ylim()[1])  # the tallest bar below the frame's top
    ax.set_title(title)
    fig.set_size_inches(7.5, 5.0)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig


def plot_savings(outcomes: list, title: str):
    """Per remedy (``profiling.Outcome``): the naive, the predicted and the measured saving at the peak (MiB)."""
    fig, ax = figure(7.0, 3.6)
    names = [o.remedy for o in outcomes]
    for k, (key, label) in enumerate((("naive_saving", "naive (peak stays)"), ("predicted_saving", "predicted"),
                                      ("measured_saving", "measured"))):
        ax.bar([i + (k - 1) * 0.27 for i in range(len(names))], [(getattr(o, key) or 0) / 2**20 for o in outcomes], 0.26,
               label=label)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("peak saving (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_frontier(points: dict[str, tuple[int, float, float]], front: list[str], title: str,
                  max_peak: float | None = None, pick: str | None = None):
    """The memory–time plane: each candidate at (median step, peak), a whisker to its P95; the Pareto set
    filled, named and joined; the others numbered (the key beside the plot); the largest peak that fits
    the budget dashed; the pick ringed. ``points`` = {candidate: (peak bytes, median s, P95 s)}."""
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = figure(9.0, 4.6)
    scale, unit = (2**30, "GiB") if max(p for p, _, _ in points.values()) >= 2**30 else (2**20, "MiB")
    key = []
    for name, (peak, med, p95) in points.items():
        on = name in front
        ax.errorbar([med * 1e3], [peak / scale], xerr=[[0], [max(p95 - med, 0) * 1e3]], fmt="o", capsize=3,
                    color="C3" if on else "grey", mfc="C3" if on else "white", ms=7, zorder=3 if on else 2)
        if not on:
            key.append(f"{len(key) + 1}: {name}")
        ax.annotate(name if on else str(len(key)), (med * 1e3, peak / scale), textcoords="offset points",
                    xytext=(5, 5), fontsize=8 if on else 7, color="black" if on else "dimgrey")
    by_time = front[::-1]  # the set's staircase: the least peak reachable within a step time
    ax.step([points[n][1] * 1e3 for n in by_time], [points[n][0] / scale for n in by_time], where="post", color="C3",
            lw=1, label="Pareto set")
    if max_peak is not None:
        ax.axhline(max_peak / scale, ls="--", color="C0", lw=1, label="largest peak that fits the budget")
    if pick is not None:
        ax.plot([points[pick][1] * 1e3], [points[pick][0] / scale], "o", ms=15, mfc="none", color="C0", label="pick")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("median step time (ms, log); whisker to P95")
    ax.set_ylabel(f"peak ({unit})")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    if key:
        ax.text(1.02, 1.0, "dominated:\n" + "\n".join(key), transform=ax.transAxes, fontsize=7, va="top")
    return fig


def plot_state_per_gpu(params: int, traced: dict[int, float], title: str, unit: float = 2**30):
    """Per-GPU model state (weights, gradients, AdamW's moments; float32) against the number of GPUs, one line per
    stage of ``data_parallel_state``, log-log, with the traced values (``{gpus: bytes}``) as points on top."""
    from bp_mech.projects.data_parallel_state import STAGES, model_state_per_gpu

    fig, ax = figure(6.4, 3.6)
    ns = [1, 2, 4, 8, 16, 32, 64]
    for stage, style in zip(STAGES, ("-", "--", "-.", ":")):
        ax.plot(ns, [model_state_per_gpu(params, n, stage) / unit for n in ns], style, marker=".", label=stage)
    ax.plot(list(traced), [b / unit for b in traced.values()], "k*", ms=12, ls="none",
            label="FSDP2, traced (bp-mech plan)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("GPUs N")
    ax.set_ylabel("model state per GPU (GiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
