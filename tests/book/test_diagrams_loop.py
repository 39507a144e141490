"""``book.diagrams_loop``: each opening picture of the training loop's chapters shows what it claims (the
micro-batches' targets and one update, the clock that skips the skipped calls, float16's landmarks and the
scale's shift, the clip onto the ball and AdamW's unchanged step, gain, drift and the rule), its numbers the
package's own, and no two of its texts overlap or leave the figure."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

from book.layout import outside, overlaps  # noqa: E402
from bp_mech.accumulation import count_targets, padded_batches, split  # noqa: E402
from bp_mech.book import diagrams_loop  # noqa: E402
from bp_mech.book.amp_plots import fp16_range  # noqa: E402
from bp_mech.book.drawing import BWD, FWD  # noqa: E402
from bp_mech.experiments import continual_pretrain_rule as rule  # noqa: E402
from bp_mech.instruments.workload import parse_workload  # noqa: E402
from bp_mech.scheduler import WSDConfig, wsd_lr  # noqa: E402

PICTURES = ("accumulation_flow", "clock_timeline", "amp_step", "clip_and_step", "continual_flow")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def arrows(ax, color=None) -> list:
    """The arrows' (start, end), of one colour where given."""
    return [p._posA_posB for p in ax.patches if isinstance(p, FancyArrowPatch)
            and (color is None or to_hex(p.get_edgecolor()) == to_hex(color))]


@pytest.mark.parametrize("name", PICTURES)
def test_no_text_overlaps_another_or_leaves_the_figure(name):
    fig = getattr(diagrams_loop, name)()
    assert overlaps(fig) == [] and outside(fig) == []


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_shows_each_micro_batchs_targets_its_weight_and_one_update(k):
    batch = padded_batches(parse_workload("tiny-b2s12"), 1, micro_max=k, max_pad=0.6)[0]
    counts = [int(count_targets(m["labels"])) for m in split(batch, k)]
    N = sum(counts)
    assert len(set(counts)) > 1  # uneven padding: the case where the weights matter
    ax = diagrams_loop.accumulation_flow(k).axes[0]
    names = [str(j + 1) for j in range(k - 1)] + ["k"]
    for name, n in zip(names, counts):
        assert f"$n_{name}$ = {n} targets" in texts(ax)
        assert f"weight $n_{name}/N$ = {n}/{N}, not $1/k$" in texts(ax)
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and not isinstance(p, FancyBboxPatch)]
    assert sum(to_rgb(p.get_facecolor()) == to_rgb(FWD) for p in cells) == N  # one blue cell per target
    assert len(arrows(ax, BWD)) == k  # every micro-batch's gradient goes into the one .grad
    assert sum(t.startswith("one .grad") and f"$N$ = {N}" in t for t in texts(ax)) == 1
    assert sum(t.startswith("optimizer.step()") for t in texts(ax)) == 1


@pytest.mark.parametrize("micro, skipped", [(2, (3, 4)), (3, (2,)), (1, ())])
def test_the_update_clock_ticks_once_per_applied_call_and_the_naive_one_per_call(micro, skipped):
    calls = 8
    fig = diagrams_loop.clock_timeline(calls, micro, skipped)
    ax, lr = fig.axes
    assert [t for t in texts(ax) if t in ("step", "skip")] == \
        ["skip" if c in skipped else "step" for c in range(1, calls + 1)]
    counts = [int(t) for t in texts(ax) if t.isdigit()]
    update, naive = counts[0::2], counts[1::2]  # per call: the update clock, then the naive one
    assert naive == list(range(calls))
    assert update == [sum(c not in skipped for c in range(1, call)) for call in range(1, calls + 1)]
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    assert len(boxes) == calls * (micro + 1)  # micro micro-batches per call, and one call: the clock ignores them
    cfg = WSDConfig(base_lr=1.0, warmup=3, stable=1, decay=2, decay_type="linear")
    update_line, naive_line = (line for line in lr.lines if line.get_label().startswith("read by"))
    assert list(update_line.get_ydata()) == [wsd_lr(k, cfg) for k in update]
    assert list(naive_line.get_ydata()) == [wsd_lr(k, cfg) for k in naive]
    assert (list(update_line.get_ydata()) != list(naive_line.get_ydata())) == bool(skipped)


