"""Checks of exercises/ex74_profiling.py, part three: the variant and the prediction.

* ``self_time_by_name`` (variant): torch.profiler's own self times (``key_averages``) of a profiled training
  step, and a brute force over interval sets drawn by hypothesis (each interval's parent searched among all
  the intervals of its thread); its contract (inputs, order, types, JSON, empty);
* ``predict_logits_line_saving`` (predict, then measure): the logits & loss lines of a plain and a
  chunked-loss step measured at the backward's peak (every storage tracked), within the bytes the
  formulas leave out (4 c C + 64); and the chapter's formulas exactly on drawn settings.
"""

from __future__ import annotations

import random

from bp_mech.checks.common import call
from bp_mech.checks.ex74_contract import (
    CHUNK_CASES,
    SELF_TOL_US,
    measured,
    profiled,
    short,
    unmodified,
)
from bp_mech.checks.properties import assert_json, assert_type, explore

# --- self_time_by_name (variant) ------------------------------------------------------------------


def _self_reference(intervals) -> dict:
    """Brute force: each interval's parent is the innermost of all intervals of its thread that contain it."""
    own = {i: iv[3] - iv[2] for i, iv in enumerate(intervals)}
    for i, (_, th, s, e) in enumerate(intervals):
        holders = [j for j, (_, th2, s2, e2) in enumerate(intervals)
                   if j != i and th2 == th and s2 <= s and e <= e2 and s < e2 and (s2, e2) != (s, e)]
        if holders:
            parent = max(holders, key=lambda j: (intervals[j][2], -intervals[j][3]))
            own[parent] -= e - s
    out = {}
    for i, iv in enumerate(intervals):
        out[iv[0]] = out.get(iv[0], 0.0) + float(own[i])
    return out


