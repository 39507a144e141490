"""``book.diagrams_step``: the opening pictures of Part 02 · 43 and projects 74 and 76 show what their chapters are
about (the bytes of one parameter and the ledger's lines over one step; the three questions of a diagnosis and a
peak that moves; the strategies as levers on the ledger's lines and the fastest candidate that fits), each number
and height as the package computes it, and no two of their texts overlap or leave the figure."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from book.layout import outside, overlaps  # noqa: E402
from bp_mech import ledger  # noqa: E402
from bp_mech.book import diagrams_step  # noqa: E402
from bp_mech.instruments.workload import ARCHITECTURES, parse_workload  # noqa: E402
from bp_mech.projects import diagnosis, pareto  # noqa: E402
from bp_mech.state_bytes import adam_state_bytes, grad_bytes, param_bytes  # noqa: E402

PICTURES = ("ledger_step", "diagnosis_questions", "memory_levers")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for lg in fig.legends
                                                                  for t in lg.texts]


def by_gid(fig, prefix: str) -> dict:
    """The patches (and lines) whose gid starts with ``prefix``, by gid."""
    ax = fig.axes[0]
    return {a.get_gid(): a for a in [*ax.patches, *ax.lines] if (a.get_gid() or "").startswith(prefix)}


@pytest.mark.parametrize("name", PICTURES)
def test_no_text_overlaps_another_or_leaves_the_figure(name):
    fig = getattr(diagrams_step, name)()
    assert overlaps(fig) == [] and outside(fig) == []


@pytest.mark.parametrize("arch", ["tiny", "qwen05"])
def test_one_parameter_costs_what_the_package_counts(arch):
    a = ARCHITECTURES[arch]
    n = param_bytes(a, 1)
    per = diagrams_step.bytes_per_parameter(arch)
    assert per["weight"] * n == param_bytes(a) and per["gradient"] * n == grad_bytes(a)
    assert (per["moment m"] + per["moment v"]) * n == adam_state_bytes(a)
    fig = diagrams_step.ledger_step()
    names = texts(fig)
    assert f"= {sum(per.values())} bytes" in names
    assert all(f"{k}\n{v} B" in names for k, v in per.items())
    cells = by_gid(fig, "param/")
    assert sorted(cells) == sorted(f"param/{k}" for k in per)
    heights = {k.split("/")[1]: c.get_height() for k, c in cells.items()}
    assert heights["moment m"] + heights["moment v"] == pytest.approx(2 * heights["weight"])


def test_the_step_s_bars_are_the_formula_s_lines_activations_before_the_gradients():
    fig = diagrams_step.ledger_step("qwen05-b2s512")
    w = parse_workload("qwen05-b2s512")
    led = ledger.theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, None, "cuda")
    bars = {}
    for gid, p in by_gid(fig, "").items():
        i, _, cls = (gid or "").partition("/")
        if i.isdigit():
            bars.setdefault(int(i), {})[cls] = p.get_height()
    stages = [s for s, _ in diagrams_step.INSTANTS]
    assert len(bars) == len(stages) == 6
    scale = bars[1]["parameters"] / led.stages["forward"]["parameters"]
    for i, stage in enumerate(stages):  # every drawn line is the formula's, to scale; every line drawn
        assert {c: h / scale for c, h in bars[i].items()} == pytest.approx(
            {c: v for c, v in led.stages[stage].items() if v > 0}, rel=1e-9)
    has = {i: set(b) for i, b in bars.items()}
    assert "saved_activations" in has[1] and "saved_activations" in has[2]  # forward saves, backward's peak
    assert "gradients" not in has[2] and "saved_activations" not in has[3]  # freed as the gradients appear
    assert "gradients" in has[3] and "gradients" not in has[5]  # zero_grad frees them
    assert bars[0] == bars[5]  # a steady-state step ends where it started
    peak = max(range(6), key=lambda i: sum(bars[i].values()))
    assert stages[peak] == led.peak_stage == "backward_peak"
    assert "the peak:\none moment" in texts(fig)


def test_the_diagnosis_asks_three_questions_and_its_peak_moves():
    fig = diagrams_step.diagnosis_questions()
    names = texts(fig)
    assert [t for t in names if t.endswith("?")] == ["What dominates the peak?", "Where does the time go?",
                                                     "What would each remedy save?"]
    assert {"forward", "backward", "optimizer", "zero_grad"} <= set(names)
    assert any("hot-spot list" in t and "not a critical path" in t for t in names)
    toy = diagrams_step.TOY
    change = {"backward_peak": {"logits_loss": -toy["backward_peak"]["logits_loss"]}}
    naive, predicted = by_gid(fig, "naive")["naive"], by_gid(fig, "predicted")["predicted"]
    ratio = predicted.get_height() / naive.get_height()
    assert ratio == pytest.approx(diagnosis.predicted_saving(toy, change) / toy["backward_peak"]["logits_loss"])
    assert ratio < 1  # the peak moved to the forward: the saving is the gap, not the line
    assert sum("/logits_loss" in g for g in by_gid(fig, "toy/")) == 2


def test_the_diagnosis_brackets_follow_another_ledger():
    toy = {"forward": dict(parameters=1, optimizer_states=2, saved_activations=1, logits_loss=1),
           "backward_peak": dict(parameters=1, optimizer_states=2, saved_activations=2, logits_loss=3)}
    fig = diagrams_step.diagnosis_questions(toy)  # the peak stays: the naive saving is the saving
    assert by_gid(fig, "predicted")["predicted"].get_height() == pytest.approx(
        by_gid(fig, "naive")["naive"].get_height())


def test_each_lever_acts_on_the_line_its_strategy_removes_and_only_sharding_on_the_state():
    fig = diagrams_step.memory_levers()
    levers = {tuple(g.split("/")[1:]) for g in by_gid(fig, "lever/")}
    assert levers == {("chunked loss", "logits_loss"), ("accumulation, k micro-batches", "logits_loss"),
                      ("accumulation, k micro-batches", "saved_activations"),
                      ("checkpointing", "saved_activations"), ("offload", "saved_activations"),
                      ("fp16 autocast", "saved_activations"), ("sharding (FSDP2, ZeRO)", "state")}
    assert set(by_gid(fig, "line/")) == {f"line/{c}" for c in ("parameters", "gradients", "optimizer_states",
                                                              "saved_activations", "logits_loss")}
    per = sum(diagrams_step.bytes_per_parameter().values())
    assert any(t.startswith(f"the model's state: {per} bytes") for t in texts(fig))


@pytest.mark.parametrize("budget", [0.45, 0.7, 0.9])
def test_the_pick_is_the_fastest_candidate_under_the_budget_and_on_the_pareto_set(budget):
    fig = diagrams_step.memory_levers(budget)
    pts = diagrams_step.RULE_POINTS
    (ring,) = by_gid(fig, "pick/")
    pick = ring.split("/")[1]
    fits = [n for n, (p, _) in pts.items() if p <= budget]
    assert pick == min(fits, key=lambda n: pts[n][1]) and pick in pareto.pareto_front(pts)
    filled = {g.split("/")[1] for g, m in by_gid(fig, "point/").items() if m.get_markerfacecolor() != "white"}
    assert filled == set(pareto.pareto_front(pts))
    assert by_gid(fig, "fits")["fits"].get_height() == pytest.approx(budget * 6.0)
