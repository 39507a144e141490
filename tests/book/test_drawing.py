"""``book.drawing``: the primitives every opening picture is drawn with. A canvas has no axes and the limits
asked for; a box is centred where asked with its text on it; an arrow runs from its first point to its
second; an edge leaves a box on its border, toward the other end; a graph draws one forward and one
backward arrow per edge and highlights exactly the tensors marked saved."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from bp_mech.book import drawing  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_a_canvas_has_no_axes_and_the_limits_asked_for():
    fig, axes = drawing.canvas(4, 3, (-1, 5), (0, 2), rows=2)
    assert len(axes) == 2 and all(not ax.axison for ax in axes)
    assert all(ax.get_xlim() == (-1, 5) and ax.get_ylim() == (0, 2) for ax in axes)
    assert tuple(fig.get_size_inches()) == (4, 3)


def test_a_box_is_centred_where_asked_with_its_text():
    fig, (ax,) = drawing.canvas(4, 3, (0, 10), (0, 10))
    text = drawing.box(ax, 3, 4, 2, "gate", h=1)
    (patch,) = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    assert (patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()) == (2, 3.5, 2, 1)
    assert text.get_text() == "gate" and text.get_position() == (3, 4)
    assert (text.get_ha(), text.get_va()) == ("center", "center")


def test_an_arrow_runs_from_its_first_point_to_its_second():
    fig, (ax,) = drawing.canvas(4, 3, (0, 10), (0, 10))
    drawing.arrow(ax, (1, 2), (7, 5), drawing.BWD)
    (a,) = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert a._posA_posB == [(1, 2), (7, 5)]
    assert matplotlib.colors.to_hex(a.get_edgecolor()) == drawing.BWD.lower()


COORD = st.integers(-10_000, 10_000).map(lambda i: i / 1000)  # a drawing's coordinates: data units, to a thousandth


@given(COORD, COORD, st.integers(200, 3000).map(lambda i: i / 1000), COORD, COORD)
def test_an_edge_leaves_its_box_on_the_border_toward_the_other_end(x, y, w, tx, ty):
    px, py = drawing.edge_point((x, y, "", w), (tx, ty))
    if (tx, ty) == (x, y):
        assert (px, py) == (x, y)
        return
    on_side = abs(abs(px - x) - w / 2) < 1e-9 and abs(py - y) <= drawing.BOX_H / 2 + 1e-9
    on_top = abs(abs(py - y) - drawing.BOX_H / 2) < 1e-9 and abs(px - x) <= w / 2 + 1e-9
    assert on_side or on_top
    # on the segment from the centre toward the target: the same direction
    assert (px - x) * (ty - y) == pytest.approx((py - y) * (tx - x), abs=1e-9)
    assert (px - x) * (tx - x) >= -1e-12 and (py - y) * (ty - y) >= -1e-12


def test_a_point_node_is_left_at_its_centre():
    assert drawing.edge_point((1.5, -2, "", 0), (9, 9)) == (1.5, -2)


def test_a_graph_doubles_every_edge_and_highlights_only_the_saved_tensors():
    nodes = {"in": (0, 0, "", 0), "op": (3, 0, "op", 1.5), "out": (6, 0, "", 0)}
    fig = drawing.graph("g", nodes, [("in", "op", "$x$", True), ("op", "out", "$y$", False)], (-1, 7), (-1, 1))
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    colours = [matplotlib.colors.to_hex(p.get_edgecolor()) for p in arrows]
    assert colours.count(drawing.FWD.lower()) == 2 and colours.count(drawing.BWD.lower()) == 2
    labels = {t.get_text(): t for t in ax.texts}
    assert labels["$x$"].get_fontweight() == "bold" and labels["$y$"].get_fontweight() == "normal"
    assert matplotlib.colors.to_hex(labels["$x$"].get_bbox_patch().get_facecolor()) == drawing.SAVED.lower()
    assert "op" in labels and ax.get_title() == "g"