def interval_sets():
    """Nested interval sets: one to three threads, each a forest of intervals on a quarter-microsecond grid
    (float sums exact in any order), siblings touching or apart, zero-length ones, a few repeated names."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        seed, threads, depth = d(st.integers(0, 2**32 - 1)), d(st.integers(1, 3)), d(st.integers(0, 4))
        rng, out = random.Random(seed), []
        names = [f"aten::op{i}" for i in range(rng.randint(1, 5))]

        def fill(th, s, e, left):
            cur = s
            while left > 0 and cur <= e and rng.random() < 0.7:
                a = rng.randint(cur, min(e, cur + 3))
                b = a if rng.random() < 0.15 else rng.randint(a, e)
                if (a, b) == (s, e):
                    break
                out.append((rng.choice(names), th, a / 4, b / 4))
                fill(th, a, b, left - 1)
                cur = b + rng.randint(0, 1)
        for th in range(threads):
            fill(th, rng.randint(0, 8), rng.randint(40, 80), depth + 1)
        return out
    return draw()


def check_self_time_by_name__profiled_step(m):
    toy = [("step", 0, 0.0, 10.0), ("aten::mm", 0, 1.0, 4.0), ("aten::add", 0, 2.0, 3.0), ("aten::mm", 1, 0.0, 2.0)]
    got = call("self_time_by_name", m.self_time_by_name, toy, at=f"intervals {toy}")
    want = {"step": 7.0, "aten::mm": 4.0, "aten::add": 1.0}
    assert got == want, f"self_time_by_name: returned {short(got)}, expected {want} for the intervals {toy}"
    # a child that starts with its parent, listed first (the order of the intervals does not matter)
    toy = [("aten::add", 0, 0.0, 3.0), ("aten::linear", 0, 0.0, 8.0), ("aten::mm", 0, 0.0, 5.0)]
    got = call("self_time_by_name", m.self_time_by_name, toy, at=f"intervals {toy}")
    want = {"aten::linear": 3.0, "aten::mm": 2.0, "aten::add": 3.0}
    assert got == want, (f"self_time_by_name: returned {short(got)}, expected {want} for the intervals {toy} (three "
                         f"nested intervals with one start, the innermost listed first)")
    ref = profiled()
    at = f"the {len(ref['intervals'])} CPU events of a profiled training step (MLP + AdamW)"
    got = call("self_time_by_name", m.self_time_by_name, list(ref["intervals"]), at=at)
    assert isinstance(got, dict), f"self_time_by_name: returned {short(got, 80)}, expected a dict at {at}"
    for name, want in ref["self_us"].items():
        have = got.get(name)
        assert have is not None and abs(have - want) <= SELF_TOL_US, (
            f"self_time_by_name: {name} has {have} us of self time, torch.profiler's key_averages "
            f"{want:.3f} us (difference > {SELF_TOL_US} us) at {at}")


def check_self_time_by_name__brute_force(m):
    def body(ivs):
        at = f"intervals {short(ivs)}"
        got = call("self_time_by_name", m.self_time_by_name, list(ivs), at=at)
        want = _self_reference(ivs)
        assert isinstance(got, dict) and set(got) == set(want), (
            f"self_time_by_name: returned the names {sorted(got) if isinstance(got, dict) else short(got, 60)}, "
            f"expected every name of the intervals {sorted(want)} at {at}")
        for name in want:
            assert got[name] == want[name], (f"self_time_by_name: {name} has {got[name]} of self time, the brute "
                                             f"force (innermost containing interval as parent) {want[name]} at {at}")
    explore(interval_sets(), body)


def check_self_time_by_name__contract(m):
    fn = "self_time_by_name"
    got = call(fn, m.self_time_by_name, [], at="no intervals")
    assert got == {} and isinstance(got, dict), f"{fn}: returned {short(got, 80)} for no intervals, expected {{}}"

    def body(ivs):
        at = f"intervals {short(ivs)}"
        got = unmodified(fn, m.self_time_by_name, list(ivs), names=("intervals",), at=at)
        assert isinstance(got, dict), f"{fn}: returned {short(got, 80)}, expected a dict at {at}"
        for name, v in got.items():
            assert_type(fn, f"the self time of {name}", v, float, at)
        assert_json(fn, "the result", got, at)
        shuffled = list(ivs)
        random.Random(len(ivs)).shuffle(shuffled)
        again = call(fn, m.self_time_by_name, shuffled, at=at)
        diff = next((k for k in set(got) | set(again) if got.get(k) != again.get(k)), None)
        assert diff is None, (f"{fn}: depends on the order of the intervals: {diff} has {got.get(diff)} in the "
                              f"given order, {again.get(diff)} shuffled at {at}")
    explore(interval_sets(), body)


# --- predict_logits_line_saving (predict, then measure) ------------------------------------------


def _line_saving(n, V, C, chunk) -> int:
    c = min(chunk, n)
    k = 1 if c >= n else 2
    return 12 * n * V - (12 * n + 4 * n * C + max(k * 4 * c * V, 4 * c * V + 4 * V * C))


def check_predict_logits_line_saving(m):
    for case in CHUNK_CASES:
        C, V, B, T, chunk, tied = case
        n = B * T
        at = f"n={n} tokens, V={V}, C={C}, chunk={chunk} ({'tied' if tied else 'untied'} embeddings)"
        got = call("predict_logits_line_saving", m.predict_logits_line_saving, n, V, C, chunk, at=at)
        plain, chunked = measured(case)
        want = plain["backward_peak"]["logits_loss"] - chunked["backward_peak"]["logits_loss"]
        tol = 4 * min(chunk, n) * C + 64
        assert isinstance(got, (int, float)) and abs(got - want) <= tol, (
            f"predict_logits_line_saving: predicted {got} bytes, the measured steps (tracked storages) remove "
            f"{want} from the logits & loss line at the backward's peak (off by {got - want:+}, > {tol} = 4 c C + "
            f"64) at {at}")


def check_predict_logits_line_saving__contract(m):
    from hypothesis import strategies as st

    fn = "predict_logits_line_saving"

    def body(case):
        n, V, C, chunk = case
        at = f"n={n}, V={V}, C={C}, chunk={chunk}"
        got = call(fn, m.predict_logits_line_saving, n, V, C, chunk, at=at)
        assert_type(fn, "the prediction", got, int, at)
        want = _line_saving(n, V, C, chunk)
        assert got == want, f"{fn}: predicted {got} bytes, the chapter's formulas give {want} at {at}"
    B, T = 2, 300
    n = B * T  # 600 tokens, computed as a step computes them, and one chunk of exactly n (k = 1), c > C
    explore(st.tuples(st.integers(1, 4096), st.integers(1, 200_000), st.integers(1, 4096), st.integers(1, 8192)),
            body, corners=((n, 1000, 64, 600),))
