"""Checks of exercises/ex76_memory_strategy.py (never against the answer file).

The reference is a brute-force dominance test written here: every pair of points compared, a
point kept when no other point is at least as good in both coordinates and strictly better in
one. Random point sets are drawn from a few values per coordinate, so that equal peaks, equal
times and equal points are common; hand-made sets hold each classic mistake on its own.
"""

import random

from bp_mech.checks import ex76_contract
from bp_mech.checks.common import call
from bp_mech.checks.ex76_contract import reference_front  # the brute-force reference

GIB = 2**30


def _random_points(rng: random.Random, n: int) -> dict:
    """``n`` points from 4 peaks x 4 times (ties everywhere), names in random order."""
    peaks = [k * 64 * 2**20 for k in rng.sample(range(1, 9), 4)]
    times = [k * 1e-3 for k in rng.sample(range(5, 40), 4)]
    names = [f"c{i}" for i in rng.sample(range(100), n)]
    return {name: (rng.choice(peaks), rng.choice(times)) for name in names}


def _call_front(m, points, case):
    got = call("pareto_front", m.pareto_front, dict(points), at=f"{case} {points}")
    assert isinstance(got, (list, tuple)), (f"pareto_front: returned {got!r}, expected a list of names for {case} "
                                            f"{points}")
    return list(got)


def check_pareto_front__classic_cases(m):
    cases = [  # (what it tests, points, the front)
        ("two equal points (neither dominates the other)", {"b": (1, 1.0), "a": (1, 1.0), "c": (2, 0.5)},
         ["a", "b", "c"]),
        ("the same peak at a longer time (dominated)", {"a": (1, 1.0), "b": (1, 2.0)}, ["a"]),
        ("the same time at a larger peak (dominated)", {"a": (1, 1.0), "b": (2, 1.0)}, ["a"]),
        ("two equal points, both dominated", {"a": (1, 1.0), "b": (2, 2.0), "c": (2, 2.0)}, ["a"]),
        ("one point", {"only": (5, 5.0)}, ["only"]),
        ("a trade-off (both optimal, ordered by peak)", {"fast": (4, 1.0), "lean": (1, 3.0)}, ["lean", "fast"]),
        ("a point better in both (the others dominated)", {"x": (3, 3.0), "best": (1, 1.0), "y": (2, 2.0)}, ["best"]),
    ]
    for what, points, want in cases:
        assert reference_front(points) == want  # the reference agrees with the hand-made answer
        got = _call_front(m, points, what)
        assert got == want, (f"pareto_front: {what}: returned {got}, brute-force dominance gives {want} "
                             f"for points {points}")


def check_pareto_front__random(m):
    rng = random.Random(760)
    for trial in range(300):
        points = _random_points(rng, rng.randint(1, 12))
        want = reference_front(points)
        got = _call_front(m, points, f"random set {trial}")
        if got != want:
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            why = (f"kept dominated {extra}" if extra else "") + ("; " if extra and missing else "") + \
                  (f"dropped optimal {missing}" if missing else "") or "same names, wrong order (by peak, time, name)"
            raise AssertionError(f"pareto_front: {why}: returned {got}, brute-force dominance gives {want} "
                                 f"for points {points}")


def _call_choose(m, points, budget, slack, context, case):
    before = dict(points)
    got = call("choose_for_budget", m.choose_for_budget, points, budget, slack, context,
               at=f"{case} {points}, budget {budget}, slack {slack}, context {context}")
    assert points == before, f"choose_for_budget: {case}: the points were modified"
    return got


def _gib(points) -> dict:
    return {n: (p / GIB, t) for n, (p, t) in points.items()}


