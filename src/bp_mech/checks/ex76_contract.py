"""Checks of exercises/ex76_memory_strategy.py, part two: the whole contract on drawn point sets, and the two
new exercises (never against the answer file).

Point sets are drawn by hypothesis (``properties.explore``) from a few peaks (ints and floats) and times, with
short names, so that equal peaks, equal times and equal points are common, and the empty set is among them.
Every property is judged by brute force (``_dominated``: every pair compared): no returned point is
dominated, every point left out is, the order, the exact types, ``points`` untouched, the empty set, and bad
input raising (not swallowed). The prediction is measured by ``bp-mech plan``'s own tracer.
"""

from __future__ import annotations

import copy
import functools
import math

from hypothesis import strategies as st

from bp_mech.checks.common import call
from bp_mech.checks.ex43_contract import predicted_within
from bp_mech.checks.properties import assert_json, assert_raises, assert_type, explore

EXAMPLES = 40  # brute force on a few points is cheap: more cases, more ties
PEAKS = st.one_of(st.integers(1, 4), st.sampled_from([1.0, 2.5, 4.0]))
TIMES = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])
POINTS = st.dictionaries(st.text("abcxyz", min_size=1, max_size=2), st.tuples(PEAKS, TIMES), max_size=7)
PREDICT_TOL = 0.01  # the formula and the trace count the same storages (a few 4-byte scalars apart)
PREDICT_CASE = ((40, 5, 1, 96, 200, 3, False), 3, 20)  # hidden, heads, kv, intermediate, vocab, layers, tied; B; T


def call_unmodified_points(fn: str, f, points: dict, *args, at: str):
    """``f(points, *args)``; fails when ``points`` changed (a name removed or added, a point rewritten)."""
    before = copy.deepcopy(points)
    out = call(fn, f, points, *args, at=at)
    if points != before:
        gone, new = sorted(set(before) - set(points)), sorted(set(points) - set(before))
        what = (f"removed {gone}" if gone else "") + (f"added {new}" if new else "") or "rewrote its points"
        raise AssertionError(f"{fn}: points was modified in place ({what}) at {at}")
    return out


_raises = assert_raises  # properties.assert_raises


def _dominated(p, points) -> bool:
    """Is point ``p`` dominated by any point of ``points`` (brute force)?"""
    return any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)


def reference_front(points: dict) -> list:
    """Reference: the undominated names, ordered by (peak, time, name).

    Args:
        points: name -> (peak, time).

    Returns:
        The names no other point dominates, in that order.
    """
    kept = [n for n, p in points.items() if not _dominated(p, points.values())]
    return sorted(kept, key=lambda n: (points[n][0], points[n][1], n))


# --- pareto_front --------------------------------------------------------------------------


def check_pareto_front__contract(m):
    def body(points):
        at = f"points {points}"
        got = call_unmodified_points("pareto_front", m.pareto_front, points, at=at)
        assert_type("pareto_front", "the front", got, list, at)
        for name in got:
            if type(name) is not str or name not in points:
                raise AssertionError(f"pareto_front: returned {name!r}, not a name of points (a str key) at {at}")
        if len(set(got)) != len(got):
            raise AssertionError(f"pareto_front: returned a name twice ({got}) at {at}")
        assert_json("pareto_front", "the front", got, at)
        for name in got:
            if _dominated(points[name], points.values()):
                by = next(n for n, q in points.items() if _dominated(points[name], [q]))
                raise AssertionError(f"pareto_front: kept {name!r} {points[name]}, which {by!r} {points[by]} "
                                     f"dominates, at {at}")
        for name in sorted(set(points) - set(got)):
            if not _dominated(points[name], points.values()):
                raise AssertionError(f"pareto_front: dropped {name!r} {points[name]}, which nothing dominates, "
                                     f"at {at}")
        if got != reference_front(points):
            raise AssertionError(f"pareto_front: returned {got}, not ordered by (peak, time, name): "
                                 f"{reference_front(points)} at {at}")

    explore(POINTS, body, examples=EXAMPLES)


def check_pareto_front__bad_input(m):
    def body(case):
        points, bad, which = case
        name = min(points)
        points = {**points, name: (bad, points[name][1]) if which == "peak" else (points[name][0], bad)}
        what = f"a {which} of {bad} (candidate {name!r})"
        _raises("pareto_front", m.pareto_front, (points,), ValueError, what, f"points {points}")

    nonempty = st.dictionaries(st.sampled_from("abcd"), st.tuples(PEAKS, TIMES), min_size=1, max_size=4)
    explore(st.tuples(nonempty, st.sampled_from([math.nan, math.inf, -math.inf]), st.sampled_from(["peak", "time"])),
            body)


# --- choose_for_budget ------------------------------------------------------------------------


def check_choose_for_budget__contract(m):
    def body(case):
        points, budget, slack, context = case
        at = f"points {points}, budget {budget}, slack {slack}, context {context}"
        got = call_unmodified_points("choose_for_budget", m.choose_for_budget, points, budget, slack, context,
                                     at=at)
        limit = (budget - context) / (1 + slack)
        if any(abs(p - limit) <= 1e-9 * budget for p, _ in points.values()):
            return  # an exact boundary: float rounding may go either way (checked by hand with exact numbers)
        fitting = {n: p for n, p in points.items() if p[0] < limit}
        want = min(fitting, key=lambda n: (fitting[n][1], fitting[n][0], n)) if fitting else None
        if got is not None:
            assert_type("choose_for_budget", "the pick", got, str, at)
        if got == want:
            return
        if got is not None and got not in fitting:
            raise AssertionError(f"choose_for_budget: picked {got!r} {points.get(got)}, which needs more than the "
                                 f"budget (peaks up to {limit:g} fit) at {at}")
        raise AssertionError(f"choose_for_budget: returned {got!r}, the least (time, peak, name) among the fitting "
                             f"{sorted(fitting)} is {want!r} at {at}")

    explore(st.tuples(POINTS, st.sampled_from([2, 3, 4.5, 6]), st.sampled_from([0.0, 0.1, 0.5]),
                      st.sampled_from([0, 0.5, 1])), body, examples=EXAMPLES)


