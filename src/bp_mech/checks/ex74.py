"""Checks of exercises/ex74_profiling.py: one declaration per function (``engine.Contract``).

References, never the answer file: a brute-force maximum over the stages (``predicted_saving``); the docstring's
rule written here, and the ledger of a real chunked-loss step (small Qwen2 models, tied and untied, one chunk and
several, every storage tracked: ``ex74_measure.measured``) within ``CHUNK_TOL`` of the plain peak
(``chunked_loss_changes``, ``predict_logits_line_saving`` within 4 c C + 64 bytes); a replay storage by storage
and ``torch.profiler``'s own memory timeline of a real step (``live_by_category``); a brute-force parent search
and the profiler's ``key_averages`` (``self_time_by_name``). Drivers (``use``) hold the promises beyond the
values: the order of the stages or intervals does not matter, a state per time is its own dict, the result can
be written to JSON. The engine derives the rest: inputs unchanged, exact types, refused inputs (``Raises``).
Every case's names and numbers are fresh objects (read back from JSON): a comparison by identity fails.
"""

import json

from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed, describe
from bp_mech.checks.engine import Contract, Raises, checks
from bp_mech.checks.ex74_measure import (
    BASE, CHUNK_CASES, CLASSIC, POINTS, SELF_TOL_US, TWO_CHANGES, interval_sets, ledgers, measured, profiled, random_ledgers,
    replayed, self_reference, settings, timelines)
from bp_mech.checks.properties import assert_json

CHUNK_TOL = 0.01  # of the plain peak: the per-token and (chunk, hidden)-sized bytes the rule leaves out


def _fresh(x):
    """``x`` read back from JSON: new str and int objects, equal to the literals but not them."""
    return json.loads(json.dumps(x))


class _Shown(list):
    """A long list (a profiled step's events) named in a failure by its length, not its repr."""

    def __repr__(self):
        return f"<{len(self)} entries of a profiled training step>"


def _fail(fn: str, what: str, args) -> None:
    raise CheckFailed(f"{fn}: {what} for {', '.join(f'{k} {str(v)[:160]}' for k, v in args.items())}")


def _json(fn: str, what: str, got, args) -> None:
    try:
        assert_json(fn, what, got, "")
    except AssertionError as e:
        _fail(fn, str(e).removesuffix(" at "), args)


# --- predicted_saving ------------------------------------------------------------------------------


def _saving(stages, change):
    if not stages:
        return Raises(ValueError, "an empty ledger (no peak)")
    totals = {s: sum(r.values()) for s, r in stages.items()}
    after = {s: totals[s] + sum(change.get(s, {}).values()) for s in stages}
    return (max(totals.values()) - max(after.values()),)


SAVING = Contract(
    "predicted_saving", lambda c: _fresh({"stages": c["stages"], "change": c["change"]}), _saving, ("the saving",),
    returns=int, orderless=("stages", "change"), draw=ledgers(),
    ref_name="the largest stage total before minus the largest after (a class the change adds counts)",
    examples={"": [{"stages": BASE, "change": ch} for ch in CLASSIC] + [TWO_CHANGES, {"stages": {}, "change": {}}],
              "random": random_ledgers()})


# --- chunked_loss_changes --------------------------------------------------------------------------


def _rule(rows, tokens, vocab, hidden, chunk):
    """The chunked loss's rule as the docstring states it."""
    n, V, C, c = tokens, vocab, hidden, min(chunk, tokens)
    k = 1 if c >= n else 2
    keep = {"forward_peak": 12 * n + k * 4 * c * V,
            "backward_peak": 12 * n + 4 * n * C + max(k * 4 * c * V, 4 * c * V + 4 * V * C)}
    out = {}
    for p, r in rows.items():
        out[p] = {"logits_loss": min(0, keep.get(p, 12 * n) - r["logits_loss"])}
        if p == "backward_peak" and out[p]["logits_loss"] < 0:
            out[p]["gradients"] = 4 * V * C
    return (out,)


def _chunk_args(c):
    if "measured" in c:
        C, V, B, T, chunk, _ = CHUNK_CASES[c["measured"]]
        c = {"rows": measured(CHUNK_CASES[c["measured"]])[0], "n": B * T, "V": V, "C": C, "chunk": chunk}
    return _fresh({"rows": c["rows"], "tokens": c["n"], "vocab": c["V"], "hidden": c["C"], "chunk": c["chunk"]})


