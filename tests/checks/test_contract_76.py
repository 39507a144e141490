"""Part 02 · 76: every property the checks hold (``checks/ex76.py``'s declarations, derived by ``checks.engine``)
rejects a solution that breaks exactly it, and the variant's and the prediction's checks reject the classic mistakes."""

import math

import numpy as np
import pytest
from conftest import mutant

from bp_mech import ledger, state_bytes
from bp_mech.bench.strategy import parse
from bp_mech.checks import ex76
from bp_mech.projects.pareto import choose_for_budget, pareto_front

EX = "ex76_memory_strategy"
ANS = mutant(EX)
ANSWER_LEANEST = ANS.leanest_within_slowdown


def _bad(**over):
    return mutant(EX, **over)


def _key(points):
    return lambda n: (points[n][0], points[n][1], n)


# --- pareto_front ----------------------------------------------------------------------------

def _front_prunes_input(points):  # removes the dominated names from the caller's dict
    front = pareto_front(points)
    for n in [n for n in points if n not in front]:
        del points[n]
    return front


def _front_tuple(points):
    return tuple(pareto_front(points))


def _front_twice(points):  # equal points appended once per name that holds them, and once more
    front = pareto_front(points)
    return front + [n for n in front if sum(points[m] == points[n] for m in front) > 1][:1]


def _front_strict_both(points):  # "dominates" needs < in both: keeps an equal-peak, longer-time point
    kept = [n for n, p in points.items() if not any(q[0] < p[0] and q[1] < p[1] for q in points.values())]
    return sorted(kept, key=_key(points))


def _front_no_equal(points):  # equal points remove each other
    kept = [n for n, p in points.items()
            if not any(q[0] <= p[0] and q[1] <= p[1] for m, q in points.items() if m != n)]
    return sorted(kept, key=_key(points))


def _front_unordered(points):
    front = set(pareto_front(points))
    return [n for n in points if n in front]


def _front_empty_raises(points):  # the least time first: min() of nothing
    min(t for _, t in points.values())
    return pareto_front(points)


def _front_unchecked(points):  # the sweep without the finiteness test
    front, best = [], None
    for n in sorted(points, key=_key(points)):
        if best is None or points[n][1] < best[1] or points[n] == best:
            front.append(n)
            best = points[n]
    return front


def _front_swallows(points):
    try:
        return pareto_front(points)
    except ValueError:
        return []


@pytest.mark.parametrize("check, f, message", [
    (ex76.check_pareto_front, _front_prunes_input, r"points was modified in place \(removed"),
    (ex76.check_pareto_front, _front_tuple, r"the front is a tuple, expected a list"),
    (ex76.check_pareto_front, _front_twice, r"returned a name twice"),
    (ex76.check_pareto_front, _front_strict_both, r"kept '\w+' \(.*\), which '\w+' .* dominates"),
    (ex76.check_pareto_front, _front_no_equal, r"dropped '\w+' \(.*\), which nothing dominates"),
    (ex76.check_pareto_front, _front_unordered, r"not ordered by \(peak, time, name\)"),
    (ex76.check_pareto_front, _front_empty_raises, r"raised ValueError at points \{\}"),
    (ex76.check_pareto_front__bad_input, _front_unchecked,
     r"returned a list for a \w+ of -?(nan|inf) \(candidate '\w+'\), expected ValueError"),
    (ex76.check_pareto_front__bad_input, _front_swallows, r"returned a list for .*, expected ValueError"),
], ids=["modifies-points", "tuple", "name-twice", "keeps-dominated", "drops-optimal", "unordered", "empty-raises",
        "nan-accepted", "error-swallowed"])
def test_pareto_front_contract_rejects(check, f, message):
    with pytest.raises(AssertionError, match="^pareto_front: .*" + message):
        check(_bad(pareto_front=f))


# --- choose_for_budget -------------------------------------------------------------------------

def _choose_prunes(points, budget, slack, context):  # drops what does not fit from the caller's dict
    pick = choose_for_budget(points, budget, slack, context)
    for n in [n for n, (p, _) in points.items() if p * (1 + slack) + context > budget]:
        del points[n]
    return pick


def _choose_np(points, budget, slack, context):
    pick = choose_for_budget(points, budget, slack, context)
    return None if pick is None else np.str_(pick)