def check_choose_for_budget__headroom(m):
    budget, slack, context = 8 * GIB, 0.25, GIB // 2  # fits: peak <= (8 - 0.5) / 1.25 = 6 GiB, exactly representable
    cases = [  # (what it tests, points, the pick)
        ("a peak that fits only without the headroom", {"fast": (7.5 * GIB, 1.0), "slow": (5 * GIB, 2.0)}, "slow"),
        ("a peak that fits only without the context", {"fast": (6.2 * GIB, 1.0), "slow": (5 * GIB, 2.0)}, "slow"),
        ("a peak exactly at (budget - context) / (1 + slack) fits", {"edge": (6 * GIB, 1.5), "slow": (5 * GIB, 2.0)},
         "edge"),
        ("the slack is a share of the peak, not of the budget (peak <= budget*(1-slack) - context is too strict)",
         {"mid": (5.8 * GIB, 0.9), "slow": (5 * GIB, 2.0)}, "mid"),
        ("the least time among those that fit, not the least peak", {"lean": (2 * GIB, 3.0), "ok": (5 * GIB, 1.0)},
         "ok"),
        ("nothing fits: None, not the smallest peak", {"a": (6.5 * GIB, 1.0), "b": (9 * GIB, 0.5)}, None),
    ]
    for what, points, want in cases:
        got = _call_choose(m, points, budget, slack, context, what)
        assert got == want, (f"choose_for_budget: {what}: returned {got!r}, want {want!r} (budget 8 GiB, slack "
                             f"{slack}, context 0.5 GiB: peaks up to 6 GiB fit) for {_gib(points)} (GiB, s)")
    got = _call_choose(m, {"full": (8 * GIB, 1.0)}, 8 * GIB, 0.0, 0, "no headroom")
    assert got == "full", (f"choose_for_budget: with slack 0 and context 0 a peak equal to the budget fits, "
                           f"returned {got!r}")


def check_choose_for_budget__ties(m):
    budget, slack, context = 16 * GIB, 0.25, GIB
    cases = [
        ("a tie in time goes to the smaller peak (the other is dominated)",
         {"big": (10 * GIB, 1.0), "small": (4 * GIB, 1.0), "slow": (2 * GIB, 3.0)}, "small"),
        ("a tie in time and peak goes to the name that sorts first", {"zeta": (4 * GIB, 1.0), "alpha": (4 * GIB, 1.0)},
         "alpha"),
        ("a faster point that does not fit does not take the tie", {"x": (12.5 * GIB, 1.0), "y": (11 * GIB, 1.0)}, "y"),
    ]
    for what, points, want in cases:
        got = _call_choose(m, points, budget, slack, context, what)
        assert got == want, (f"choose_for_budget: {what}: returned {got!r}, want {want!r} for {_gib(points)} (GiB, s), "
                             f"budget 16 GiB, slack {slack}, context 1 GiB")


def check_choose_for_budget__random(m):
    rng = random.Random(761)
    for trial in range(300):
        points = _random_points(rng, rng.randint(1, 10))
        slack, context = rng.choice([0.0, 0.05, 0.1, 0.25]), rng.choice([0, 16, 64]) * 2**20
        budget = rng.choice([128, 256, 320, 448, 600, 700]) * 2**20
        limit = (budget - context) / (1 + slack)  # the largest peak that fits
        if any(abs(p - limit) <= 1e-9 * budget for p, _ in points.values()):
            continue  # exact boundaries are checked by hand (check_choose_for_budget__headroom)
        fitting = {n: p for n, p in points.items() if p[0] < limit}
        front = reference_front(fitting)  # the pick is the fastest point of the fitting set's front
        want = min(front, key=lambda n: (fitting[n][1], n)) if front else None
        got = _call_choose(m, points, budget, slack, context, f"random set {trial}")
        assert got == want, (f"choose_for_budget: returned {got!r}, want {want!r} (the fastest fitting point on the "
                             f"brute-force front {front}) for {points}, budget {budget}, slack {slack}, "
                             f"context {context}")


CHECKS = [check_pareto_front__classic_cases, check_pareto_front__random, check_choose_for_budget__headroom,
          check_choose_for_budget__ties, check_choose_for_budget__random, *ex76_contract.CHECKS]
