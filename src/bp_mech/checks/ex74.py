"""Checks of exercises/ex74_profiling.py (never against the answer file).

* ``predicted_saving``: a brute-force maximum over the stages written here, on hand-made ledgers
  (the peak that moves, an added line, a remedy that costs) and on random ones;
* ``chunked_loss_changes``: the ledger of a real chunked-loss step, measured. Small Qwen2 models
  (tied and untied embeddings, one chunk and several) run one plain and one chunked-loss step
  (``bp_mech.chunked_loss`` through ``bp_mech.bench.strategy``) with every storage tracked
  (``bp_mech.planner.lifecycle``); the plain ledger plus the learner's changes must give the chunked
  step's ledger. The rule leaves out per-token and (chunk, hidden)-sized temporaries, so each line
  and total may differ by ``CHUNK_TOL`` of the plain peak;
* ``live_by_category``: ``torch.profiler``'s own memory timeline (``MemoryProfileTimeline``'s
  ``_coalesce_timeline``) of a real training step (an MLP with AdamW, profiled with
  ``profile_memory``), on the same microsecond clock; bytes must match exactly.

Each function's contract is explored too (``..._contract``, hypothesis): ``predicted_saving`` and
``chunked_loss_changes`` here (brute force and the rule written from the docstring), ``live_by_category``
in ``ex74_contract`` (with the real measurements); the variant and the prediction in ``ex74_variant``.
"""

import json
import random

from bp_mech.checks import ex74_variant as variant
from bp_mech.checks.common import call
from bp_mech.checks.ex74_contract import (
    CHUNK_CASES,
    check_live_by_category__contract,
    measured,
    profiled,
    raises,
    short,
    unmodified,
)
from bp_mech.checks.properties import assert_json, assert_type, explore

POINTS = ("forward_peak", "load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")

# --- predicted_saving ------------------------------------------------------------------------------


def _saving(stages, change) -> int:
    """Reference: the largest stage total before, minus the largest after the changes."""
    totals = {s: sum(r.values()) for s, r in stages.items()}
    after = {s: totals[s] + sum(change.get(s, {}).values()) for s in stages}
    return max(totals.values()) - max(after.values())


def _row(**kw):
    return {c: kw.get(c, 0) for c in CLASSES}


def _check_saving(m, stages, change, what):
    want = _saving(stages, change)
    got = call("predicted_saving", m.predicted_saving, stages, change, at=what)
    assert isinstance(got, (int, float)) and not isinstance(got, bool), \
        f"predicted_saving: returned {got!r}, expected a number of bytes for {what}"
    assert got == want, (f"predicted_saving: returned {got} bytes, the largest stage total before minus the largest "
                         f"after is {want} (off by {got - want:+d}) for {what}")


def check_predicted_saving__classic_cases(m):
    base = {"forward": _row(parameters=100, optimizer_states=200, saved_activations=500, logits_loss=100),
            "backward_peak": _row(parameters=100, optimizer_states=200, saved_activations=400, logits_loss=300),
            "optimizer_peak": _row(parameters=100, optimizer_states=200, gradients=100, other=100),
            "zero_grad": _row(parameters=100, optimizer_states=200)}
    cases = [  # (what, change)
        ("a ledger whose peak moves to another stage (the logits removed at the peak in backward)",
         {"backward_peak": {"logits_loss": -300}}),
        ("a remedy that removes a line at every stage (activations), the peak staying in backward",
         {"forward": {"saved_activations": -400}, "backward_peak": {"saved_activations": -300}}),
        ("a remedy that adds bytes at another stage (a recompute making it the new peak)",
         {"backward_peak": {"logits_loss": -300}, "optimizer_peak": {"other": 600}}),
        ("a remedy that costs memory (the peak grows)", {"zero_grad": {"other": 900}}),
        ("a remedy that changes a stage that is not the peak only", {"optimizer_peak": {"gradients": -100}}),
        ("no change", {}),
    ]
    for what, change in cases:
        _check_saving(m, base, change, what)


