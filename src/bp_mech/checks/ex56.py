"""Checks of exercises/ex56_continual_pretrain.py: one declaration per function (``engine.Contract``).

References: a float64 sum over target positions, written out here, on bigram models whose token losses range
widely (logits of scale 1 and 1e3, contiguous or laid out as a slice or a transpose view) and on batches of
different target counts (right padding, a hole in the middle, a batch with no target at all); a model that
raises (its exception must propagate). The training state against the check's own uninterrupted run
(``ex56_measure``). The replay mix against a reference drawn row by row from the docstring's rule
(floor((g + 1) q) > floor(g q), integer arithmetic) on copies of the two streams, also after resuming a saved
state in a stream of other seeds; bad arguments raise ValueError. The prediction measured by drawing that
reference mix and counting the tokens that came from the old text (its ids start at ``OLD``). Never the
answer file. The engine derives the rest: inputs unchanged, strided views, exact types, state restored.
"""

import types

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import call
from bp_mech.checks.engine import Contract, Raises, checks
from bp_mech.checks.ex56_measure import fingerprint, same_fingerprint, state_checks  # noqa: F401 (the tests use them)
from bp_mech.checks.properties import assert_type, strided

TOL = 1e-6  # float32 logits, cross-entropy summed in float32 per batch: relative to a float64 reference
OLD = 10_000  # the old text's token ids start here: a row's first id tells its domain
SEEDS = st.integers(0, 2**16)


# --- token_loss --------------------------------------------------------------------------------


class Broken(Exception):
    """What the check's failing model raises."""


class Bigram(torch.nn.Module):
    """logits[b, t] = table[x[b, t]] (token losses from ~0 to ~20 nats at scale 4), returned as a view laid out
    ``how`` ("slice", "transpose") or contiguous; ``broken``: the forward raises ``Broken``."""

    def __init__(self, vocab: int, seed: int, scale: float, how: str = "", broken: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * scale)
        self.how, self.broken = how, broken

    def forward(self, input_ids):
        if self.broken:
            raise Broken("the model failed")
        if torch.is_grad_enabled():
            raise AssertionError("token_loss: the model ran with gradients enabled (evaluate without gradients: "
                                 "torch.no_grad(), no graph kept)")
        z = self.table[input_ids]
        return types.SimpleNamespace(logits=strided(z, self.how) if self.how else z)