def check_choose_for_budget__bad_input(m):
    def body(case):
        points, slack, context = case
        what = f"slack {slack}, context {context}"
        _raises("choose_for_budget", m.choose_for_budget, (points, 100.0, slack, context), ValueError, what,
                f"points {points}, budget 100")

    nonempty = st.dictionaries(st.sampled_from("abcd"), st.tuples(PEAKS, TIMES), min_size=1, max_size=4)
    explore(st.tuples(nonempty, st.sampled_from([-0.1, -1.0, 0.0, 0.1]), st.sampled_from([0, -1, -0.5])).filter(
        lambda c: c[1] < 0 or c[2] < 0), body)


# --- Exercise 76.3 (variant): the leanest within a slowdown ------------------------------------


def _leanest(points, reference, s):
    """Reference: every candidate tested against the limit, the least (peak, time, name) kept."""
    limit = points[reference][1] * (1 + s)
    return min((n for n, p in points.items() if p[1] <= limit), key=lambda n: (points[n][0], points[n][1], n))


def check_leanest_within_slowdown(m):
    cases = [  # (what it tests, points, max_slowdown, the pick); the reference is "plain"
        ("a time exactly at the limit qualifies (2.0 x 1.3 = 2.6)",
         {"plain": (10, 2.0), "ckpt": (6, 2.6), "fp16": (8, 2.0)}, 0.3, "ckpt"),
        ("a tie in peak goes to the smaller time", {"plain": (10, 2.0), "a": (6, 2.5), "b": (6, 2.2)}, 0.3, "b"),
        ("the least peak among those within, not the least time",
         {"plain": (10, 2.0), "fast": (8, 1.5), "lean": (3, 3.5)}, 1.0, "lean"),
        ("the slowdown is a share of the reference's time, not seconds (4.0 + 0.3 s would pick mid)",
         {"plain": (10, 4.0), "ckpt": (6, 5.0), "mid": (8, 4.2)}, 0.3, "ckpt"),
        ("a tie in both goes to the name that sorts first",
         {"plain": (10, 2.0), "zeta": (6, 2.2), "alpha": (6, 2.2)}, 0.5, "alpha"),
        ("a slowdown of 0 keeps the reference's time only", {"plain": (10, 2.0), "fp16": (8, 2.0), "ckpt": (6, 2.1)},
         0.0, "fp16"),
        ("nothing else within: the reference itself", {"plain": (4, 1.0), "lean": (2, 1.5)}, 0.4, "plain"),
    ]
    for what, points, s, want in cases:
        at = f"{what}: points {points}, reference 'plain', max_slowdown {s}"
        got = call_unmodified_points("leanest_within_slowdown", m.leanest_within_slowdown, points, "plain", s, at=at)
        assert got == want, f"leanest_within_slowdown: returned {got!r}, want {want!r} for {at}"


def check_leanest_within_slowdown__contract(m):
    def body(case):
        points, s = case
        ref = min(points)
        at = f"points {points}, reference {ref!r}, max_slowdown {s}"
        got = call_unmodified_points("leanest_within_slowdown", m.leanest_within_slowdown, points, ref, s, at=at)
        assert_type("leanest_within_slowdown", "the pick", got, str, at)
        want = _leanest(points, ref, s)
        assert got == want, (f"leanest_within_slowdown: returned {got!r} {points.get(got)}, the least (peak, time, "
                             f"name) within {points[ref][1] * (1 + s):g} s is {want!r} {points[want]} at {at}")
        _raises("leanest_within_slowdown", m.leanest_within_slowdown, (points, "no-such-name", s), KeyError,
                "a reference not in points", at)
        _raises("leanest_within_slowdown", m.leanest_within_slowdown, (points, ref, -s - 0.1), ValueError,
                f"max_slowdown {-s - 0.1:g}", at)

    nonempty = st.dictionaries(st.text("abcxyz", min_size=1, max_size=2), st.tuples(PEAKS, TIMES), min_size=1,
                               max_size=7)
    explore(st.tuples(nonempty, st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])), body, examples=EXAMPLES)


# --- Exercise 76.4 (predict, then measure) -------------------------------------------------------


@functools.cache
def measure_checkpoint_plan_peak(shape, batch: int, seq: int) -> int:
    """The peak ``bp-mech plan`` traces for checkpoint-all: its own session (fake tensors, the GPU's options)."""
    from bp_mech.bench.optimizer import StepOptions
    from bp_mech.bench.strategy import parse
    from bp_mech.checks import ex43_measure as ex43
    from bp_mech.planner import plan as planner

    sess = planner.session(ex43.shape_config(shape), batch, seq, StepOptions().for_device("cuda"))
    return sess.ledger(parse("checkpoint-all")).peak


def check_predict_checkpoint_plan_peak(m):
    shape, B, T = PREDICT_CASE
    predicted_within("predict_checkpoint_plan_peak", m.predict_checkpoint_plan_peak, shape, B, T,
                     lambda: measure_checkpoint_plan_peak(shape, B, T), PREDICT_TOL, "bp-mech plan traces {want}")


CHECKS = [check_pareto_front__contract, check_pareto_front__bad_input, check_choose_for_budget__contract,
          check_choose_for_budget__bad_input, check_leanest_within_slowdown, check_leanest_within_slowdown__contract,
          check_predict_checkpoint_plan_peak]