def check_predicted_saving__random(m):
    rng = random.Random(740)
    for trial in range(200):
        stages = {s: _row(**{c: rng.randrange(0, 1000) for c in rng.sample(CLASSES, 3)})
                  for s in rng.sample(POINTS, rng.randint(2, len(POINTS)))}
        change = {s: {c: rng.randrange(-stages[s][c], 400) for c in rng.sample(CLASSES, 2)}
                  for s in rng.sample(list(stages), rng.randint(0, len(stages)))}
        _check_saving(m, stages, change, f"random ledger {trial}: stages {stages}, change {change}")


# --- chunked_loss_changes --------------------------------------------------------------------------

CHUNK_TOL = 0.01  # of the plain peak: the per-token and (chunk, hidden)-sized bytes the rule leaves out


def check_chunked_loss_changes(m):
    toy = {p: {"logits_loss": 12 * 64 * 100 if "backward" in p else 8 * 64 * 100} for p in POINTS}
    at = "a hand-made ledger (n=64, V=100, C=8, chunk=16), before the measured steps"
    got = call("chunked_loss_changes", m.chunked_loss_changes, toy, 64, 100, 8, 16, at=at)
    assert got == _rule(toy, 64, 100, 8, 16), f"chunked_loss_changes: returned {short(got)}, the rule gives " \
                                              f"{short(_rule(toy, 64, 100, 8, 16))} for {at}"
    for case in CHUNK_CASES:
        C, V, B, T, chunk, tied = case
        plain, chunked = measured(case)
        at = f"n={B * T} tokens, V={V}, C={C}, chunk={chunk} ({'tied' if tied else 'untied'} embeddings)"
        got = call("chunked_loss_changes", m.chunked_loss_changes, {p: dict(r) for p, r in plain.items()}, B * T, V,
                   C, chunk, at=at)
        assert isinstance(got, dict) and set(got) == set(plain), (
            f"chunked_loss_changes: returned {got!r}, expected a dict with every point of the ledger "
            f"({', '.join(plain)}) at {at}")
        peak = max(sum(r.values()) for r in plain.values())
        for p in plain:
            for line in ("logits_loss", "gradients"):
                want = chunked[p][line] - plain[p][line]
                err = abs(got[p].get(line, 0) - want) / peak
                assert err <= CHUNK_TOL, (
                    f"chunked_loss_changes: the {line} line at {p} changes by {got[p].get(line, 0):+d} bytes, the "
                    f"measured chunked-loss step (tracked storages) by {want:+d}: {err:.1%} of the plain peak > "
                    f"{CHUNK_TOL:.0%} at {at}")


# --- live_by_category ------------------------------------------------------------------------------

def check_live_by_category__hand_made(m):
    cats = {("w", 0): "parameter", ("w", 1): "parameter", ("g", 0): "autograd_detail", ("g", 1): "gradient",
            ("x", 0): "activation"}
    events = [(-1, "preexisting", "w", 0, 64), (5, "create", "x", 0, 32), (5, "create", "g", 0, 16),
              (7, "increment_version", "g", 0, 16), (7, "increment_version", "w", 0, 64), (9, "destroy", "x", 0, 32),
              (9, "create", "t", 0, 8), (11, "destroy", "g", 1, 16), (11, "destroy", "t", 0, 8)]
    want_t = [-1, 5, 7, 9, 11]
    want = [{"parameter": 64}, {"parameter": 64, "activation": 32, "autograd_detail": 16},
            {"parameter": 64, "activation": 32, "gradient": 16}, {"parameter": 64, "gradient": 16, "unknown": 8},
            {"parameter": 64}]
    _compare(m, events, cats, want_t, want, "a hand-made timeline (an in-place write turns autograd detail into a "
                                            "gradient; two events at one time; a storage with no category)")