def _against_the_step(case, call, at):
    """The changes, added to the plain step's ledger, give the measured chunked-loss step's ledger."""
    if "measured" not in case:
        return
    plain, chunked = measured(CHUNK_CASES[case["measured"]])
    got, peak = call(), max(sum(r.values()) for r in plain.values())
    for p in plain:
        for line in ("logits_loss", "gradients"):
            want = chunked[p][line] - plain[p][line]
            err = abs(got[p].get(line, 0) - want) / peak
            assert err <= CHUNK_TOL, (
                f"chunked_loss_changes: the {line} line at {p} changes by {got[p].get(line, 0):+d} bytes, the "
                f"measured chunked-loss step (tracked storages) by {want:+d}: {err:.1%} of the plain peak > "
                f"{CHUNK_TOL:.0%} at {at} ({'tied' if CHUNK_CASES[case['measured']][5] else 'untied'} embeddings)")


_KEEPS = 12 * 64 + 4 * 64 * 8 + max(2 * 4 * 16 * 100, 4 * 16 * 100 + 4 * 100 * 8)  # kept at the backward's peak
CHANGES = Contract(
    "chunked_loss_changes", _chunk_args, _rule, ("the changes",), returns=dict, draw=settings(),
    promise=_against_the_step, ref_name="the docstring's rule", note=lambda c: c.get("why", ""),
    examples={"": [
        {"rows": {p: {"logits_loss": (12 if "backward" in p else 8) * 64 * 100} for p in POINTS}, "n": 64, "V": 100,
         "C": 8, "chunk": 16, "why": "a hand-made ledger"},
        {"rows": {"forward_peak": {"logits_loss": 20 * 600 * 50}, "backward_peak": {"logits_loss": 20 * 600 * 50},
                  "forward": {"logits_loss": 12 * 600}}, "n": 600, "V": 50, "C": 8, "chunk": 600,
         "why": "one chunk of exactly n tokens: k = 1"},
        {"rows": {"forward": {"logits_loss": 12 * 64, "gradients": 7},
                  "backward_peak": {"logits_loss": _KEEPS + 1, "parameters": 5}}, "n": 64, "V": 100, "C": 8,
         "chunk": 16, "why": "the backward's peak one byte over what the chunked loss keeps"}],
        "measured": [{"measured": i} for i in range(len(CHUNK_CASES))]})


# --- live_by_category ------------------------------------------------------------------------------

ACTIONS = ("preexisting", "create", "increment_version", "destroy")
_CATS = {("w", 0): "parameter", ("w", 1): "parameter", ("g", 0): "autograd_detail", ("g", 1): "gradient",
         ("x", 0): "activation"}
_HAND = [(-1, "preexisting", "w", 0, 64), (5, "create", "x", 0, 32), (5, "create", "g", 0, 16),
         (7, "increment_version", "g", 0, 16), (7, "increment_version", "w", 0, 64), (9, "destroy", "x", 0, 32),
         (9, "create", "t", 0, 8), (11, "destroy", "g", 1, 16), (11, "destroy", "t", 0, 8)]


def _timeline_args(c):
    if c.get("profiled"):
        ref = profiled()
        return {"events": _Shown(ref["events"]), "categories": dict(ref["categories"])}
    return {"events": [tuple(e) for e in _fresh(c["events"])], "categories": dict(c["categories"])}


def _live(events, categories):
    bad = next((e[1] for e in events if e[1] not in ACTIONS), None)
    if bad is not None:
        return Raises(ValueError, f"the unknown action {bad!r}")
    if isinstance(events, _Shown):  # torch.profiler's own coalesced timeline
        times, states = profiled()["times"], profiled()["states"]
    else:
        times, states = replayed(events, categories)
    return list(times), [{c: v for c, v in s.items() if v} for s in states]


def _timeline(f):
    """The driver: (times, states) as a tuple of two lists, each state its own dict of int bytes, JSON; the
    categories holding 0 bytes left out (the docstring lets them be there or not)."""
    def run(events, categories):
        args = {"events": events, "categories": categories}
        got = f(events, categories)
        if not (type(got) is tuple and len(got) == 2 and all(type(x) is list for x in got)
                and len(got[0]) == len(got[1])):
            _fail("live_by_category", f"returned {describe(got)}, expected the tuple (times, states) of two lists "
                                      "of equal length", args)
        times, states = got
        if len({id(s) for s in states}) != len(states):
            _fail("live_by_category", "two states are one dict object (append a copy of the running dict)", args)
        for s in states:
            for cat, v in (s.items() if isinstance(s, dict) else ()):
                if type(v) is not int:
                    _fail("live_by_category", f"the bytes of {cat} are {describe(v)}, expected an int", args)
        _json("live_by_category", "the states", states, args)
        return times, [{c: v for c, v in s.items() if v} if isinstance(s, dict) else s for s in states]
    return run


def _bad(action):
    return {"events": [(0, action, "s", 0, 8)], "categories": {}}


