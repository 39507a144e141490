"""What a readable figure needs, measured with the renderer's bounding boxes: no two texts (annotations, titles,
legends) on top of each other, and none leaving the figure. Shared by the figure tests."""

import itertools


def boxes(fig):
    """(label, window extent) of every visible text (its box where it has one), title and suptitle, and of each
    legend (of the axes or the figure) as a whole."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    titles = [t for ax in fig.axes for t in (ax.title, ax._left_title, ax._right_title)]
    every = [t for ax in fig.axes for t in ax.texts] + titles + fig.texts + ([fig._suptitle] if fig._suptitle else [])
    for t in {id(t): t for t in every}.values():  # (the suptitle is among the figure's texts too)
        if not t.get_visible() or not t.get_text().strip():
            continue
        patch = t.get_bbox_patch()
        out.append((t.get_text(), (patch if patch is not None else t).get_window_extent(renderer)))
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    out += [(f"legend {i}", lg.get_window_extent(renderer)) for i, lg in enumerate(legends)]
    return out


def overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of texts whose boxes overlap by more than half a pixel both ways."""
    return [(a, b) for (a, ea), (b, eb) in itertools.combinations(boxes(fig), 2)
            if min(ea.x1, eb.x1) - max(ea.x0, eb.x0) > 0.5 and min(ea.y1, eb.y1) - max(ea.y0, eb.y0) > 0.5]


def outside(fig) -> list[str]:
    """The texts (and legends) that reach beyond the figure's edge: cut in the saved image."""
    w, h = fig.canvas.get_width_height()
    return [label for label, e in boxes(fig) if e.x0 < -0.5 or e.y0 < -0.5 or e.x1 > w + 0.5 or e.y1 > h + 0.5]