def _compare(m, events, cats, want_t, want, what):
    got = call("live_by_category", m.live_by_category, list(events), dict(cats), at=what)
    assert isinstance(got, (tuple, list)) and len(got) == 2, \
        f"live_by_category: returned {got!r}, expected (times, states) for {what}"
    times, states = list(got[0]), list(got[1])
    first = next((i for i, (a, b) in enumerate(zip(times, want_t)) if a != b), min(len(times), len(want_t)))
    assert times == want_t, (f"live_by_category: {len(times)} times, the reference has {len(want_t)} distinct times; "
                             f"the first difference is at index {first} for {what}")
    for t, s, ref in zip(times, states, want):
        for cat in set(s) | set(ref):
            assert s.get(cat, 0) == ref.get(cat, 0), (
                f"live_by_category: at time {t} the {cat} category holds {s.get(cat, 0)} bytes, the reference "
                f"{ref.get(cat, 0)} ({s.get(cat, 0) - ref.get(cat, 0):+d}) for {what}")


def check_live_by_category__profiled_step(m):
    call("live_by_category", m.live_by_category, [(-1, "preexisting", "w", 0, 8)], {}, at="one storage")
    ref = profiled()
    _compare(m, ref["events"], ref["categories"], ref["times"], ref["states"],
             "the memory timeline of a profiled training step (MLP + AdamW), against torch.profiler's own")


# --- the contracts of the three (explored) -----------------------------------------------------------


def _ledgers():
    """(stages, change): one to seven points, each row any subset of the classes (a change may name a class
    its row lacks), bytes up to 2**40."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        seed, k, scale = d(st.integers(0, 2**32 - 1)), d(st.integers(1, len(POINTS))), d(st.sampled_from([1, 2**30]))
        rng = random.Random(seed)
        stages = {s: {c: rng.randrange(0, 1000) * scale for c in rng.sample(CLASSES, rng.randint(0, 4))}
                  for s in rng.sample(POINTS, k)}
        picked = set(rng.sample(list(stages), rng.randint(0, k)))  # listed in the ledger's order, as remedies do
        change = {s: {c: rng.randrange(-1000, 1000) * scale for c in rng.sample(CLASSES, rng.randint(0, 3))}
                  for s in stages if s in picked}
        return stages, change
    return draw()


def check_predicted_saving__contract(m):
    fn = "predicted_saving"
    raises(fn, m.predicted_saving, ({}, {}), ValueError, "an empty ledger (no peak)", "stages {}, change {}")

    def body(case):
        stages, change = case
        at = f"stages {short(stages, 160)}, change {short(change, 120)}"
        got = unmodified(fn, m.predicted_saving, stages, change, names=("stages", "change"), at=at)
        assert_type(fn, "the saving", got, int, at)
        assert_json(fn, "the saving", got, at)
        want = _saving(stages, change)
        assert got == want, (f"{fn}: returned {got} bytes, the largest stage total before minus the largest after "
                             f"(a class the change adds counts) is {want} at {at}")
        flipped = {s: dict(reversed(r.items())) for s, r in reversed(stages.items())}
        again = call(fn, m.predicted_saving, flipped, change, at=at)
        assert again == got, f"{fn}: {got} bytes in one order of the stages, {again} in reverse order at {at}"
    two_changes = ({POINTS[0]: {CLASSES[0]: 100}, POINTS[1]: {CLASSES[0]: 500}, POINTS[2]: {CLASSES[0]: 300}},
                   {POINTS[1]: {CLASSES[0]: -400}, POINTS[2]: {CLASSES[0]: -250}})  # changes at two points
    explore(_ledgers(), body, corners=(two_changes,))


def _rule(rows, n, V, C, chunk):
    """The chunked loss's rule as the docstring states it (written here, not imported)."""
    c = min(chunk, n)
    k = 1 if c >= n else 2
    keep = {"forward_peak": 12 * n + k * 4 * c * V,
            "backward_peak": 12 * n + 4 * n * C + max(k * 4 * c * V, 4 * c * V + 4 * V * C)}
    out = {}
    for p, r in rows.items():
        out[p] = {"logits_loss": min(0, keep.get(p, 12 * n) - r["logits_loss"])}
        if p == "backward_peak" and out[p]["logits_loss"] < 0:
            out[p]["gradients"] = 4 * V * C
    return out


