"""Checks of exercises/ex76_memory_strategy.py: one declaration per function (``engine.Contract``).

References written here, never the answer file: a brute-force dominance test (``reference_front``: every pair
of points compared), the documented fitting rule ``peak * (1 + slack) + context <= budget`` and qualifying rule
``time <= time[reference] * (1 + max_slowdown)`` tried on every candidate, and, for the prediction, the peak
``bp-mech plan``'s own tracer gives. The domains are the docstrings': point sets from a few peaks (ints and
floats) and times, so that equal peaks, equal times and equal points are common, the empty set, hand-made sets
that hold each classic mistake on its own (exact boundaries in GiB), 300 random sets with ties everywhere, and
the refused inputs (NaN and ±inf points, a negative headroom or slowdown, an unknown reference): the exception,
not swallowed. A driver (``use``) hands ``points`` to the solution and fails when it changed, and tells a kept
dominated point, a dropped optimal one, a name twice, a pick that does not fit, in words; the engine compares
the result, of exactly its type, and restores the global state.
"""

import copy
import functools
import math
import random

from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed, int_as_float
from bp_mech.checks.engine import Contract, Raises, checks

GIB = 2**30
PEAKS = st.one_of(st.integers(1, 4), st.sampled_from([1.0, 2.5, 4.0]))
TIMES = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])
POINTS = st.dictionaries(st.text("abcxyz", min_size=1, max_size=2), st.tuples(PEAKS, TIMES), max_size=7)


def _dominated(p, points) -> bool:
    """Is point ``p`` dominated by any point of ``points`` (brute force)?"""
    return any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)


def reference_front(points: dict) -> list:
    """Reference: the undominated names, ordered by (peak, time, name).

    Args:
        points: name -> (peak, time).

    Returns:
        The names no other point dominates, in that order.

    Example:
        >>> reference_front({"b": (1, 1.0), "a": (1, 1.0), "c": (2, 2.0)})
        ['a', 'b']
    """
    kept = [n for n, p in points.items() if not _dominated(p, points.values())]
    return sorted(kept, key=lambda n: (points[n][0], points[n][1], n))


def _points_use(fn, after=None):
    """The driver of a function of ``points``: it gets the caller's dict and must leave it as it was;
    ``after(got, points, *rest)`` tells a wrong result in words."""
    def use(f):
        def g(points, *rest):
            before = copy.deepcopy(points)
            got = f(points, *rest)
            at = f"at points {before}"
            if points != before:
                gone, new = sorted(set(before) - set(points)), sorted(set(points) - set(before))
                what = (f"removed {gone}" if gone else "") + (f"added {new}" if new else "") or "rewrote its points"
                raise CheckFailed(f"{fn}: points was modified in place ({what}) {at}")
            if after is not None:
                after(got, points, *rest, at=at)
            return got
        return g
    return use


def _front_words(got, points, at):
    """A kept dominated point, a dropped optimal one, a name twice, the order: in words."""
    if not isinstance(got, (list, tuple)) or any(type(n) is not str or n not in points for n in got) or any(
            not math.isfinite(v) for p in points.values() for v in p):
        return  # (the engine says what it is, or that a refused input did not raise)
    if len(set(got)) != len(got):
        raise CheckFailed(f"pareto_front: returned a name twice ({list(got)}) {at}")
    for name in got:
        if _dominated(points[name], points.values()):
            by = next(n for n, q in points.items() if _dominated(points[name], [q]))
            raise CheckFailed(f"pareto_front: kept {name!r} {points[name]}, which {by!r} {points[by]} dominates, {at}")
    for name in sorted(set(points) - set(got)):
        if not _dominated(points[name], points.values()):
            raise CheckFailed(f"pareto_front: dropped {name!r} {points[name]}, which nothing dominates, {at}")
    if list(got) != sorted(got, key=lambda n: (points[n][0], points[n][1], n)):
        raise CheckFailed(f"pareto_front: returned {list(got)}, not ordered by (peak, time, name) {at}")


def _front_ref(points):
    bad = next(((n, w, v) for n, p in points.items() for w, v in zip(("peak", "time"), p) if not math.isfinite(v)),
               None)
    return Raises(ValueError, f"a {bad[1]} of {bad[2]} (candidate {bad[0]!r})") if bad else (reference_front(points),)


