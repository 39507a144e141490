"""Checks of exercises/ex74_profiling.py, part two: the real measurements, the contract helpers, the timeline.

* the real measurements the checks compare with (``measured``: a plain and a chunked-loss step of a small
  Qwen2, every storage tracked; ``profiled``: a training step under ``torch.profiler``, its memory
  timeline, its CPU events and its self times, torch's own analyses);
* ``unmodified``: Python containers of numbers compared before and after the call by value
  (``properties.call_unmodified`` compares tensors); ``raises``: the documented exception propagates;
* ``live_by_category``'s contract, explored (hypothesis): a brute-force replay of drawn timelines, inputs
  left as they were, a tuple of two lists, one dict per state, Python ints, JSON, empty, unknown action.
"""

from __future__ import annotations

import copy
import functools
import random

from bp_mech.checks.common import call
from bp_mech.checks.properties import assert_json, assert_raises, assert_type, explore

# (hidden, vocab, batch, seq, chunk, tied): several chunks with two chunks' logits the larger moment; one
# chunk for all tokens (untied); several chunks with one chunk's dz^T h product the larger moment
CHUNK_CASES = [(16, 1024, 2, 48, 24, True), (16, 768, 1, 40, 64, False), (32, 2048, 2, 32, 16, True)]
SELF_TOL_US = 1e-3  # the profiler's clock ticks in ns; float sums in another order differ in the last bits only


@functools.cache
def measured(case):
    """(plain rows, chunked rows) of one real step each, every storage tracked (tracked-cpu)."""
    from transformers import Qwen2Config

    from bp_mech.planner.build import ConfigWorkload
    from bp_mech.planner.lifecycle import Session
    from bp_mech.bench.strategy import PLAIN, Strategy
    from bp_mech.projects.diagnosis import ledger_rows

    C, V, B, T, chunk, tied = case
    cfg = Qwen2Config(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=tied, max_position_embeddings=256,
                      use_cache=False)
    session = Session(ConfigWorkload(cfg, B, T), "cpu")
    return ledger_rows(session.ledger(PLAIN)), ledger_rows(session.ledger(Strategy(chunked_loss=chunk)))


@functools.lru_cache(maxsize=1)
def profiled():
    """A real step (MLP, AdamW foreach) under the profiler, torch's own analyses beside the raw inputs:
    ``events``/``categories`` (the memory timeline in the exercise's format, microsecond clock), ``times``/
    ``states`` (torch's coalesced timeline), ``intervals`` (name, thread, start, end of every CPU event) and
    ``self_us`` (torch's self CPU time per name, ``key_averages``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import (
        _CATEGORY_TO_INDEX,
        MemoryProfileTimeline,
        TensorKey,
    )

    torch.manual_seed(74)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(32, 48), torch.randint(0, 10, (32,))

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's moments exist before the profiled steps
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
        step()
    mp = prof._memory_profile()
    events, cats = [], {}
    for t, action, (key, version), nbytes in mp.timeline:
        if key.device.type != "cpu":
            continue
        events.append((t if t == -1 else int(t / 1000), action.name.lower(), key, version, nbytes))
        for v in (version, version + 1):
            c = mp._categories.get(key, v) if isinstance(key, TensorKey) else None
            cats[(key, v)] = c.name.lower() if c is not None else "unknown"
    names = {i + 1: (c.name.lower() if c is not None else "unknown") for c, i in _CATEGORY_TO_INDEX.items()}
    times, sizes = MemoryProfileTimeline(mp)._coalesce_timeline("cpu")  # it dates the pre-existing state (-1) at
    if events[0][0] == -1:  # the first event's time: the exercise keeps -1
        times = [-1] + times[1:]
    evs = [e for e in prof.events() if not e.is_async and e.device_type.name == "CPU"]
    return {"events": events, "categories": cats, "times": times,
                "states": [{names[i]: v for i, v in enumerate(row) if i} for row in sizes],
                "intervals": [(e.name, e.thread, e.time_range.start, e.time_range.end) for e in evs],
                "self_us": {k.key: k.self_cpu_time_total for k in prof.key_averages()}}


def short(x, limit: int = 240) -> str:
    """``repr(x)`` cut to ``limit`` characters: a minimal counterexample in words."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit] + " ..."


def _first_difference(before, after) -> str:
    if isinstance(before, dict) and isinstance(after, dict):
        for k in list(before) + [k for k in after if k not in before]:
            if k not in after:
                return f"key {k!r} removed"
            if k not in before:
                return f"key {k!r} added"
            if before[k] != after[k]:
                return f"at key {k!r}: " + _first_difference(before[k], after[k])
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return f"length {len(before)} -> {len(after)}"
        i = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
        return f"first change at index {i}: {before[i]!r} -> {after[i]!r}"
    return f"{before!r} -> {after!r}"