LIVE = Contract(
    "live_by_category", _timeline_args, _live, ("the times", "the states"), use=_timeline,
    draw=timelines().map(lambda ec: {"events": ec[0], "categories": ec[1]}),
    ref_name="a replay storage by storage (torch.profiler's own timeline for a profiled step)",
    examples={"": [{"events": _HAND, "categories": _CATS}, {"events": [], "categories": {}}, _bad("resize"),
                   _bad("alloc"), {"events": [(1, "create", "s0", 0, 100), (2, "increment_version", "s0", 0, 100)],
                                   "categories": {("s0", 0): "activation", ("s0", 1): "activation"}}],
              "profiled_step": [{"profiled": True}]})


# --- self_time_by_name (variant) --------------------------------------------------------------------


def _interval_args(c):
    if c.get("profiled"):
        return {"intervals": _Shown(profiled()["intervals"])}
    return {"intervals": [tuple(iv) for iv in _fresh(c["intervals"])]}


def _as_json(f):
    """The driver: the self times, which must be writable as JSON."""
    def run(intervals):
        got = f(intervals)
        _json("self_time_by_name", "the result", got, {"intervals": intervals})
        return got
    return run


def _against_the_profiler(case, call, at):
    """A profiled step's self times are torch.profiler's ``key_averages`` ones."""
    if not case.get("profiled"):
        return
    got = call()
    for name, want in profiled()["self_us"].items():
        have = got.get(name)
        assert have is not None and abs(have - want) <= SELF_TOL_US, (
            f"self_time_by_name: {name} has {have} us of self time, torch.profiler's key_averages {want:.3f} us "
            f"(difference > {SELF_TOL_US} us) at {at}")


SELF = Contract(
    "self_time_by_name", _interval_args, lambda intervals: (self_reference(intervals),), ("the self times",),
    returns=dict, use=_as_json, orderless=("intervals",), promise=_against_the_profiler, tol=1e-9,
    draw=interval_sets().map(lambda ivs: {"intervals": ivs}),
    ref_name="a brute force (the innermost containing interval of the thread as parent)",
    examples={"": [{"intervals": []},
                   {"intervals": [("step", 0, 0.0, 10.0), ("aten::mm", 0, 1.0, 4.0), ("aten::add", 0, 2.0, 3.0),
                                  ("aten::mm", 1, 0.0, 2.0)]},
                   {"intervals": [("aten::add", 0, 0.0, 3.0), ("aten::linear", 0, 0.0, 8.0),
                                  ("aten::mm", 0, 0.0, 5.0)]}],  # one start, the innermost listed first
              "profiled_step": [{"profiled": True}]})


# --- predict_logits_line_saving (predict, then measure) ---------------------------------------------


def _line_saving(tokens, vocab, hidden, chunk):
    n, V, C, c = tokens, vocab, hidden, min(chunk, tokens)
    k = 1 if c >= n else 2
    return (12 * n * V - (12 * n + 4 * n * C + max(k * 4 * c * V, 4 * c * V + 4 * V * C)),)


def _predict_args(c):
    if "measured" in c:
        C, V, B, T, chunk, _ = CHUNK_CASES[c["measured"]]
        c = {"n": B * T, "V": V, "C": C, "chunk": chunk}
    return _fresh({"tokens": c["n"], "vocab": c["V"], "hidden": c["C"], "chunk": c["chunk"]})


def _measured_lines(case, call, at):
    """The prediction is the measured steps' difference at the backward's peak, within 4 c C + 64 bytes."""
    if "measured" not in case:
        return
    C, V, B, T, chunk, tied = CHUNK_CASES[case["measured"]]
    plain, chunked = measured(CHUNK_CASES[case["measured"]])
    got, want = call(), plain["backward_peak"]["logits_loss"] - chunked["backward_peak"]["logits_loss"]
    tol = 4 * min(chunk, B * T) * C + 64
    assert abs(got - want) <= tol, (
        f"predict_logits_line_saving: predicted {got} bytes, the measured steps (tracked storages) remove {want} "
        f"from the logits & loss line at the backward's peak (off by {got - want:+}, > {tol} = 4 c C + 64) at {at} "
        f"({'tied' if tied else 'untied'} embeddings)")


PREDICT = Contract(
    "predict_logits_line_saving", _predict_args, _line_saving, ("the prediction",), returns=int,
    promise=_measured_lines, ref_name="the chapter's formula",
    draw=st.fixed_dictionaries({"n": st.integers(1, 4096), "V": st.integers(1, 200_000), "C": st.integers(1, 4096),
                                "chunk": st.integers(1, 8192)}),
    examples={"": [{"n": 600, "V": 1000, "C": 64, "chunk": 600}],  # one chunk of exactly n (k = 1), c > C
              "measured": [{"measured": i} for i in range(len(CHUNK_CASES))]})

CHECKS = checks(SAVING, CHANGES, LIVE, SELF, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex74.check_predicted_saving__random, ...
