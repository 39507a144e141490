"""Exercises for Part 02 · 76 — choosing a memory strategy.

1. ``pareto_front``: the Pareto-optimal candidates of a set of (peak, step time) points,
   both to be minimized.
2. ``choose_for_budget``: the candidate to run under a memory budget, with headroom for
   the allocator and the CUDA context: the fastest of those that fit (the rule of
   ``bp-mech plan``).
3. ``leanest_within_slowdown`` (variant): the other way round, the leanest candidate
   whose time stays within a slowdown of a reference's.
4. ``predict_checkpoint_plan_peak`` (predict, then measure): the peak ``bp-mech plan``
   traces for checkpoint-all at a config the chapter did not show.

Check your solutions with ``bp-mech check 76`` (or
``pytest tests/test_exercises.py -m ch76 --impl exercises``). The checks compare against
a brute-force dominance test written independently (every pair of points compared), on
random point sets with many ties, and on hand-made sets that hold the classic mistakes:
equal points, a point dominated by one with the same peak or the same time, a candidate
that fits only without the headroom (or without the context), a tie in time. They also
hold the whole contract, on point sets drawn by hypothesis: ``points`` is not modified,
the result has exactly the documented type, empty and bad inputs behave as documented
(the exception raised, not swallowed).
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
        points: ``{name: (peak, time)}``, int or float, names are str.

    Returns:
        A new ``list`` (exactly a list: a record stores it as JSON) of the
        Pareto-optimal names, each once, ordered by increasing peak; equal peaks by
        increasing time, then by name. ``[]`` for no points. ``points`` is left as it
        was.

    Raises:
        ValueError: a peak or time is NaN or infinite (nothing is dominated by NaN: a
            silent answer would be wrong). Let it propagate.
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
        Exactly a ``str``, a name from ``points``, or None when no candidate fits (and
        for no points). ``points`` is left as it was.

    Raises:
        ValueError: ``slack < 0`` or ``context < 0`` (when there is a candidate to
            test): a negative headroom would let a candidate that does not fit pass.
    """
    raise NotImplementedError("ex76: choose_for_budget")


def leanest_within_slowdown(points: dict[str, tuple[float, float]], reference: str,
                            max_slowdown: float) -> str:
    """The leanest candidate whose step time stays within a slowdown of a reference's.

    ``choose_for_budget`` fixes the memory and minimizes the time; a team that can
    afford, say, 30 % more time than the plain step asks the other question: how much
    memory can I free for that price? A candidate *qualifies* when

        time <= time[reference] * (1 + max_slowdown)        (equality qualifies).

    Among the qualifying candidates, return the one with the least peak; on a tie in
    peak, the smaller time (the other one is dominated); on a tie in both, the name
    that sorts first. The reference itself always qualifies, so there is always an
    answer, and it is on the Pareto set (``pareto_front``).

    Args:
        points: ``{name: (peak, time)}`` as in ``pareto_front``.
        reference: the name of the candidate the slowdown is measured against (plain).
        max_slowdown: the extra time allowed, a share of the reference's (0.3: 30 %),
            ``>= 0``.

    Returns:
        Exactly a ``str``, a name from ``points``. ``points`` is left as it was.

    Raises:
        KeyError: ``reference`` is not in ``points``.
        ValueError: ``max_slowdown < 0``.
    """
    raise NotImplementedError("ex76: leanest_within_slowdown")


def predict_checkpoint_plan_peak(cfg, batch: int, seq: int) -> int:
    """Predict the peak ``bp-mech plan`` traces for checkpoint-all (predict, measure).

    ``bp-mech plan`` traces one steady-state training step under fake tensors with the
    GPU's settings (fused AdamW: no temporaries in the optimizer step). Predict its
    peak for the strategy checkpoint-all without tracing, with the formula ledger of
    Part 02 · 43 (which moment of the step is the peak depends on the config; find out
    which one it is here, and why).

    The check traces the step at a config the chapter did not show and accepts the
    prediction within 1 % of the traced peak: the formula and the trace count the same
    storages and differ by a few 4-byte scalars, while plain's peak, the CPU's AdamW
    (foreach, a temporary per tensor) or the model state alone (4 W) all miss by more
    than 5 % there.

    Args:
        cfg: a Qwen2Config.
        batch: B.
        seq: T.

    Returns:
        The predicted peak in bytes, exactly an ``int``; ``cfg`` is left as it was.
    """
    raise NotImplementedError("ex76: predict_checkpoint_plan_peak")
