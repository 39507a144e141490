"""The opening pictures of the training loop's chapters (issue 29): what each mechanism does, before any code.

Structural drawings, no measured numbers; each number shown is computed by the package when it is drawn: one
padded batch's micro-batches adding into one ``.grad`` (Part 02 · 11), micro-batches, optimizer calls and two
learning-rate clocks on one timeline (12), float16's range and the loss-scaled step (12b), clipping onto the
norm ball and AdamW's step (55), continual pretraining's gain, drift and resume (56). Each returns the figure.
"""

from __future__ import annotations

import inspect
import itertools
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.lines import Line2D
from matplotlib.patches import Circle, FancyBboxPatch, Patch, Rectangle

from bp_mech.book.drawing import BWD, FWD, OP, SAVED, arrow, box, canvas

SKIP, PAD = "#fdedec", "#d5d8dc"  # a skipped call's fill (and float16's values); a padded position
LEGEND = dict(loc="outside lower center", fontsize=8, frameon=False)


def accumulation_flow(k: int = 3):
    """Gradient accumulation (Part 02 · 11): ``k`` micro-batches of one padded batch (``accumulation.padded_batches``,
    their targets counted by ``count_targets``), each forward and backward on its own, each loss weighted by its
    share $n_j/N$ of the targets, all adding into one ``.grad``; then one optimizer step.

    Example:
        >>> fig = accumulation_flow(2)
        >>> sum(t.get_text().startswith("optimizer.step()") for t in fig.axes[0].texts)
        1
    """
    from bp_mech.accumulation import count_targets, padded_batches, split
    from bp_mech.chunked_loss import IGNORE
    from bp_mech.instruments.workload import parse_workload

    batch = padded_batches(parse_workload("tiny-b2s12"), 1, micro_max=k, max_pad=0.6)[0]  # two rows each
    parts = [(m["labels"][:, 1:] != IGNORE, int(count_targets(m["labels"]))) for m in split(batch, k)]
    N = sum(n for _, n in parts)
    fig, (ax,) = canvas(8.8, 4.5, (-0.2, 3.0 * k + 2.6), (-0.5, 4.45))
    for j, (mask, n) in enumerate(parts):
        x, name = 1.4 + 3.0 * j, f"{j + 1}" if j < k - 1 else "k"
        ax.text(x, 4.25, f"micro-batch ${name}$", ha="center", va="center", fontsize=9, fontweight="bold")
        cell = 2.2 / mask.shape[1]
        for r, t in itertools.product(*map(range, mask.shape)):
            ax.add_patch(Rectangle((x - 1.1 + t * cell, 3.75 - 0.22 * r), cell * 0.9, 0.18, lw=0,
                                   fc=FWD if mask[r, t] else PAD))
        ax.text(x, 3.15, f"$n_{name}$ = {n} targets", ha="center", va="center", fontsize=8)
        box(ax, x, 2.3, 2.6, f"forward: summed token loss $S_{name}$\nbackward of $S_{name}\\,/\\,N$", size=8,
            h=0.75)
        arrow(ax, (x, 2.95), (x, 2.7), FWD)
        arrow(ax, (x, 1.9), (x, 1.2), BWD)
        ax.text(x + 0.08, 1.55, f"weight $n_{name}/N$ = {n}/{N}, not $1/k$", ha="left", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"))
        if j:
            arrow(ax, (x - 1.75, 2.3), (x - 1.3, 2.3), "grey", lw=1)
    right = 3.0 * k - 0.15
    ax.add_patch(FancyBboxPatch((0.1, 0.55), right - 0.1, 0.6, boxstyle="round,pad=0,rounding_size=0.1",
                                fc=SAVED, ec="#b9770e", zorder=2))
    ax.text(right / 2, 0.85, r"one .grad, never zeroed in between: $\sum_j \nabla(S_j/N)$ is the full batch's "
            f"gradient, $N$ = {N}", ha="center", va="center", fontsize=9, zorder=3)
    box(ax, right + 1.25, 0.85, 2.1, "optimizer.step()\nonce", fc=OP, size=8, h=0.75)
    arrow(ax, (right, 0.85), (right + 0.2, 0.85), FWD)
    box(ax, right + 1.25, -0.2, 2.1, "zero_grad()", fc="white", size=8)
    arrow(ax, (right + 1.25, 0.47), (right + 1.25, 0.05), FWD)
    ax.set_title(f"Accumulation: $k$ = {k} micro-batches run one after another, add into one gradient, one update",
                 fontsize=10)
    fig.legend(handles=[Patch(fc=FWD, label="target token"), Patch(fc=PAD, label="padding (label −100)"),
                        Line2D([], [], color=BWD, label="gradient added to .grad")], ncol=3, **LEGEND)
    return fig


def clock_timeline(calls: int = 8, micro: int = 2, skipped: tuple[int, ...] = (3, 4)):
    """The learning-rate clock (Part 02 · 12): ``micro`` micro-batches per optimizer call, some calls skipped;
    the count each call reads from the update clock (``scheduler.UpdateClock``, applied updates) and from the
    naive one (``NaiveClock``, calls); below, the learning rate of a WSD schedule each clock gives each call.

    Example:
        >>> fig = clock_timeline(4, 2, (2,))
        >>> [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("skip")]
        ['skip']
    """
    from bp_mech.scheduler import NaiveClock, UpdateClock, WSDConfig

    cfg = WSDConfig(base_lr=1.0, warmup=3, stable=1, decay=2, decay_type="linear")
    clocks = {"update clock": UpdateClock(cfg), "naive clock": NaiveClock(cfg)}
    lrs = {name: [] for name in clocks}
    fig, (ax, lr) = plt.subplots(2, 1, figsize=(8.8, 4.9), layout="constrained", height_ratios=(1.25, 1),
                                 sharex=True)
    ax.set_ylim(-0.35, 3.05)
    ax.set_axis_off()
    for label, y in (("micro-batches", 2.6), ("optimizer calls", 1.75), ("update clock reads", 0.95),
                     ("naive clock reads", 0.2)):
        ax.text(0.45, y, label, ha="right", va="center", fontsize=8, fontweight="bold")
    width = 0.7 / micro
    for c in range(1, calls + 1):
        applied = c not in skipped
        for m in range(micro):
            box(ax, c - 0.35 + width * (m + 0.5), 2.6, width * 0.85, "", h=0.3)
        arrow(ax, (c, 2.42), (c, 2.0), "grey", lw=0.8)
        box(ax, c, 1.75, 0.62, "step" if applied else "skip", fc=OP if applied else SKIP,
            ec=FWD if applied else BWD, size=8, h=0.4)
        ahead = clocks["naive clock"].position > clocks["update clock"].position
        for (name, clock), y in zip(clocks.items(), (0.95, 0.2)):
            lrs[name].append(clock.lr)
            off = ahead and name == "naive clock"
            ax.text(c, y, f"{clock.position}", ha="center", va="center", fontsize=9, color=BWD if off else FWD,
                    bbox=dict(boxstyle="circle,pad=0.2", fc=SKIP if off else SAVED, ec=BWD if off else "#b9770e"))
            clock.step(applied)
    xs = range(1, calls + 1)
    for (name, ys), color, mk, ls, ms in zip(lrs.items(), (FWD, BWD), "os", ("-", "--"), (5, 7)):
        lr.plot(xs, ys, color=color, ls=ls, lw=1.2, label=f"read by the {name}", zorder=3 - (ms > 5))
        for x, y in zip(xs, ys):
            lr.plot([x], [y], marker=mk, color=color, ms=ms, mfc="white" if x in skipped else color, ls="none",
                    zorder=3 - (ms > 5))
    for c in skipped:
        lr.axvspan(c - 0.4, c + 0.4, color=SKIP, zorder=0)
    lr.set_xlim(-0.95, calls + 0.45)
    lr.set_xticks(list(xs), [f"call {c}" for c in xs])
    lr.set_ylabel("learning rate\n(× peak)", fontsize=8)
    lr.tick_params(labelsize=8)
    lr.legend(fontsize=8, loc="upper left")
    ax.set_title("The schedule's clock counts applied updates: not micro-batches, not skipped calls",
                 fontsize=10)
    fig.legend(handles=[Patch(fc=OP, ec=FWD, label="micro-batch: forward + backward"),
                        Patch(fc=SKIP, ec=BWD, label="skipped call (inf or NaN): no update; the naive clock ahead"),
                        Patch(fc=SAVED, ec="#b9770e", label="the count a call reads")], ncol=3, **LEGEND)
    return fig


def amp_step():
    """Mixed precision (Part 02 · 12b): float16's range with the gradients lifted into it by the loss scale,
    and one step: float32 master weights, autocast forward, loss times $S$, backward, unscale, the inf check,
    then the update or the skip.

    Example:
        >>> fig = amp_step()
        >>> any("smallest normal" in t.get_text() for t in fig.axes[0].texts)
        True
    """
    from bp_mech.book.amp_plots import fp16_range

    r = fp16_range()
    defaults = {k: v.default for k, v in inspect.signature(torch.amp.GradScaler).parameters.items()}
    S, back, grow, every = (defaults[k] for k in ("init_scale", "backoff_factor", "growth_factor", "growth_interval"))
    sub, normal, top, shift = (math.log2(v) for v in (r.subnormal, r.normal, r.max, S))
    fig, (line, flow) = canvas(8.8, 5.8, (sub - 8, top + 6), (-1.15, 1.45), rows=2)
    line.plot([sub - 7, top + 5], [0, 0], color="black", lw=1)
    for a, b, colour, alpha in ((sub - 7, sub - 1, BWD, 0.15), (sub - 1, normal, "grey", 0.2), (top, top + 5, BWD, 0.3)):
        line.axvspan(a, b, ymin=0.25, ymax=0.55, color=colour, alpha=alpha)
    for x, text in ((sub - 4, "rounds to 0"), ((sub + normal) / 2 - 0.5, "subnormal:\nfewer bits"),
                    ((normal + top) / 2, "normal: every significand bit"), (top + 2.5, "inf")):
        line.text(x, -0.2, text, ha="center", va="center", fontsize=7)
    for v, name in ((r.subnormal, "smallest subnormal"), (r.normal, "smallest normal"), (r.max, "largest")):
        x = math.log2(v)
        line.plot([x, x], [-0.15, 0.15], color="black", lw=1)
        line.text(x, -0.72, f"{name}\n$2^{{{x:.0f}}}$" if v < 1 else f"{name}\n{v:g}", ha="center",
                  va="center", fontsize=7)
    lo, hi = sub - 5, normal + 6  # where small gradients sit, around float16's normal edge
    for (a, b), y, text, fc in (((lo, hi), 0.55, "true gradients $g$", "#d6eaf8"),
                                ((lo + shift, hi + shift), 1.1, f"$S\\,g$, $S = 2^{{{shift:.0f}}}$", SAVED)):
        line.add_patch(FancyBboxPatch((a, y - 0.17), b - a, 0.34, boxstyle="round,pad=0,rounding_size=0.15",
                                      fc=fc, ec="grey", zorder=2))
        line.text((a + b) / 2, y, text, ha="center", va="center", fontsize=8, zorder=3)
    arrow(line, (hi + 0.3, 0.6), (hi + shift - 0.5, 1.02), FWD)
    line.text(hi + shift / 2 + 2.5, 0.72, "× S lifts them by the same factor", fontsize=8, color=FWD, va="center")
    line.set_title("float16's range (log scale) and the loss scale: small gradients lifted out of the "
                   "subnormals", fontsize=10)
    W = (top - sub + 14) / 4.2  # flow boxes on the same data range: four columns
    cols = [sub - 8 + W * (i + 0.5) + 0.1 * W for i in range(4)]
    steps = [(cols[0], 1.0, "float32 master\nweights", OP), (cols[1], 1.0, "autocast forward\nfp16 matmuls", OP),
             (cols[2], 1.0, "loss × $S$", OP), (cols[3], 1.0, "backward: gradients\n× $S$ in fp16", "#fdedec"),
             (cols[3], -0.3, "unscale: $g = $ grad $/ S$\nin float32", "#fdedec"),
             (cols[2], -0.3, "any inf or NaN?", "white")]
    for x, y, text, fc in steps:
        box(flow, x, y, 0.8 * W, text, fc=fc, size=8, h=0.62)
    for (x0, y0, *_), (x1, y1, *_) in zip(steps, steps[1:]):
        if y0 == y1:
            d = 0.4 * W if x1 > x0 else -0.4 * W
            arrow(flow, (x0 + d, y0), (x1 - d, y1), FWD if y0 > 0 else BWD)
        else:
            arrow(flow, (x0, y0 - 0.31), (x1, y1 + 0.31), BWD)
    box(flow, cols[1], -0.05, 0.8 * W, "no: clip, AdamW step\non the master weights;\n"
        f"{every} in a row: $S$ ← {grow:g} × $S$", fc=OP, size=8, h=0.78)
    box(flow, cols[1], -0.82, 0.8 * W, f"yes: skip the step,\n$S$ ← {back:g} × $S$", fc=SKIP, ec=BWD,
        size=8, h=0.5)
    arrow(flow, (cols[2] - 0.4 * W, -0.22), (cols[1] + 0.4 * W, -0.12), FWD)
    arrow(flow, (cols[2] - 0.4 * W, -0.4), (cols[1] + 0.4 * W, -0.78), BWD)
    arrow(flow, (cols[1] - 0.4 * W, -0.1), (cols[0], 0.69), FWD, rad=-0.3)
    flow.set_title("One step under a dynamic loss scale", fontsize=10)
    fig.legend(handles=[Line2D([], [], color=FWD, label="forward and update"),
                        Line2D([], [], color=BWD, label="backward and gradients"),
                        Patch(fc=SKIP, ec=BWD, label="fp16 or scaled values; the skip")], ncol=3, **LEGEND)
    return fig


def clip_and_step(max_norm: float = 1.0):
    """Clipping and the update (Part 02 · 55): a gradient outside the ball of radius ``max_norm`` rescaled onto it
    (``update_dynamics.clip_by_global_norm_``), one inside left alone; AdamW's first update from the gradient and
    from the clipped one, at two learning rates: the learning rate sets the step's size, the clip does not.

    Example:
        >>> fig = clip_and_step()
        >>> [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("inside")]
        ['inside: $c$ = 1, unchanged']
    """
    from bp_mech.update_dynamics import clip_by_global_norm_

    def adamw_first_update(grad, lr):  # torch's AdamW, one step from zero, no weight decay
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        torch.optim.AdamW([p], lr=lr, weight_decay=0.0).step()
        return p.detach()

    out, inside = torch.tensor([2.4, 1.2]) * max_norm, torch.tensor([0.45, -0.55]) * max_norm
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    for p, g in zip(params, (out, inside)):
        p.grad = g.clone()
    norm, _ = (clip_by_global_norm_([p], max_norm).item() for p in params)
    cg, cin = (p.grad for p in params)
    fig, (ax, up) = plt.subplots(1, 2, figsize=(8.8, 4.2), layout="constrained", width_ratios=(1.25, 1))
    ax.add_patch(Circle((0, 0), max_norm, fc="#eaf2f8", ec=FWD, lw=1.2))
    ax.plot([0, -0.71 * max_norm], [0, -0.71 * max_norm], color=FWD, lw=0.8, ls=":")
    ax.text(-0.76 * max_norm, -0.74 * max_norm, "max_norm", ha="right", va="top", fontsize=8, color=FWD)
    arrow(ax, (0, 0), tuple(out.tolist()), "grey", ls="--")
    arrow(ax, (0, 0), tuple(cg.tolist()), FWD, lw=2)
    arrow(ax, (0, 0), tuple(cin.tolist()), FWD, lw=2)
    ax.text(*out.tolist(), f"  $g$: ‖g‖ = {norm:.2f}", ha="left", va="center", fontsize=8)
    ax.text(cg[0].item() + 0.1, cg[1].item() - 0.12, f"$c\\,g$, $c$ = {cg.norm().item() / norm:.2f}",
            ha="left", va="top", fontsize=8, color=FWD)
    ax.text(cin[0].item(), cin[1].item() - 0.1, "inside: $c$ = 1, unchanged", ha="center", va="top", fontsize=8)
    ax.set_title("Clipping: one factor $c$ for all gradients,\nthe same direction, the norm at most max_norm",
                 fontsize=9)
    lim = 1.7 * max_norm
    for a, lo, hi in ((ax, (-lim, 3.6 * max_norm), (-lim, lim)), (up, (-1.55, 0.45), (-1.55, 0.45))):
        a.set(xlim=lo, ylim=hi, aspect="equal")
        a.set_axis_off()
        a.axhline(0, color="grey", lw=0.5)
        a.axvline(0, color="grey", lw=0.5)
    steps = {name: (adamw_first_update(out, lr), adamw_first_update(cg, lr))
             for lr, name in ((0.6, "lr $\\eta$"), (1.2, "a higher lr"))}
    for colour, lw, pick in (("#aab7b8", 5, 0), (FWD, 1.2, 1)):  # the clipped on top of the unclipped
        for d in steps.values():
            arrow(up, (0, 0), tuple(d[pick].tolist()), colour, lw=lw)
    for name, (_, d) in steps.items():
        up.text(d[0].item() + 0.12, d[1].item() - 0.05, name, ha="left", va="top", fontsize=8)
    up.set_title("AdamW's update, $-$lr × its direction:\nthe same from $g$ and from $c\\,g$", fontsize=9)
    fig.legend(handles=[Line2D([], [], color="grey", ls="--", label="gradient before clipping"),
                        Line2D([], [], color=FWD, lw=2, label="after clipping; update from it"),
                        Line2D([], [], color="#aab7b8", lw=5, label="update from the unclipped gradient")],
               ncol=3, **LEGEND)
    return fig


def continual_flow():
    """Continual pretraining (Part 02 · 56): the base and the trained model, each measured on the domain's held-out
    text and on the general holdout; the gain and the drift they give, the rule's bounds
    (``experiments.continual_pretrain_rule``), and the saved state a resumed run must continue from.

    Example:
        >>> fig = continual_flow()
        >>> any(t.get_text().startswith("gain") for t in fig.axes[0].texts)
        True
    """
    from bp_mech.experiments import continual_pretrain_rule as rule

    fig, (ax,) = canvas(8.8, 4.6, (0, 10), (-0.45, 4.9))
    box(ax, 1.5, 4.35, 2.6, "base model\n(pretrained on general text)", size=8, h=0.7)
    box(ax, 8.5, 4.35, 2.6, "the model after\n$N$ domain updates", size=8, h=0.7)
    arrow(ax, (2.85, 4.35), (7.15, 4.35), FWD, lw=2.5)
    ax.text(5.0, 4.68, "continued training on domain text\n(+ replayed general rows, optionally)", fontsize=8,
            ha="center", va="center")
    box(ax, 4.3, 3.45, 3.5, "saved training state: weights, AdamW\nmoments, clock, RNG, data position",
        fc=SAVED, ec="#b9770e", size=7, h=0.6)
    arrow(ax, (3.7, 4.3), (3.7, 3.77), "#b9770e", ls=":")
    arrow(ax, (6.08, 3.45), (6.4, 4.27), "#b9770e", ls=":", rad=0.4)
    ax.text(6.55, 3.6, "resume: continues bit for bit", ha="left", va="center", fontsize=7)
    rows = (("domain", 2.45, "gain $G = L_\\mathrm{domain}(0) - L_\\mathrm{domain}(N)$"),
            ("holdout", 1.45, "drift $\\Delta = L_\\mathrm{holdout}(N) - L_\\mathrm{holdout}(0)$"))
    for name, y, middle in rows:
        for x, at in ((1.5, "0"), (8.5, "N")):
            box(ax, x, y, 2.6, f"$L_\\mathrm{{{name}}}({at})$", size=9)
        box(ax, 5.0, y, 3.7, middle, fc="white", size=8)
        arrow(ax, (2.8, y), (3.15, y), "grey", lw=0.8)
        arrow(ax, (7.2, y), (6.85, y), "grey", lw=0.8)
    for x in (1.5, 8.5):
        arrow(ax, (x, 3.98), (x, 2.7), FWD)
    ax.text(5.0, 1.95, "each a loss per target token, on text neither run trained on", ha="center", va="center",
            fontsize=7)
    box(ax, 5.0, 0.1, 9.6, f"decision: reject if $G$ < {rule.MIN_DOMAIN_GAIN_REL:.0%} of $L_\\mathrm{{domain}}(0)$;  "
        f"tune if $\\Delta$ > {rule.MAX_HOLDOUT_DRIFT_REL:.0%} of $L_\\mathrm{{holdout}}(0)$ (forgetting);  "
        "accept otherwise", fc=OP, size=8, h=0.55)
    arrow(ax, (5.0, 1.2), (5.0, 0.38), FWD)
    ax.set_title("Continual pretraining: learn the domain, measure what was forgotten, resume exactly",
                 fontsize=10)
    return fig