def _choose_no_headroom(points, budget, slack, context):
    return choose_for_budget(points, budget, 0.0, 0)


def _choose_empty_raises(points, budget, slack, context):
    min(points)
    return choose_for_budget(points, budget, slack, context)


def _choose_clamps(points, budget, slack, context):  # a negative headroom taken as none
    return choose_for_budget(points, budget, max(slack, 0.0), max(context, 0))


@pytest.mark.parametrize("check, f, message", [
    (ex76.check_choose_for_budget, _choose_prunes, r"points was modified in place \(removed"),
    (ex76.check_choose_for_budget, _choose_np, r"the pick is a str_, expected a str"),
    (ex76.check_choose_for_budget, _choose_no_headroom, r"which needs more than the budget"),
    (ex76.check_choose_for_budget, _choose_empty_raises, r"raised ValueError at points \{\}"),
    (ex76.check_choose_for_budget__bad_input, _choose_clamps,
     r"returned .* for slack -?[\d.]+, context -?[\d.]+, expected ValueError"),
], ids=["modifies-points", "numpy-str", "no-headroom", "empty-raises", "negative-headroom-clamped"])
def test_choose_for_budget_contract_rejects(check, f, message):
    with pytest.raises(AssertionError, match="^choose_for_budget: .*" + message):
        check(_bad(choose_for_budget=f))


# --- Exercise 76.3 (variant) -----------------------------------------------------------------------

def _lean(test=lambda t, lim: t <= lim, key=None, limit=None):
    def f(points, reference, max_slowdown):
        if max_slowdown < 0:
            raise ValueError(max_slowdown)
        t_ref = points[reference][1]
        lim = limit(t_ref, max_slowdown) if limit else t_ref * (1 + max_slowdown)
        within = [n for n, (_, t) in points.items() if test(t, lim)]
        return min(within, key=(key or _key)(points))
    return f


def _lean_prunes(points, reference, max_slowdown):
    pick = ANSWER_LEANEST(points, reference, max_slowdown)
    points.pop(next((n for n in sorted(points) if n != pick), pick))
    return pick


def _lean_np(points, reference, max_slowdown):
    return np.str_(ANSWER_LEANEST(points, reference, max_slowdown))


def _lean_no_key_error(points, reference, max_slowdown):  # an unknown reference read as "no limit"
    t_ref = points.get(reference, (0, math.inf))[1]
    return min((n for n, p in points.items() if p[1] <= t_ref * (1 + abs(max_slowdown))), key=_key(points))


@pytest.mark.parametrize("check, f, message", [
    (ex76.check_leanest_within_slowdown, _lean(test=lambda t, lim: t < lim), r"the pick is '\w+', .* gives 'ckpt'"),
    (ex76.check_leanest_within_slowdown, _lean(key=lambda p: lambda n: p[n][0]), r"the pick is 'a', .* gives 'b'"),
    (ex76.check_leanest_within_slowdown, _lean(key=lambda p: lambda n: (p[n][1], p[n][0], n)),
     r"the pick is 'fp16', .* gives 'ckpt'"),
    (ex76.check_leanest_within_slowdown, _lean(limit=lambda t, s: t + s), r"the pick is '\w+', .* gives 'ckpt'"),
    (ex76.check_leanest_within_slowdown,
     _lean(key=lambda p: lambda n: (p[n][0], p[n][1], [-ord(c) for c in n])), r"the pick is 'zeta', .* gives 'alpha'"),
    (ex76.check_leanest_within_slowdown, _lean_prunes, r"points was modified in place"),
    (ex76.check_leanest_within_slowdown, _lean_np, r"the pick is a str_, expected a str"),
    (ex76.check_leanest_within_slowdown__bad_input, _lean_no_key_error,
     r"returned a str for a reference not in points, expected KeyError"),
], ids=["limit-excluded", "peak-tie-by-order", "least-time", "seconds", "name-tie-last", "modifies-points",
        "numpy-str", "unknown-reference-accepted"])
def test_leanest_within_slowdown_checks_reject(check, f, message):
    with pytest.raises(AssertionError, match="^leanest_within_slowdown: .*" + message):
        check(_bad(leanest_within_slowdown=f))