def _random_points(rng: random.Random, n: int) -> dict:
    """``n`` points from 4 peaks x 4 times (ties everywhere), names in random order."""
    peaks = [k * 64 * 2**20 for k in rng.sample(range(1, 9), 4)]
    times = [k * 1e-3 for k in rng.sample(range(5, 40), 4)]
    names = [f"c{i}" for i in rng.sample(range(100), n)]
    return {name: (rng.choice(peaks), rng.choice(times)) for name in names}


def _randoms(seed, n, more):
    rng = random.Random(seed)
    return [{"points": _random_points(rng, rng.randint(1, n)), **more(rng)} for _ in range(300)]


FRONT = Contract(
    "pareto_front", lambda c: {"points": copy.deepcopy(c["points"])}, _front_ref, ("the front",), returns=list,
    use=_points_use("pareto_front", _front_words), ref_name="brute-force dominance", note=lambda c: c.get("what"),
    draw=st.fixed_dictionaries({"points": POINTS}),
    examples={"": [{"what": w, "points": p} for w, p in [
        ("two equal points (neither dominates the other)", {"b": (1, 1.0), "a": (1, 1.0), "c": (2, 0.5)}),
        ("the same peak at a longer time (dominated)", {"a": (1, 1.0), "b": (1, 2.0)}),
        ("the same time at a larger peak (dominated)", {"a": (1, 1.0), "b": (2, 1.0)}),
        ("two equal points, both dominated", {"a": (1, 1.0), "b": (2, 2.0), "c": (2, 2.0)}),
        ("one point", {"only": (5, 5.0)}), ("no points", {}),
        ("a trade-off (both optimal, ordered by peak)", {"fast": (4, 1.0), "lean": (1, 3.0)}),
        ("a point better in both (the others dominated)", {"x": (3, 3.0), "best": (1, 1.0), "y": (2, 2.0)})]],
        "random": _randoms(760, 12, lambda rng: {}),
        "bad_input": [{"points": {"a": (1, 1.0), "b": (bad, 2.0)} if peak else {"a": (2, bad), "b": (1, 2.0)}}
                      for bad in (math.nan, math.inf, -math.inf) for peak in (True, False)]})


def _fits(peak, budget, slack, context):
    return peak * (1 + slack) + context <= budget


def _choose_words(got, points, budget, slack, context, at):
    if type(got) is str and got in points and min(slack, context) >= 0 and not _fits(points[got][0], budget, slack,
                                                                                        context):
        raise CheckFailed(f"choose_for_budget: picked {got!r} {points[got]}, which needs more than the budget "
                          f"(peak * (1 + slack) + context > budget) {at}, budget {budget}, slack {slack}, "
                          f"context {context}")


def _choose_ref(points, budget, slack, context):
    if points and (slack < 0 or context < 0):
        return Raises(ValueError, f"slack {slack}, context {context}")
    fitting = [n for n, (p, _) in points.items() if _fits(p, budget, slack, context)]
    return (min(fitting, key=lambda n: (points[n][1], points[n][0], n)) if fitting else None,)


def _boundary(c):
    """A peak within rounding of the largest that fits: the exact boundaries are checked by hand."""
    limit = (c["budget"] - c["context"]) / (1 + c["slack"])
    return any(abs(p - limit) <= 1e-9 * c["budget"] for p, _ in c["points"].values())


