"""Part 02 · 74: every property the checks hold a solution to rejects a solution that breaks exactly it.

Each mutant is the answer with one mistake (``conftest.mutant``); the classic mistakes of the first three
exercises are in ``tests/projects/test_profiling.py``.
"""

import numpy as np
import pytest
from conftest import load_solution, mutant

from bp_mech import ROOT
from bp_mech.checks import ex74
from bp_mech.projects import diagnosis, step_profile

EX = "ex74_profiling"
ANSWER = load_solution(ROOT / "answers", EX)
saving, rule, replay = diagnosis.predicted_saving, diagnosis.chunked_loss_changes, step_profile.live_by_category


# --- predicted_saving -----------------------------------------------------------------------------------

def _applies_in_place(stages, change):  # the remedy written into the caller's ledger
    out = saving(stages, change)
    for s, ch in change.items():
        for c, v in ch.items():
            stages[s][c] = stages[s].get(c, 0) + v
    return out


def _by_position(stages, change):  # walks both dicts in step: right only in the order they were given
    it = iter(change.items())
    cur, after = next(it, None), []
    for s, row in stages.items():
        add = 0
        if cur is not None and cur[0] == s:
            add, cur = sum(cur[1].values()), next(it, None)
        after.append(sum(row.values()) + add)
    return max(sum(r.values()) for r in stages.values()) - max(after)


def _row_classes_only(stages, change):  # a class the change adds to a row is dropped
    return saving(stages, {s: {c: v for c, v in ch.items() if c in stages[s]} for s, ch in change.items()})


def _empty_is_zero(stages, change):  # max(..., default=0): an empty ledger "saves" 0
    return saving(stages, change) if stages else 0


PREDICTED = [
    ("modifies-stages", _applies_in_place, "stages.* was modified in place"),
    ("float", lambda s, c: float(saving(s, c)), "the saving is .*float.*, expected an int"),
    ("numpy-int", lambda s, c: np.int64(saving(s, c)), "the saving is .*int64.*, expected an int"),
    ("order", _by_position, "in reverse order"),
    ("added-class-dropped", _row_classes_only, "a class the change adds counts"),
    ("empty-ledger-zero", _empty_is_zero, "for an empty ledger .no peak., expected ValueError"),
]


@pytest.mark.parametrize("name, f, message", PREDICTED, ids=[p[0] for p in PREDICTED])
def test_predicted_saving_contract_rejects(name, f, message):
    with pytest.raises(AssertionError, match=message):
        ex74.check_predicted_saving(mutant(EX, predicted_saving=f))


# --- chunked_loss_changes -------------------------------------------------------------------------------

def _writes_rows(rows, n, V, C, chunk):  # the new line written into the caller's ledger
    out = rule(rows, n, V, C, chunk)
    for p, ch in out.items():
        rows[p]["logits_loss"] += ch["logits_loss"]
    return out


def _always_dw(rows, n, V, C, chunk):  # dW booked at the backward's peak even where nothing shrinks
    out = rule(rows, n, V, C, chunk)
    if "backward_peak" in out:
        out["backward_peak"].setdefault("gradients", 0)
    return out


def _nonzero_points(rows, n, V, C, chunk):  # points with no change left out
    return {p: ch for p, ch in rule(rows, n, V, C, chunk).items() if any(ch.values())}


PEAK = "backward_peak"


def _peak_by_identity(rows, n, V, C, chunk):  # `point is "backward_peak"`: right only for interned names
    out = rule(rows, n, V, C, chunk)
    for p, ch in out.items():
        if p == PEAK and p is not PEAK:
            ch.pop("gradients", None)
    return out


def _shrinks_by_two(rows, n, V, C, chunk):  # `cut < -1`: a one-byte shrink books no dW
    out = rule(rows, n, V, C, chunk)
    if out.get(PEAK, {}).get("logits_loss") == -1:
        out[PEAK].pop("gradients")
    return out


def _chunks_by_identity(rows, n, V, C, chunk):  # `k = 2 if n is not c`: two chunks' logits when c is n by value
    c = min(chunk, n)
    k = 2 if n is not c else 1
    live = {"forward_peak": k * 4 * c * V, PEAK: max(k * 4 * c * V, 4 * c * V + 4 * V * C) + 4 * n * C}
    out = {}
    for p, row in rows.items():
        cut = min(0, 12 * n + live.get(p, 0) - row["logits_loss"])
        out[p] = {"logits_loss": cut, **({"gradients": 4 * V * C} if p == PEAK and cut < 0 else {})}
    return out


