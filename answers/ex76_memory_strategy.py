"""Answers for Part 02 · 76: the package's own decision functions are the reference solution.

Read them in ``src/bp_mech/projects/pareto.py`` (``pareto_front``, ``choose_for_budget``);
the chapter shows them folded after their exercises. The variant
(``leanest_within_slowdown``) and the prediction (``predict_checkpoint_plan_peak``) are
written here.
"""

from bp_mech.projects.pareto import choose_for_budget, pareto_front  # noqa: F401


def leanest_within_slowdown(points: dict[str, tuple[float, float]], reference: str,
                            max_slowdown: float) -> str:
    """The limit is a share of the reference's time, t_ref (1 + s). Among the candidates
    at or under it take the least (peak, time, name): least peak, then least time (the
    pick stays on the Pareto set), then the name (the dict's order never decides)."""
    if not max_slowdown >= 0:
        raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
    limit = points[reference][1] * (1 + max_slowdown)  # KeyError: no such reference
    within = [n for n, (_, t) in points.items() if t <= limit]
    return min(within, key=lambda n: (points[n][0], points[n][1], n))


def predict_checkpoint_plan_peak(cfg, batch: int, seq: int) -> int:
    """Under checkpoint-all the layers keep only their inputs; the peak is the largest
    stage of Part 02 · 43's formula ledger, taken with the GPU's AdamW (fused: no
    optimizer temporaries), as the plan traces it."""
    from bp_mech.bench.strategy import parse
    from bp_mech.ledger import theoretical

    return int(theoretical(cfg, batch, seq, parse("checkpoint-all"), "cuda").peak)
