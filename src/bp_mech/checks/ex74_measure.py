"""Checks of exercises/ex74_profiling.py, part two: the references (never the answer file).

* the real measurements (``measured``: a plain and a chunked-loss step of a small Qwen2, every storage
  tracked; ``profiled``: a training step under ``torch.profiler``, its memory timeline, its CPU events and its
  self times, torch's own analyses);
* the brute forces and the drawn inputs: ledgers and remedies, timelines replayed storage by storage, nested
  interval sets whose parents are searched among all the intervals of a thread.
"""

from __future__ import annotations

import functools
import random

from hypothesis import strategies as st

# (hidden, vocab, batch, seq, chunk, tied): several chunks with two chunks' logits the larger moment; one
# chunk for all tokens (untied); several chunks with one chunk's dz^T h product the larger moment
CHUNK_CASES = [(16, 1024, 2, 48, 24, True), (16, 768, 1, 40, 64, False), (32, 2048, 2, 32, 16, True)]
SELF_TOL_US = 1e-3  # the profiler's clock ticks in ns; float sums in another order differ in the last bits only
POINTS = ("forward_peak", "load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")


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



# --- predicted_saving and chunked_loss_changes: ledgers ----------------------------------------


def _row(**kw):
    return {c: kw.get(c, 0) for c in CLASSES}


BASE = {"forward": _row(parameters=100, optimizer_states=200, saved_activations=500, logits_loss=100),
         "backward_peak": _row(parameters=100, optimizer_states=200, saved_activations=400, logits_loss=300),
         "optimizer_peak": _row(parameters=100, optimizer_states=200, gradients=100, other=100),
         "zero_grad": _row(parameters=100, optimizer_states=200)}
CLASSIC = [  # the peak moves; a line removed everywhere; a recompute the new peak; a cost; off the peak; none
    {"backward_peak": {"logits_loss": -300}}, {"forward": {"saved_activations": -400},
                                               "backward_peak": {"saved_activations": -300}},
    {"backward_peak": {"logits_loss": -300}, "optimizer_peak": {"other": 600}}, {"zero_grad": {"other": 900}},
    {"optimizer_peak": {"gradients": -100}}, {}]
TWO_CHANGES = {"stages": {POINTS[0]: {CLASSES[0]: 100}, POINTS[1]: {CLASSES[0]: 500}, POINTS[2]: {CLASSES[0]: 300}},
        "change": {POINTS[1]: {CLASSES[0]: -400}, POINTS[2]: {CLASSES[0]: -250}}}  # changes at two points


def random_ledgers(n=200, seed=740):
    rng, out = random.Random(seed), []
    for _ in range(n):
        stages = {s: _row(**{c: rng.randrange(0, 1000) for c in rng.sample(CLASSES, 3)})
                  for s in rng.sample(POINTS, rng.randint(2, len(POINTS)))}
        out.append({"stages": stages, "change": {s: {c: rng.randrange(-stages[s][c], 400) for c in
                                                     rng.sample(CLASSES, 2)}
                                                 for s in rng.sample(list(stages), rng.randint(0, len(stages)))}})
    return out


@st.composite
def ledgers(d):
    """One to seven points, each row any subset of the classes (a change may name a class its row lacks)."""
    seed, k, scale = d(st.integers(0, 2**32 - 1)), d(st.integers(1, len(POINTS))), d(st.sampled_from([1, 2**30]))
    rng = random.Random(seed)
    stages = {s: {c: rng.randrange(0, 1000) * scale for c in rng.sample(CLASSES, rng.randint(0, 4))}
              for s in rng.sample(POINTS, k)}
    picked = set(rng.sample(list(stages), rng.randint(0, k)))  # listed in the ledger's order, as remedies do
    return {"stages": stages, "change": {s: {c: rng.randrange(-1000, 1000) * scale for c in
                                             rng.sample(CLASSES, rng.randint(0, 3))} for s in stages if s in picked}}


@st.composite
def settings(d):
    """A plain ledger (any points, each row its logits line and any other classes) and a setting n, V, C, chunk."""
    seed, n, V = d(st.integers(0, 2**32 - 1)), d(st.integers(1, 256)), d(st.integers(1, 4096))
    C, chunk = d(st.integers(1, 64)), d(st.integers(1, 300))
    rng = random.Random(seed)
    rows = {p: dict({c: rng.randrange(0, 10**6) for c in rng.sample(CLASSES, rng.randint(0, 3))},
                    logits_loss=rng.choice([0, 4, rng.randrange(0, 20 * n * V + 1)]))
            for p in rng.sample(POINTS, rng.randint(1, len(POINTS)))}
    return {"rows": rows, "n": n, "V": V, "C": C, "chunk": chunk}


# --- live_by_category: timelines and their replay ----------------------------------------------


def timelines():
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


def replayed(events, cats):
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


# --- self_time_by_name: nested intervals and their brute force -----------------------------------


def self_reference(intervals) -> dict:
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