def test_amp_shows_fp16s_landmarks_and_the_scale_lifting_the_gradients_into_range():
    r = fp16_range()
    scaler = torch.amp.GradScaler("cpu")  # the defaults, read through the scaler's own getters
    S, back, grow, every = (scaler.get_scale(), scaler.get_backoff_factor(), scaler.get_growth_factor(),
                            scaler.get_growth_interval())
    fig = diagrams_loop.amp_step()
    line, flow = fig.axes
    labels = texts(line)
    assert f"smallest subnormal\n$2^{{{math.log2(r.subnormal):.0f}}}$" in labels
    assert f"smallest normal\n$2^{{{math.log2(r.normal):.0f}}}$" in labels
    assert f"largest\n{r.max:g}" in labels
    g, sg = sorted((p for p in line.patches if isinstance(p, FancyBboxPatch)), key=lambda p: p.get_y())
    assert math.isclose(sg.get_x() - g.get_x(), math.log2(S))  # the same band, shifted by log2 S
    assert g.get_x() < math.log2(r.subnormal) < g.get_x() + g.get_width()  # some true gradients underflow
    assert math.log2(r.normal) < sg.get_x() and sg.get_x() + sg.get_width() < math.log2(r.max)  # S g: normal
    assert f"$S\\,g$, $S = 2^{{{math.log2(S):.0f}}}$" in labels
    steps = texts(flow)
    assert steps.index("loss × $S$") < steps.index("any inf or NaN?")
    assert f"yes: skip the step,\n$S$ ← {back:g} × $S$" in steps
    assert any(t.startswith("no: clip, AdamW step") and f"{every} in a row: $S$ ← {grow:g} × $S$" in t for t in steps)


def test_clipping_puts_the_gradient_on_the_ball_and_adamw_takes_the_same_step_from_either():
    for max_norm in (1.0, 0.5):
        fig = diagrams_loop.clip_and_step(max_norm)
        ball, up = fig.axes
        (_, g), = arrows(ball, "grey")
        (_, cg), (_, inside) = arrows(ball, FWD)
        norm = math.hypot(*g)
        assert math.isclose(math.hypot(*cg), max_norm, rel_tol=1e-5)  # on the ball
        assert math.isclose(cg[0] * g[1], cg[1] * g[0], abs_tol=1e-6)  # the same direction
        assert math.hypot(*inside) < max_norm  # inside: left alone
        assert f"  $g$: ‖g‖ = {norm:.2f}" in texts(ball) and f"$c\\,g$, $c$ = {max_norm / norm:.2f}" in texts(ball)
        unclipped, clipped = arrows(up, "#aab7b8"), arrows(up, FWD)
        assert len(unclipped) == len(clipped) == 2
        for (_, a), (_, b) in zip(unclipped, clipped):
            assert a == pytest.approx(b, abs=1e-6)  # AdamW: c cancels
        lengths = [math.hypot(*end) for _, end in clipped]
        assert lengths[1] > lengths[0]  # the learning rate sets the step


def test_continual_pretraining_shows_gain_drift_resume_and_the_rules_bounds():
    ax = diagrams_loop.continual_flow().axes[0]
    labels = texts(ax)
    for name in ("domain", "holdout"):
        for at in ("0", "N"):
            assert f"$L_\\mathrm{{{name}}}({at})$" in labels
    assert any(t.startswith("gain $G = L_\\mathrm{domain}(0) - L_\\mathrm{domain}(N)$") for t in labels)
    assert any(t.startswith("drift $\\Delta = L_\\mathrm{holdout}(N) - L_\\mathrm{holdout}(0)$") for t in labels)
    decision, = (t for t in labels if t.startswith("decision"))
    assert f"{rule.MIN_DOMAIN_GAIN_REL:.0%}" in decision and f"{rule.MAX_HOLDOUT_DRIFT_REL:.0%}" in decision
    state, = (t for t in labels if t.startswith("saved training state"))
    assert all(part in state for part in ("weights", "AdamW", "clock", "RNG", "data position"))
    assert any("bit for bit" in t for t in labels) and any("replay" in t for t in labels)