def unmodified(fn: str, f, *args, names: tuple[str, ...], at: str):
    """``f(*args)`` through ``common.call``; fails when an argument (a list or dict of plain values)
    changed: compared with a deep copy taken before the call."""
    before = [copy.deepcopy(a) for a in args]
    out = call(fn, f, *args, at=at)
    for name, b, a in zip(names, before, args):
        if b != a:
            raise AssertionError(f"{fn}: {name} was modified in place ({_first_difference(b, a)}) at {at}")
    return out


raises = assert_raises  # properties.assert_raises


# --- live_by_category: the contract --------------------------------------------------------------


def _timelines():
    """(events, categories): storages pre-existing, created, written in place (new versions), destroyed; several
    events at one time; versions with no category."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        seed, n, tie = d(st.integers(0, 2**32 - 1)), d(st.integers(1, 30)), d(st.sampled_from([0.0, 0.4, 0.8]))
        rng, alive, events, t = random.Random(seed), {}, [], 0
        for k in range(rng.randint(0, 3)):
            alive[f"p{k}"] = [rng.randint(0, 2), rng.randint(1, 4096)]
            events.append((-1, "preexisting", f"p{k}", *alive[f"p{k}"]))
        for i in range(n):
            t += 0 if rng.random() < tie else rng.randint(1, 9)
            op = rng.choice(["create", "create", "increment_version", "destroy"]) if alive else "create"
            key = f"s{i}" if op == "create" else rng.choice(sorted(alive))
            if op == "create":
                alive[key] = [rng.randint(0, 1), rng.randint(1, 4096)]
            events.append((t, op, key, *alive[key]))
            if op == "increment_version":
                alive[key][0] += 1
            elif op == "destroy":
                del alive[key]
        cats = {(e[2], v): rng.choice(["parameter", "gradient", "activation", "temporary"])
                for e in events for v in (e[3], e[3] + 1) if rng.random() < 0.85}
        return events, cats
    return draw()


def _replayed(events, cats):
    """Brute force: at each distinct time, the storages alive after all its events, summed by category."""
    times = sorted({e[0] for e in events})
    states = []
    for t in times:
        alive = {}
        for et, action, key, version, nbytes in events:
            if et <= t:
                alive[key] = None if action == "destroy" else (version + (action == "increment_version"), nbytes)
        state = {}
        for key, kv in alive.items():
            if kv is not None:
                cat = cats.get((key, kv[0]), "unknown")
                state[cat] = state.get(cat, 0) + kv[1]
        states.append(state)
    return times, states


def check_live_by_category__contract(m):
    fn = "live_by_category"
    got = call(fn, m.live_by_category, [], {}, at="no events")
    assert got == ([], []) and type(got) is tuple, (
        f"{fn}: returned {short(got, 80)} for no events, expected the tuple ([], [])")
    for action in ("resize", "alloc"):  # after and before "destroy" in string order
        raises(fn, m.live_by_category, ([(0, action, "s", 0, 8)], {}), ValueError, f"the unknown action {action!r}",
               f"events [(0, {action!r}, 's', 0, 8)]")

    def body(case):
        events, cats = case
        at = f"events {short(events, 200)}"
        got = unmodified(fn, m.live_by_category, events, cats, names=("events", "categories"), at=at)
        assert type(got) is tuple and len(got) == 2 and all(type(x) is list for x in got) and len(got[0]) == len(
            got[1]), f"{fn}: returned {short(got, 80)}, expected a tuple (times, states) of two lists at {at}"
        times, states = got
        assert len({id(s) for s in states}) == len(states), (
            f"{fn}: two states are one dict object (append a copy of the running dict) at {at}")
        for s in states:
            for cat, v in s.items():
                assert_type(fn, f"the bytes of {cat}", v, int, at)
        assert_json(fn, "the states", states, at)
        want_t, want = _replayed(events, cats)
        assert times == want_t, f"{fn}: times {short(times, 80)}, the distinct times are {short(want_t, 80)} at {at}"
        for t, s, ref in zip(times, states, want):
            bad = next((c for c in set(s) | set(ref) if s.get(c, 0) != ref.get(c, 0)), None)
            assert bad is None, (f"{fn}: at time {t} {bad} holds {s.get(bad, 0)} bytes, the storages alive then "
                                 f"{ref.get(bad, 0)} at {at}")
    unchanged = ([(1, "create", "s0", 0, 100), (2, "increment_version", "s0", 0, 100)],  # t=2: the same state
                 {("s0", 0): "activation", ("s0", 1): "activation"})
    explore(_timelines(), body, corners=(unchanged,))
