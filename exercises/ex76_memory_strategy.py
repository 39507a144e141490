"""Exercises for Part 02 · 76 — choosing a memory strategy.

1. ``pareto_front``: the Pareto-optimal candidates of a set of (peak, step time) points,
   both to be minimized.
2. ``choose_for_budget``: the candidate to run under a memory budget, with headroom for
   the allocator and the CUDA context: the fastest of those that fit (the rule of
   ``bp-mech plan``).

Check your solutions with ``bp-mech check 76`` (or
``pytest tests/test_exercises.py -m ch76 --impl exercises``). The checks compare against
a brute-force dominance test written independently (every pair of points compared), on
random point sets with many ties, and on hand-made sets that hold the classic mistakes:
equal points, a point dominated by one with the same peak or the same time, a candidate
that fits only without the headroom (or without the context), a tie in time.
"""


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names of the Pareto-optimal candidates on the memory–time plane.

    Each candidate is a point ``(peak, time)``: its peak memory (bytes) and its median
    step time (seconds); smaller is better in both. Candidate ``a`` *dominates* ``b``
    when it is at least as good in both and strictly better in one:

        peak_a <= peak_b  and  time_a <= time_b
        and  (peak_a < peak_b  or  time_a < time_b).

    A candidate is Pareto-optimal when no other candidate dominates it. Two candidates
    at the same point do not dominate each other: both are Pareto-optimal (if no third
    one dominates them). A candidate with the same peak as another but a longer time is
    dominated; so is one with the same time but a larger peak.

    Hint: sorted by increasing peak, a candidate is optimal exactly when its time is
    below the smallest time seen so far, or when it repeats the point that holds that
    smallest time. Comparing every pair (O(n^2)) is also correct.

    Args:
        points: ``{name: (peak, time)}``, finite numbers, at least one entry.

    Returns:
        The Pareto-optimal names, ordered by increasing peak; equal peaks by increasing
        time, then by name.
    """
    raise NotImplementedError("ex76: pareto_front")


def choose_for_budget(points: dict[str, tuple[float, float]], budget: float,
                      slack: float, context: float) -> str | None:
    """The candidate to run under a memory budget: the fastest one that fits.

    A peak measured by the allocator (``max_memory_allocated``) is not all a step needs
    on the device. The caching allocator reserves more than it allocates (block
    rounding, fragmentation, the libraries' workspaces): a fraction ``slack`` of the
    peak. The CUDA context sits outside its counters: ``context`` bytes. So a candidate
    *fits* when

        peak * (1 + slack) + context <= budget        (equality fits).

    Among the candidates that fit, return the one with the least time. On a tie in time,
    the smaller peak (the other one is dominated); on a tie in both, the name that sorts
    first. When none fits, return None: never a candidate that does not fit.

    Args:
        points: ``{name: (peak, time)}`` as in ``pareto_front``.
        budget: memory budget, bytes (> 0).
        slack: the allocator's share on top of the peak, ``>= 0`` (0.10: 10 %).
        context: bytes outside the allocator (the CUDA context), ``>= 0``.

    Returns:
        A name from ``points``, or None when no candidate fits.
    """
    raise NotImplementedError("ex76: choose_for_budget")