CHUNKED = [
    ("peak-by-identity", _peak_by_identity, "entries, the docstring's rule gives"),
    ("one-byte-shrink", _shrinks_by_two, "entries, the docstring's rule gives"),
    ("one-chunk-by-identity", _chunks_by_identity, "the docstring's rule gives"),
    ("modifies-rows", _writes_rows, "rows.* was modified in place"),
    ("float", lambda *a: {p: {k: float(v) for k, v in ch.items()} for p, ch in rule(*a).items()}, "expected an int"),
    ("numpy-int", lambda *a: {p: {k: np.int64(v) for k, v in ch.items()} for p, ch in rule(*a).items()},
     "expected an int"),
    ("dW-where-nothing-shrinks", _always_dw, "entries, the docstring's rule gives"),
    ("every-class", lambda rows, *a: {p: {**dict.fromkeys(rows[p], 0), **ch} for p, ch in rule(rows, *a).items()},
     "entries, the docstring's rule gives"),
    ("points-left-out", _nonzero_points, "the changes has .* entries"),
    ("needs-every-class", lambda rows, *a: (sum(rows[p]["gradients"] for p in rows), rule(rows, *a))[1],
     "raised KeyError"),
]


@pytest.mark.parametrize("name, f, message", CHUNKED, ids=[p[0] for p in CHUNKED])
def test_chunked_loss_changes_contract_rejects(name, f, message):
    with pytest.raises(AssertionError, match=message):
        ex74.check_chunked_loss_changes(mutant(EX, chunked_loss_changes=f))


# --- live_by_category -----------------------------------------------------------------------------------

def _fills_categories(events, categories):  # a missing version written into the caller's dict
    for _, _, key, version, _ in events:
        for v in (version, version + 1):
            categories.setdefault((key, v), "unknown")
    return replay(events, categories)


def _consumes_events(events, categories):  # the caller's list used as a queue
    out = replay(list(events), categories)
    while events:
        events.pop(0)
    return out


def _shared_states(events, categories):  # an unchanged state appended as the same dict object
    times, states = replay(events, categories)
    for i in range(1, len(states)):
        if states[i] == states[i - 1]:
            states[i] = states[i - 1]
    return times, states


def _float_bytes(events, categories):
    times, states = replay(events, categories)
    return times, [{c: float(v) for c, v in s.items()} for s in states]


def _first_time(events, categories):  # events[0] read before the loop: no events crash
    events[0][0]
    return replay(events, categories)


def _unknown_ignored(events, categories):  # an action it does not know is skipped, not reported
    return replay([e for e in events if e[1] in ("preexisting", "create", "increment_version", "destroy")],
                  categories)


def _version_kept(events, categories):  # an in-place write adds the new version, keeps the old
    return replay([e if e[1] != "increment_version" else (e[0], "create", e[2], e[3] + 1, e[4]) for e in events],
                  categories)


LIVE = [
    ("modifies-categories", _fills_categories, "categories.* was modified in place"),
    ("consumes-events", _consumes_events, "events.* was modified in place"),
    ("shared-states", _shared_states, "two states are one dict object"),
    ("float-bytes", _float_bytes, "expected an int"),
    ("list-not-tuple", lambda e, c: list(replay(e, c)), "expected (a|the) tuple"),
    ("empty-crashes", _first_time, r"raised IndexError at events \[\]"),
    ("unknown-action-ignored", _unknown_ignored, "expected ValueError"),
    ("alloc-read-as-destroy", lambda e, c: replay([x if x[1] != "alloc" else (*x[:1], "destroy", *x[2:]) for x in e], c),
     "the unknown action 'alloc'"),
    ("increment-keeps-old-version", _version_kept, "a replay storage by storage"),
]


@pytest.mark.parametrize("name, f, message", LIVE, ids=[p[0] for p in LIVE])
def test_live_by_category_contract_rejects(name, f, message):
    with pytest.raises(AssertionError, match=message):
        ex74.check_live_by_category(mutant(EX, live_by_category=f))