def test_a_negative_slowdown_must_raise():
    f = _lean()

    def accepts_negative(points, reference, max_slowdown):
        return f(points, reference, abs(max_slowdown))

    with pytest.raises(AssertionError, match=r"^leanest_within_slowdown: returned .* for max_slowdown -[\d.]+, "
                                             r"expected ValueError"):
        ex76.check_leanest_within_slowdown__bad_input(_bad(leanest_within_slowdown=accepts_negative))


# --- Exercise 76.4 (predict, then measure) ------------------------------------------------------------

MISSED = r"the prediction is \d+, the peak bp-mech plan traces .* gives \d+ \(rel error"


@pytest.mark.parametrize("f, message", [
    (lambda cfg, B, T: ledger.theoretical(cfg, B, T, None, "cuda").peak, MISSED),  # plain's peak
    (lambda cfg, B, T: ledger.theoretical(cfg, B, T, parse("checkpoint-all"), "cpu").peak, MISSED),
    (lambda cfg, B, T: 4 * state_bytes.param_bytes(cfg), MISSED),  # the model state alone
    (lambda cfg, B, T: float(ledger.theoretical(cfg, B, T, parse("checkpoint-all"), "cuda").peak),
     r"the prediction is a float, expected an int"),
], ids=["plain-peak", "cpu-adamw", "model-state-only", "float"])
def test_prediction_check_catches_the_classic_mistakes(f, message):
    with pytest.raises(AssertionError, match="^predict_checkpoint_plan_peak: .*" + message):
        ex76.check_predict_checkpoint_plan_peak(_bad(predict_checkpoint_plan_peak=f))


def test_checks_pass_on_the_answers():
    for check in ex76.CHECKS:
        check(ANS)


# --- the properties the engine derives, and an outsider's mistakes ------------------------------------

def _front_reseeds(points):  # ties broken by a seeded shuffle: torch's global RNG left reseeded
    import torch

    torch.manual_seed(0)
    return pareto_front(points)


def _predict_caches_in_cfg(cfg, B, T):  # flips a flag of the caller's config
    cfg.use_cache = True
    return ANS.predict_checkpoint_plan_peak(cfg, B, T)


def _choose_refuses_empty(points, budget, slack, context):  # checks the headroom before looking at the points
    if slack < 0 or context < 0:
        raise ValueError("negative headroom")
    return choose_for_budget(points, budget, slack, context)


@pytest.mark.parametrize("check, over, message", [
    (ex76.check_pareto_front, dict(pareto_front=_front_reseeds), "left the torch RNG state changed"),
    (ex76.check_predict_checkpoint_plan_peak, dict(predict_checkpoint_plan_peak=_predict_caches_in_cfg),
     "cfg was modified"),
    (ex76.check_predict_checkpoint_plan_peak, dict(predict_checkpoint_plan_peak=lambda cfg, B, T: np.int64(
        ANS.predict_checkpoint_plan_peak(cfg, B, T))), "the prediction is an int64, expected an int"),
    (ex76.check_choose_for_budget, dict(choose_for_budget=_choose_refuses_empty),
     r"raised ValueError at points \{\}, budget \d+, slack -0.1"),
], ids=["reseeds-torch", "modifies-cfg", "numpy-int", "refuses-no-points"])
def test_derived_properties_and_outsider_mistakes(check, over, message):
    with pytest.raises(AssertionError, match=f"^{next(iter(over))}: .*" + message):
        check(_bad(**over))


def test_a_slowdown_down_to_minus_one_must_raise():
    """A negative slowdown with a point within it (the answer's test mutated to ``>= -1``): no accidental error."""
    def down_to_minus_one(points, reference, max_slowdown):
        if not max_slowdown >= -1:
            raise ValueError(max_slowdown)
        limit = points[reference][1] * (1 + max_slowdown)
        return min((n for n, p in points.items() if p[1] <= limit), key=_key(points))

    with pytest.raises(AssertionError, match=r"^leanest_within_slowdown: returned a str for max_slowdown -0.1, "
                                             r"expected ValueError .*a point within it"):
        ex76.check_leanest_within_slowdown__bad_input(_bad(leanest_within_slowdown=down_to_minus_one))