def _choose(what, points, budget=8 * GIB, slack=0.25, context=GIB // 2):
    return {"what": what, "points": points, "budget": budget, "slack": slack, "context": context}


CHOOSE = Contract(
    "choose_for_budget", lambda c: {"points": copy.deepcopy(c["points"]), **{k: c[k] for k in
                                                                             ("budget", "slack", "context")}},
    _choose_ref, ("the pick",), use=_points_use("choose_for_budget", _choose_words),
    ref_name="the fastest of the points that fit, tried one by one", note=lambda c: c.get("what"),
    draw=st.fixed_dictionaries({"points": POINTS, "budget": st.sampled_from([2, 3, 4.5, 6]),
                                "slack": st.sampled_from([0.0, 0.1, 0.5]), "context": st.sampled_from([0, 0.5, 1])}
                               ).filter(lambda c: not _boundary(c)),
    examples={"": [_choose(*c) for c in [  # 8 GiB, slack 0.25, context 0.5 GiB: peaks up to 6 GiB fit
        ("a peak that fits only without the headroom", {"fast": (7.5 * GIB, 1.0), "slow": (5 * GIB, 2.0)}),
        ("a peak that fits only without the context", {"fast": (6.2 * GIB, 1.0), "slow": (5 * GIB, 2.0)}),
        ("a peak exactly at (budget - context) / (1 + slack) fits", {"edge": (6 * GIB, 1.5), "slow": (5 * GIB, 2.0)}),
        ("the slack is a share of the peak, not of the budget", {"mid": (5.8 * GIB, 0.9), "slow": (5 * GIB, 2.0)}),
        ("the least time among those that fit, not the least peak", {"lean": (2 * GIB, 3.0), "ok": (5 * GIB, 1.0)}),
        ("nothing fits: None, not the smallest peak", {"a": (6.5 * GIB, 1.0), "b": (9 * GIB, 0.5)}),
        ("no headroom: a peak equal to the budget fits", {"full": (8 * GIB, 1.0)}, 8 * GIB, 0.0, 0),
        ("no points", {}), ("no points: no candidate to test, a negative headroom is no error", {}, GIB, -0.1, -1)]],
        "ties": [_choose(w, p, 16 * GIB, 0.25, GIB) for w, p in [
            ("a tie in time goes to the smaller peak", {"big": (10 * GIB, 1.0), "small": (4 * GIB, 1.0),
                                                        "slow": (2 * GIB, 3.0)}),
            ("a tie in time and peak goes to the name that sorts first", {"zeta": (4 * GIB, 1.0),
                                                                          "alpha": (4 * GIB, 1.0)}),
            ("a faster point that does not fit does not take the tie", {"x": (12.5 * GIB, 1.0),
                                                                        "y": (11 * GIB, 1.0)})]],
        "random": [c for c in _randoms(761, 10, lambda rng: {
            "slack": rng.choice([0.0, 0.05, 0.1, 0.25]), "context": rng.choice([0, 16, 64]) * 2**20,
            "budget": rng.choice([128, 256, 320, 448, 600, 700]) * 2**20}) if not _boundary(c)],
        "bad_input": [_choose("a negative headroom", {"a": (1, 1.0), "b": (2, 0.5)}, 100.0, s, k)
                      for s, k in ((-0.1, 0), (0.0, -1), (-1.0, -0.5), (0.1, -1))]})



def _leanest_ref(points, reference, max_slowdown):
    """Every candidate tested against the limit, the least (peak, time, name) kept."""
    if max_slowdown < 0:
        return Raises(ValueError, f"max_slowdown {max_slowdown:g}")
    if reference not in points:
        return Raises(KeyError, "a reference not in points")
    limit = points[reference][1] * (1 + max_slowdown)
    return (min((n for n, p in points.items() if p[1] <= limit), key=lambda n: (points[n][0], points[n][1], n)),)


def _lean(what, points, s, reference="plain"):
    return {"what": what, "points": points, "reference": reference, "max_slowdown": s}


LEANEST = Contract(
    "leanest_within_slowdown", lambda c: {"points": copy.deepcopy(c["points"]), "reference": c["reference"],
                                          "max_slowdown": c["max_slowdown"]},
    _leanest_ref, ("the pick",), returns=str, use=_points_use("leanest_within_slowdown"),
    ref_name="the least (peak, time, name) within the limit, tried one by one", note=lambda c: c.get("what"),
    draw=st.fixed_dictionaries({"points": st.dictionaries(st.text("abcxyz", min_size=1, max_size=2),
                                                          st.tuples(PEAKS, TIMES), min_size=1, max_size=7),
                                "max_slowdown": st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])}
                               ).map(lambda c: {**c, "reference": min(c["points"])}),
    examples={"": [_lean(*c) for c in [
        ("a time exactly at the limit qualifies (2.0 x 1.3 = 2.6)",
         {"plain": (10, 2.0), "ckpt": (6, 2.6), "fp16": (8, 2.0)}, 0.3),
        ("a tie in peak goes to the smaller time", {"plain": (10, 2.0), "a": (6, 2.5), "b": (6, 2.2)}, 0.3),
        ("the least peak among those within, not the least time",
         {"plain": (10, 2.0), "fast": (8, 1.5), "lean": (3, 3.5)}, 1.0),
        ("the slowdown is a share of the reference's time, not seconds",
         {"plain": (10, 4.0), "ckpt": (6, 5.0), "mid": (8, 4.2)}, 0.3),
        ("a tie in both goes to the name that sorts first", {"plain": (10, 2.0), "zeta": (6, 2.2), "alpha": (6, 2.2)},
         0.5),
        ("a slowdown of 0 keeps the reference's time only", {"plain": (10, 2.0), "fp16": (8, 2.0), "ckpt": (6, 2.1)},
         0.0),
        ("nothing else within: the reference itself", {"plain": (4, 1.0), "lean": (2, 1.5)}, 0.4)]],
        "bad_input": [_lean("an unknown reference", {"plain": (4, 1.0), "lean": (2, 1.5)}, 0.4, "no-such-name"),
                      _lean("an unknown reference", {}, 0.0, "plain"),
                      _lean("a negative slowdown", {"plain": (4, 1.0), "lean": (2, 1.5)}, -0.1),
                      _lean("a negative slowdown, a point within it", {"plain": (4, 1.0), "fast": (2, 0.5)}, -0.1),
                      _lean("a negative slowdown", {"a": (1, 1.0)}, -2.0, "a")]})

