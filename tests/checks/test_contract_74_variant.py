"""Part 02 · 74, the variant exercises (``self_time_by_name``, ``predict_logits_line_saving``): every property
the checks hold a solution to rejects a solution that breaks exactly it (``conftest.mutant``)."""

import numpy as np
import pytest
from conftest import load_solution, mutant

from bp_mech import ROOT
from bp_mech.checks import ex74
from bp_mech.checks.ex74_measure import self_reference

EX = "ex74_profiling"
ANSWER = load_solution(ROOT / "answers", EX)
self_time, predict = ANSWER.self_time_by_name, ANSWER.predict_logits_line_saving

# --- self_time_by_name (variant) ------------------------------------------------------------------------

def _total_time(intervals):  # inclusive time: the children not subtracted
    out = {}
    for name, _, s, e in intervals:
        out[name] = out.get(name, 0.0) + float(e - s)
    return out


def _all_descendants(intervals):  # every contained interval subtracted, grandchildren twice
    out = {name: 0.0 for name, _, _, _ in intervals}
    for i, (name, th, s, e) in enumerate(intervals):
        inner = sum(e2 - s2 for j, (_, th2, s2, e2) in enumerate(intervals)
                    if j != i and th2 == th and s <= s2 and e2 <= e and s2 < e and (s2, e2) != (s, e))
        out[name] += float(e - s - inner)
    return out


def _one_thread(intervals):  # nesting read across threads
    return self_time([(n, 0, s, e) for n, _, s, e in intervals])


def _sorts_in_place(intervals):
    intervals.sort(key=lambda iv: (iv[2], -iv[3]))
    return self_time(intervals)


def _no_sort(intervals):
    out, by = {n: 0.0 for n, _, _, _ in intervals}, {}
    for iv in intervals:
        by.setdefault(iv[1], []).append(iv)
    for ivs in by.values():
        stack = []
        for name, _, s, e in ivs:
            while stack and (s >= stack[-1][1] or e > stack[-1][1]):
                done = stack.pop()
                out[done[0]] += done[2]
            if stack:
                stack[-1][2] -= e - s
            stack.append([name, e, float(e - s)])
        for name, _, own in stack:
            out[name] += own
    return out


def _sorted_by_start_only(intervals):  # of two intervals with one start, the list order decides the parent
    return _no_sort(sorted(intervals, key=lambda iv: iv[2]))


def _empty_crashes(intervals):
    min(iv[2] for iv in intervals)
    return self_time(intervals)


SELF = [
    (ex74.check_self_time_by_name, "total-time", _total_time, "a brute force"),
    (ex74.check_self_time_by_name, "all-descendants", _all_descendants, "a brute force"),
    (ex74.check_self_time_by_name, "threads-ignored", _one_thread, "a brute force"),
    (ex74.check_self_time_by_name, "zero-names-dropped",
     lambda ivs: {k: v for k, v in self_time(ivs).items() if v}, "the self times has .* entries"),
    (ex74.check_self_time_by_name, "total-time-toy", _total_time, "a brute force"),
    (ex74.check_self_time_by_name__profiled_step, "whole-microseconds",
     lambda ivs: self_time([(n, th, float(round(s)), float(round(e))) for n, th, s, e in ivs]),
     "key_averages|a brute force"),  # rounding makes ties: the order already tells
    (ex74.check_self_time_by_name, "sorts-in-place", _sorts_in_place,
     "intervals.* was modified in place"),
    (ex74.check_self_time_by_name, "assumes-sorted", _no_sort, "in reverse order"),
    (ex74.check_self_time_by_name, "numpy-float",
     lambda ivs: {k: np.float64(v) for k, v in self_time(ivs).items()}, "expected a float"),
    (ex74.check_self_time_by_name, "sorted-by-start-only", _sorted_by_start_only, "a brute force"),
    (ex74.check_self_time_by_name, "int-self-times",
     lambda ivs: {k: int(v) if v == int(v) else v for k, v in self_time(ivs).items()}, "is an int, expected a float"),
    (ex74.check_self_time_by_name, "empty-crashes", _empty_crashes, r"raised ValueError at intervals \[\]"),
]


@pytest.mark.parametrize("check, name, f, message", SELF, ids=[p[1] for p in SELF])
def test_self_time_by_name_checks_reject(check, name, f, message):
    with pytest.raises(AssertionError, match=message):
        check(mutant(EX, self_time_by_name=f))


def test_the_unsorted_walk_passes_on_the_given_order():
    """The order property is the only one the assumes-sorted mutant breaks: on sorted intervals it is right."""
    toy = [("step", 0, 0.0, 10.0), ("aten::mm", 0, 1.0, 4.0), ("aten::add", 0, 2.0, 3.0), ("aten::mm", 1, 0.0, 2.0)]
    assert _no_sort(toy) == self_reference(toy) == {"step": 7.0, "aten::mm": 4.0, "aten::add": 1.0}


# --- predict_logits_line_saving (predict, then measure) -------------------------------------------------

def _formula(**kw):
    def f(n, V, C, chunk):
        c = chunk if kw.get("no_min") else min(chunk, n)
        k = 1 if kw.get("k1") or (c is n if kw.get("by_identity") else c >= n) else 2
        plain = (16 if kw.get("logits_too") else 12) * n * V
        dh = 0 if kw.get("no_dh") else 4 * n * C
        return plain - (12 * n + dh + max(k * 4 * c * V, 4 * c * V + 4 * V * C))
    return f


MEASURED = "the chapter's formula gives|the measured steps"  # the formula, checked first, rejects them already
PREDICT = [
    (ex74.check_predict_logits_line_saving__measured, "one-chunk-alive", _formula(k1=True), MEASURED),
    (ex74.check_predict_logits_line_saving__measured, "logits-counted", _formula(logits_too=True), MEASURED),
    (ex74.check_predict_logits_line_saving__measured, "no-dh", _formula(no_dh=True), MEASURED),
    (ex74.check_predict_logits_line_saving, "chunk-not-capped", _formula(no_min=True),
     "the chapter's formula gives"),
    (ex74.check_predict_logits_line_saving, "one-chunk-by-identity", _formula(by_identity=True),
     "the chapter's formula gives"),
    (ex74.check_predict_logits_line_saving, "float", lambda *a: float(predict(*a)),
     "expected an int"),
]


@pytest.mark.parametrize("check, name, f, message", PREDICT, ids=[p[1] for p in PREDICT])
def test_predict_logits_line_saving_checks_reject(check, name, f, message):
    with pytest.raises(AssertionError, match=message):
        check(mutant(EX, predict_logits_line_saving=f))
