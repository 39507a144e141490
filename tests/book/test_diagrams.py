"""``book.diagrams``: each opening picture draws what its chapter is about (the saved tensors by name, the
kept and rebuilt activations, the copies both ways, the ranks and their all-reduce), and no two of its
texts overlap or leave the figure, measured with the renderer's bounding boxes."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from bp_mech.book import diagrams  # noqa: E402
from book.layout import outside, overlaps  # noqa: E402

PICTURES = {"mlp_graph": (), "attention_graph": (), "checkpoint_stack": (4,), "offload_timeline": (4,),
            "data_parallel": ()}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.legends[0].texts]


def saved(fig) -> set[str]:
    """The tensor labels drawn highlighted (bold, on the saved colour)."""
    return {t.get_text() for t in fig.axes[0].texts
            if t.get_bbox_patch() is not None and t.get_bbox_patch().get_facecolor()[:3]
            == matplotlib.colors.to_rgb(diagrams.SAVED)}


@pytest.mark.parametrize("name", PICTURES)
def test_no_text_overlaps_another_or_leaves_the_figure(name):
    fig = getattr(diagrams, name)(*PICTURES[name])
    assert overlaps(fig) == [] and outside(fig) == []


def test_the_overlap_check_sees_two_texts_on_top_of_each_other():
    fig = diagrams.data_parallel()
    fig.axes[0].text(4.5, 1.75, "a label dropped on the all-reduce", ha="center")
    assert ("a label dropped on the all-reduce" in {x for pair in overlaps(fig) for x in pair})


def test_the_mlp_highlights_what_its_backward_reads_and_not_its_output():
    fig = diagrams.mlp_graph()
    assert saved(fig) == {"$x$", "$g$", "$a$", "$u$", "$h$"}
    assert "$y$" in texts(fig)
    assert {"SiLU", r"$\odot$"} <= set(texts(fig))
    colors = {matplotlib.colors.to_hex(p.get_edgecolor()) for p in fig.axes[0].patches
              if isinstance(p, matplotlib.patches.FancyArrowPatch)}
    assert colors == {diagrams.FWD.lower(), diagrams.BWD.lower()}  # forward and backward, two colours


def test_attention_saves_the_square_probabilities_but_not_the_scores_nor_the_unrotated_q_and_k():
    fig = diagrams.attention_graph()
    assert saved(fig) == {"$x$", r"$\tilde q$", r"$\tilde k$", r"$P$ ($T\times T$)", "$v$", "$O$"}
    assert {"$S$", "$q$", "$k$"} <= set(texts(fig)) and "softmax" in texts(fig)


@pytest.mark.parametrize("layers", [3, 5])
def test_checkpointing_keeps_only_the_inputs_and_rebuilds_the_rest(layers):
    fig = diagrams.checkpoint_stack(layers)
    plain, ckpt = fig.axes
    for ax in (plain, ckpt):
        assert [t.get_text() for t in ax.texts if t.get_text().startswith("$h_")] == \
            [f"$h_{i}$" for i in range(layers + 1)]
    assert [t.get_text() for t in plain.texts].count("activations") == layers
    assert [t.get_text() for t in ckpt.texts].count("recomputed") == layers
    assert "activations" not in [t.get_text() for t in ckpt.texts]


def test_offload_copies_each_layers_tensors_out_in_forward_and_back_in_reverse_order():
    fig = diagrams.offload_timeline(3)
    names = [t.get_text() for t in fig.axes[0].texts]
    assert [n for n in names if n.startswith(("fwd", "bwd", "loss"))] == \
        ["fwd 1", "fwd 2", "fwd 3", "loss", "bwd 3", "bwd 2", "bwd 1"]
    arrows = [p for p in fig.axes[0].patches if isinstance(p, matplotlib.patches.FancyArrowPatch)]
    by_colour = {c: sum(matplotlib.colors.to_hex(p.get_edgecolor()) == c.lower() for p in arrows)
                 for c in (diagrams.D2H, diagrams.H2D)}
    assert by_colour == {diagrams.D2H: 3, diagrams.H2D: 3}
    legend = texts(fig)
    assert any("device → host" in t for t in legend) and any("host → device" in t for t in legend)


def test_every_rank_has_a_copy_a_gradient_and_the_same_update_around_one_all_reduce():
    fig = diagrams.data_parallel()
    names = texts(fig)
    assert [n for n in names if n.startswith("rank")] == ["rank $0$", "rank $1$", "rank $P-1$"]
    for part in ("model copy", "local gradient", r"update $\theta", "rows of each"):
        assert sum(part in n for n in names) == 3, part
    assert sum("all-reduce" in n for n in names) == 1