def check_chunked_loss_changes__contract(m):
    from hypothesis import strategies as st

    fn = "chunked_loss_changes"

    @st.composite
    def settings(d):
        seed, n, V, C, chunk = (d(st.integers(0, 2**32 - 1)), d(st.integers(1, 256)), d(st.integers(1, 4096)),
                                d(st.integers(1, 64)), d(st.integers(1, 300)))
        rng = random.Random(seed)
        rows = {p: dict({c: rng.randrange(0, 10**6) for c in rng.sample(CLASSES, rng.randint(0, 3))},
                        logits_loss=rng.choice([0, 4, rng.randrange(0, 20 * n * V + 1)]))
                for p in rng.sample(POINTS, rng.randint(1, len(POINTS)))}
        return rows, n, V, C, chunk

    def body(case):
        rows, n, V, C, chunk = case
        at = f"n={n}, V={V}, C={C}, chunk={chunk}, rows {short(rows, 160)}"
        got = unmodified(fn, m.chunked_loss_changes, rows, n, V, C, chunk, names=("rows", "n", "V", "C", "chunk"),
                         at=at)
        want = _rule(rows, n, V, C, chunk)
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{fn}: returned the points {sorted(got) if isinstance(got, dict) else short(got, 60)}, expected every "
            f"point of rows and no other, {sorted(want)} at {at}")
        for p, lines in want.items():
            assert isinstance(got[p], dict) and set(got[p]) == set(lines), (
                f"{fn}: at {p} returned the keys {short(got[p], 80)}, expected exactly {sorted(lines)} at {at}")
            for line, v in lines.items():
                assert_type(fn, f"the {line} change at {p}", got[p][line], int, at)
                assert got[p][line] == v, f"{fn}: the {line} change at {p} is {got[p][line]}, the rule's {v} at {at}"
        assert_json(fn, "the changes", got, at)
    B, T = 2, 300
    n = B * T  # 600 tokens, computed as a step computes them, and one chunk of exactly n: k = 1
    one_chunk = ({"forward_peak": {"logits_loss": 20 * n * 50}, "backward_peak": {"logits_loss": 20 * n * 50},
                  "forward": {"logits_loss": 12 * n}}, n, 50, 8, 600)
    # a ledger read back from JSON (its point names are new str objects, equal to the literals but not them),
    # whose backward's peak is one byte over what the chunked loss keeps there: it shrinks, by 1 byte
    keeps = 12 * 64 + 4 * 64 * 8 + max(2 * 4 * 16 * 100, 4 * 16 * 100 + 4 * 100 * 8)
    one_byte = (json.loads(json.dumps({"forward": {"logits_loss": 12 * 64, "gradients": 7},
                                       "backward_peak": {"logits_loss": keeps + 1, "parameters": 5}})), 64, 100, 8, 16)
    explore(settings(), body, corners=(one_chunk, one_byte))


CHECKS = [check_predicted_saving__classic_cases, check_predicted_saving__random, check_predicted_saving__contract,
          check_chunked_loss_changes, check_chunked_loss_changes__contract,
          check_live_by_category__hand_made, check_live_by_category__profiled_step, check_live_by_category__contract,
          variant.check_self_time_by_name__profiled_step, variant.check_self_time_by_name__brute_force,
          variant.check_self_time_by_name__contract,
          variant.check_predict_logits_line_saving, variant.check_predict_logits_line_saving__contract]
