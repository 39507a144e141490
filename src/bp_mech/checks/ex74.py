"""Checks of exercises/ex74_profiling.py (never against the answer file).

* ``predicted_saving``: a brute-force maximum over the stages written here, on hand-made ledgers
  (the peak that moves, an added line, a remedy that costs) and on random ones;
* ``chunked_loss_changes``: the ledger of a real chunked-loss step, measured. Small Qwen2 models
  (tied and untied embeddings, one chunk and several) run one plain and one chunked-loss step
  (``bp_mech.chunked_loss`` through ``bp_mech.bench.strategy``) with every storage tracked
  (``bp_mech.bench.lifecycle``); the plain ledger plus the learner's changes must give the chunked
  step's ledger. The rule leaves out per-token and (chunk, hidden)-sized temporaries, so each line
  and total may differ by ``CHUNK_TOL`` of the plain peak;
* ``live_by_category``: ``torch.profiler``'s own memory timeline (``MemoryProfileTimeline``'s
  ``_coalesce_timeline``) of a real training step (an MLP with AdamW, profiled with
  ``profile_memory``), on the same microsecond clock; bytes must match exactly.
"""

import functools
import random

from bp_mech.checks.common import call

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
# (hidden, vocab, batch, seq, chunk, tied): several chunks with two chunks' logits the larger moment; one
# chunk for all tokens (untied); several chunks with one chunk's dz^T h product the larger moment
CHUNK_CASES = [(16, 1024, 2, 48, 24, True), (16, 768, 1, 40, 64, False), (32, 2048, 2, 32, 16, True)]


@functools.lru_cache(maxsize=None)
def _measured(case):
    """(plain rows, chunked rows) of one real step each, every storage tracked (tracked-cpu)."""
    from transformers import Qwen2Config

    from bp_mech.bench.lifecycle import ConfigWorkload, Session
    from bp_mech.projects.diagnosis import ledger_rows
    from bp_mech.bench.strategy import PLAIN, Strategy

    C, V, B, T, chunk, tied = case
    cfg = Qwen2Config(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=tied, max_position_embeddings=256,
                      use_cache=False)
    session = Session(ConfigWorkload(cfg, B, T), "cpu")
    return ledger_rows(session.ledger(PLAIN)), ledger_rows(session.ledger(Strategy(chunked_loss=chunk)))


def check_chunked_loss_changes(m):
    for case in CHUNK_CASES:
        C, V, B, T, chunk, tied = case
        plain, chunked = _measured(case)
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
    want = [dict(parameter=64), dict(parameter=64, activation=32, autograd_detail=16),
            dict(parameter=64, activation=32, gradient=16), dict(parameter=64, gradient=16, unknown=8),
            dict(parameter=64)]
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


@functools.lru_cache(maxsize=1)
def _profiled_timeline():
    """A real step (MLP, AdamW foreach) under the profiler: (events, categories) in the exercise's format on a
    microsecond clock, and torch's own coalesced timeline (times, {category: bytes} per time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline, TensorKey

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
    return events, cats, times, [{names[i]: v for i, v in enumerate(row) if i} for row in sizes]


def check_live_by_category__profiled_step(m):
    events, cats, times, ref = _profiled_timeline()
    _compare(m, events, cats, times, ref, "the memory timeline of a profiled training step (MLP + AdamW), against "
                                          "torch.profiler's own")


CHECKS = [check_predicted_saving__classic_cases, check_predicted_saving__random, check_chunked_loss_changes,
          check_live_by_category__hand_made, check_live_by_category__profiled_step]