PREDICT_CASE = {"shape": (40, 5, 1, 96, 200, 3, False), "batch": 3, "seq": 20}  # a config the chapter did not show


def _config(shape):
    from transformers import Qwen2Config

    C, H, KV, inter, V, L, tied = shape
    return Qwen2Config(hidden_size=C, num_attention_heads=H, num_key_value_heads=KV, intermediate_size=inter,
                       vocab_size=V, num_hidden_layers=L, tie_word_embeddings=tied, max_position_embeddings=256,
                       use_cache=False, attn_implementation="sdpa")


@functools.cache
def measure_checkpoint_plan_peak(shape, batch: int, seq: int) -> int:
    """The peak ``bp-mech plan`` traces for checkpoint-all: its own session (fake tensors, the GPU's options).

    Args:
        shape: (hidden, heads, kv heads, intermediate, vocab, layers, tied) of a Qwen2 config.
        batch, seq: B, T.

    Returns:
        the traced peak, bytes (an int).

    Example:
        >>> measure_checkpoint_plan_peak((8, 2, 1, 16, 32, 1, True), 1, 4) > 0
        True
    """
    from bp_mech.bench.optimizer import StepOptions
    from bp_mech.bench.strategy import parse
    from bp_mech.planner import plan as planner

    sess = planner.session(_config(shape), batch, seq, StepOptions().for_device("cuda"))
    return sess.ledger(parse("checkpoint-all")).peak


def _predict_use(f):
    """The config built from its shape, left as it was; an int, read as a float for a 1 % comparison."""
    def g(shape, batch, seq):
        cfg = _config(shape)
        before = cfg.to_dict()
        got = f(cfg, batch, seq)
        if cfg.to_dict() != before:
            raise CheckFailed("predict_checkpoint_plan_peak: cfg was modified")
        return int_as_float("predict_checkpoint_plan_peak", got)
    return g


PREDICT = Contract(
    "predict_checkpoint_plan_peak", dict, lambda shape, batch, seq: (float(measure_checkpoint_plan_peak(
        shape, batch, seq)),), ("the prediction",), use=_predict_use, tol=0.01,
    ref_name="the peak bp-mech plan traces for checkpoint-all",
    note=lambda c: "(hidden, heads, kv heads, intermediate, vocab, layers, tied); within 1 %: plain's peak, the CPU's "
                   "AdamW or the model state alone miss by more than 5 %",
    examples={"": [PREDICT_CASE]})

CHECKS = checks(FRONT, CHOOSE, LEANEST, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex76.check_pareto_front__random, ...
