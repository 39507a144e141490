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


def plot_saved_bytes(by_T: dict[str, dict[int, int]], title: str = "Saved state for the backward"):
    """Log-log saved bytes against sequence length, one line per candidate ({name: {T: bytes}}),
    with dotted guides of slope 1 (linear) and 2 (quadratic) through the first point."""
    fig, ax = figure()
    for i, (name, pts) in enumerate(by_T.items()):  # distinct markers: equal lines stay visible
        Ts = sorted(pts)
        ax.plot(Ts, [pts[t] / MIB for t in Ts], marker="osD^v"[i % 5], ms=9 - 1.5 * i,
                ls="--" if i % 2 else "-", mfc="none" if i % 2 else None, label=name)
    first = min(min(p) for p in by_T.values())
    last = max(max(p) for p in by_T.values())
    y0 = min(p[first] for p in by_T.values() if first in p) / MIB
    for k, style in ((1, ":"), (2, "--")):
        ax.plot([first, last], [y0, y0 * (last / first) ** k], style, color="grey", lw=1, label=f"∝ T^{k}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("saved for backward (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_backward_times(rows: dict[str, tuple[float, float]], title: str, ylabel: str = "time (ms)"):
    """The median as a dot with a whisker up to the P95, rows = {name: (median_s, p95_s)}; log y axis
    so that one slow outlier does not flatten the rest."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = figure(6.0, 3.2)
    names = list(rows)
    med = [rows[n][0] * 1e3 for n in names]
    p95 = [rows[n][1] * 1e3 for n in names]
    ax.errorbar(range(len(names)), med, yerr=[[0] * len(names), [p - m for p, m in zip(p95, med)]], fmt="o",
                ms=8, capsize=5, label="median, whisker to P95")
    ax.set_xticks(range(len(names)), names)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_ylabel(ylabel + ", log scale")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_lr_clock(records, x: str = "calls", title: str | None = None):
    """LR of each optimizer call of TRAIN-SCHEDULER-CLOCK records (one line per clock).

    ``x="calls"``: against the optimizer call index, skipped calls shaded; ``x="updates"``:
    the applied calls only, against the effective update index, with the nominal phase
    boundaries as dotted lines.
    """
    fig, ax = figure(6.8, 3.6)
    r0 = records[0].metrics
    for i, r in enumerate(records):
        m = r.metrics
        calls = range(len(m["lr_per_call"]))
        if x == "calls":
            xs, ys = list(calls), m["lr_per_call"]
        else:
            keep = [c for c in calls if m["applied_per_call"][c]]
            xs, ys = [m["effective_per_call"][c] for c in keep], [m["lr_per_call"][c] for c in keep]
        ax.plot(xs, [y * 1e3 for y in ys], marker="os"[i % 2], ms=6 - 2 * i, ls="-" if i == 0 else "--",
                mfc="none" if i == 0 else None, label=r.candidate)
    if x == "calls":
        for k, c in enumerate(r0["skipped_calls"]):
            ax.axvspan(c - 0.5, c + 0.5, color="red", alpha=0.15, lw=0, label="skipped call" if k == 0 else None)
        ax.set_xlabel("optimizer call")
    else:
        for name, b in r0["nominal"].items():
            ax.axvline(b, color="grey", ls=":", lw=1)
            ax.text(b, 0.04, " " + name.replace("_", " "), rotation=90, va="bottom", ha="right", fontsize=7,
                    transform=ax.get_xaxis_transform())
        ax.set_xlabel("effective update (applied optimizer steps before this one)")
    ax.set_ylabel("learning rate (×10⁻³)")
    ax.set_title(title or f"WSD learning rate against {'optimizer calls' if x == 'calls' else 'effective updates'}")
    ax.legend(fontsize=8)
    return fig


def plot_loss_scale(record, title: str = "Dynamic loss scale with injected FP16 overflows"):
    """Loss scale after each optimizer call (log2 axis) of an AMP overflow-sample record, with the
    injected and the skipped calls marked."""
    fig, ax = figure(6.8, 3.4)
    m = record.metrics
    s = m["loss_scale_trace"]
    ax.step(range(len(s)), s, where="post", marker="o", label="scale after update()")
    if "predicted_scale" in m:
        ax.plot(range(len(s)), m["predicted_scale"], "x", ms=9, color="black", label="DynamicLossScaler (model)")
    for k, c in enumerate(m.get("skipped_calls", [])):
        ax.axvspan(c - 0.5, c + 0.5, color="red", alpha=0.15, lw=0, label="skipped optimizer.step()" if k == 0 else None)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer call")
    ax.set_ylabel("loss scale S (log₂ axis)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


# --- Part 02 · 11: gradient accumulation ------------------------------------------------

def plot_accumulation_peaks(rows: dict[str, dict[str, tuple[int, int]]], title: str):
    """Stacked bars per sequence length and candidate: resident (params + AdamW state) and the
    incremental peak on top. rows = {seq label: {candidate: (resident_bytes, incremental_bytes)}}."""
    fig, ax = figure(7.0, 3.6)
    labels, res, inc = [], [], []
    for seq, cands in rows.items():
        for c, (r, i) in cands.items():
            labels.append(f"{seq}\n{c}")
            res.append(r / MIB)
            inc.append(i / MIB)
    ax.bar(labels, res, color="C7", label="resident: parameters + AdamW state")
    ax.bar(labels, inc, bottom=res, color="C0", label="incremental peak of the step")
    ax.set_ylabel("peak allocated (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_accumulation_tradeoff(points: dict[str, tuple[float, float, str]], min_peak_saving: float,
                               max_time_cost: float, title: str):
    """Peak ratio against median-step ratio (both vs the full batch), with the accept region of
    the decision rule shaded. points = {label: (time_ratio, peak_ratio, decision)}."""
    fig, ax = figure(6.0, 3.8)
    xs = [p[0] for p in points.values()] + [1.0, 1 + max_time_cost]
    ax.fill_between([0, 1 + max_time_cost], 0, 1 - min_peak_saving, color="C2", alpha=0.12,
                    label=f"accept: peak ≥ {min_peak_saving:.0%} lower, step ≤ {max_time_cost:.0%} slower")
    colors = {"accept": "C2", "tune": "C1", "reject": "C3"}
    for label, (t, p, d) in points.items():
        ax.scatter([t], [p], color=colors.get(d, "k"), zorder=3)
        ax.annotate(f"{label} ({d})", (t, p), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlim(0.5, max(xs) * 1.15)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("median step time / full batch")
    ax.set_ylabel("absolute peak / full batch")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return fig


# --- Part 02 · 55: update dynamics ------------------------------------------------------

def plot_update_trace(series: dict[str, list[float]], ylabel: str, title: str, log: bool = False,
                      hline: float | None = None, hlabel: str | None = None):
    """One line per candidate over the updates (x = update index, from 1)."""
    fig, ax = figure(6.4, 3.4)
    for i, (name, ys) in enumerate(series.items()):
        ys = [float("nan") if y is None else y for y in ys]  # non-finite values are null in records
        ax.plot(range(1, len(ys) + 1), ys, marker="o^s"[i % 3], ms=4, ls=("-", "--", ":")[i % 3], label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=1, ls="--", label=hlabel)
    if log:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("update")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