def _batches(vocab: int, seed: int, layout: str, empty: bool):
    """``layout`` "wide": 3 batches with 16, 19 and 2 targets (right padding and a hole); "small": 2 batches;
    ``empty``: a batch with no target at all (it adds nothing to the sum and nothing to the count)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    shapes = ((2, 12, (0, 3)), (3, 12, (9, 0, 5)), (1, 7, (4,))) if layout == "wide" else ((2, 6, (2, 0)),
                                                                                          (3, 5, (2, 0, 0)))
    for rows, T, pads in shapes:
        x = torch.randint(0, vocab, (rows, T), generator=g)
        y = x.clone()
        for r, p in enumerate(pads):
            if p:
                y[r, T - p:] = -100
        if layout == "wide":
            y[0, 2] = -100  # a hole: position 1 has no target
        out.append({"input_ids": x, "labels": y})
    if empty:
        x = torch.randint(0, vocab, (2, 4), generator=g)
        out.insert(1, {"input_ids": x, "labels": torch.full_like(x, -100)})
    return out


def _loss(c):
    vocab = 11 if c["layout"] == "wide" else 7
    model = Bigram(vocab, c["seed"], c.get("scale", 4.0), c.get("logits", ""), c.get("broken", False))
    return {"model": model.train(), "batches": _batches(vocab, c["seed"] + 10, c["layout"], c.get("empty", False))}


def reference_token_loss(model, batches) -> float:
    """The mean next-token loss per target token, float64, target by target: ``token_loss``'s reference.

    Args:
        model: called as ``model(input_ids=...)``; batches: dicts of ``input_ids`` and ``labels``.

    Returns:
        the loss, a float.
    """
    if getattr(model, "broken", False):
        return Raises(Broken, "a model that raises (let its exception propagate; do not swallow it)")
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logp = torch.log_softmax(model(input_ids=b["input_ids"]).logits.double(), dim=-1)
            for i, t in (b["labels"][:, 1:] != -100).nonzero().tolist():
                total -= logp[i, t, int(b["labels"][i, t + 1])].item()
                count += 1
    return (total / count,)


def _loss_note(c):
    return ", ".join(x for x in (f"logits of scale {c.get('scale', 4.0):g}", c.get("logits") and
                                 f"logits as a {c['logits']} view", c.get("empty") and "an all-ignored batch") if x)


TOKEN_LOSS = Contract(
    "token_loss", _loss, reference_token_loss, ("the loss",), returns=float, tol=TOL, note=_loss_note,
    ref_name="a float64 sum over target positions / their count",
    draw=st.fixed_dictionaries({"seed": SEEDS, "layout": st.sampled_from(("small", "wide")),
                                "scale": st.sampled_from((1.0, 1e3)),
                                "logits": st.sampled_from(("", "slice", "transpose")),
                                "empty": st.booleans(), "view": st.sampled_from(("slice", "transpose"))}),
    examples={"": [{"seed": 0, "layout": "wide"}, {"seed": 1, "layout": "wide"},
                   {"seed": 2, "layout": "small", "scale": 1e3, "logits": "transpose", "empty": True},
                   {"seed": 3, "layout": "small", "scale": 1.0, "logits": "slice", "empty": True},
                   {"seed": 0, "layout": "small", "broken": True}]})


# --- the replay mix ------------------------------------------------------------------------------


def streams(seed_new: int, seed_old: int, T: int):
    """A new-domain and an old-domain ``TextStream`` (batch 1, seq T; the old text's ids start at ``OLD``)."""
    from bp_mech.continual_data import TextStream

    return TextStream(torch.arange(200), 1, T, seed_new), TextStream(torch.arange(OLD, OLD + 200), 1, T, seed_old)


def reference_batches(B, replay, period, n, seeds, T, skip=0):
    """Batches ``skip`` .. ``n - 1`` drawn row by row by the docstring's rule, from fresh copies of the streams:
    [(input_ids, replayed flags)]."""
    new, old = streams(*seeds, T)
    out = []
    for k in range(n):
        rows, flags = [], []
        for g in range(k * B, (k + 1) * B):
            is_old = (g + 1) * replay // period > g * replay // period
            rows.append((old if is_old else new).next()["input_ids"][0])
            flags.append(is_old)
        out.append((torch.stack(rows), torch.tensor(flags)))
    return out[skip:]


def _mix(c):
    return {"batch": c["B"], "replay": c["replay"], "period": c["period"], "batches": c["n"], "seed": c["seed"],
            "resume": c.get("resume", False)}


def _mix_ref(batch, replay, period, batches, seed, resume):
    if batch < 1 or period < 1 or not 0 <= replay <= period:
        return Raises(ValueError, f"batch {batch}, replay {replay} of every {period} rows")
    want = reference_batches(batch, replay, period, batches + 3 * resume, (seed, seed + 1), 4, batches * resume)
    return [x for x, _ in want], [x for x, _ in want], [f for _, f in want], batches + 3 * resume


def _drawn(stream, k, at):
    got = call("ReplayStream.next", stream.next, at=at)
    r = got["replayed"]
    assert torch.is_tensor(r) and r.dtype == torch.bool, (
        f"ReplayStream: 'replayed' is {r!r:.60}, expected a bool tensor at {at}, batch {k}")
    return got


def _replay_driver(cls):
    """The driver: ``batches`` batches drawn; ``resume``: then a state_dict, 3 more batches, and a stream of other
    seeds loaded from the state draws them again. The batches' input_ids, labels, replayed flags and position."""
    def run(batch, replay, period, batches, seed, resume):
        at = f"batch {batch}, replay {replay} of every {period} rows"
        s = cls(*streams(seed, seed + 1, 4), batch, replay, period)
        got = [_drawn(s, k, at) for k in range(batches)]
        if resume:
            at = f"{at}, state after {batches} batches"
            sd = call("ReplayStream.state_dict", s.state_dict, at=at)
            assert_type("ReplayStream.state_dict", "the state", sd, dict, at)
            assert_type("ReplayStream.state_dict", "position", sd.get("position"), int, at)
            kept = fingerprint(sd)
            for k in range(3):
                s.next()
            assert same_fingerprint(kept, fingerprint(sd)), (
                f"ReplayStream.state_dict: the returned state changed when the stream drew on (return a copy) at {at}")
            s = cls(*streams(seed + 7, seed + 10, 4), batch, replay, period)  # other seeds
            call("ReplayStream.load_state_dict", s.load_state_dict, sd, at=at)
            got = [_drawn(s, k, at) for k in range(3)]
            assert same_fingerprint(kept, fingerprint(sd)), (
                f"ReplayStream.load_state_dict: the loaded state changed when the resumed stream drew on (copy it; "
                f"keep no reference) at {at}")
        return ([b["input_ids"] for b in got], [b["labels"] for b in got], [b["replayed"] for b in got],
                s.position)
    return run


def _mix_cases(resume):
    return st.fixed_dictionaries({"B": st.integers(0, 5), "period": st.integers(0, 6), "replay": st.integers(-1, 7),
                                  "n": st.integers(0 + resume, 4), "seed": st.integers(0, 99),
                                  "resume": st.just(resume)})


def _case(B, replay, period, n, seed=0, resume=False):
    return {"B": B, "replay": replay, "period": period, "n": n, "seed": seed, "resume": resume}


REPLAY = Contract(
    "ReplayStream", _mix, _mix_ref, ("the batches' input_ids", "the batches' labels", "'replayed'", "position"),
    use=_replay_driver, ref_name="a mix drawn row by row by floor((g + 1) q) > floor(g q)", tol=0.0,
    draw=_mix_cases(False), examples={
        "": [_case(2, 1, 3, 4), _case(4, 2, 5, 3, 1), _case(1, 0, 1, 3), _case(3, 3, 3, 2), _case(5, 2, 3, 2, 7),
             _case(5, 3, 11, 12, 2), _case(10, 7, 10, 10, 3),  # a float q = r / p: floor(55 q) = 14, floor(90 q) = 62
             _case(64, 3, 4, 8, 4),  # counts above 256: ints compared by value, not identity
             _case(2, 4, 3, 1), _case(2, -1, 3, 1), _case(2, 0, 0, 1), _case(0, 1, 2, 1)],
        "resume": [_case(B, r, p, n, s, True) for B, r, p, n, s in (
            (2, 1, 3, 1, 0), (3, 2, 5, 2, 4), (1, 1, 4, 3, 9), (4, 3, 4, 1, 2), (5, 1, 6, 2, 5), (2, 0, 2, 2, 1),
            (1, 2, 2, 1, 3), (3, 1, 2, 4, 8))]})


def _predict_ref(updates, batch, seq, replay, period):
    batches = reference_batches(batch, replay, period, updates, (0, 1), seq)
    return (sum(int((x >= OLD).sum()) for x, _ in batches),)  # tokens that came from the old text


PREDICT = Contract(
    "predict_replay_tokens", lambda c: {k: c[k] for k in ("updates", "batch", "seq", "replay", "period")},
    _predict_ref, ("the prediction",), returns=int, tol=0.0,
    ref_name="the old-domain tokens counted in a drawn reference mix",
    draw=st.fixed_dictionaries({"updates": st.integers(1, 9), "batch": st.integers(1, 6), "seq": st.integers(2, 8),
                                "period": st.integers(1, 7)}).flatmap(
        lambda c: st.fixed_dictionaries({**{k: st.just(v) for k, v in c.items()},
                                         "replay": st.integers(0, c["period"])})),
    examples={"": [{"updates": u, "batch": b, "seq": t, "replay": r, "period": p} for u, b, t, r, p in (
        (1, 2, 4, 1, 3), (3, 4, 4, 2, 5), (5, 3, 2, 1, 2), (7, 1, 3, 3, 7), (2, 6, 5, 0, 4), (4, 5, 3, 4, 4),
        (9, 3, 2, 2, 3), (6, 2, 8, 5, 6), (1, 1, 2, 1, 1), (8, 4, 3, 3, 7), (3, 5, 6, 1, 4), (2, 3, 7, 2, 7),
        (11, 5, 2, 3, 11), (9, 10, 2, 7, 10))]})  # n q with a float q = r / p: 14.999... and 62.999...


_TL, = checks(TOKEN_LOSS)
CHECKS = [_TL, *state_checks(), *checks(REPLAY, PREDICT)]
globals().update({c.__name__: c for c in CHECKS})
