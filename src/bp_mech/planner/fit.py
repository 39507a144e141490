"""What fits a budget: the largest batch (or sequence) of each strategy, from a few traces.

A step's bytes at each lifecycle stage grow with the batch B exactly affinely (every activation, the
logits and the batch itself are B x something; parameters, gradients and optimizer states do not
change), and with the sequence T affinely under SDPA or quadratically under eager attention (its
(B, H, T, T) scores); a peak inside a phase is the largest of such curves over its operations, which
another operation may hold at another size. So ``largest`` traces
the step at two batch sizes (three sequence lengths), fits each stage's curve exactly, solves for the
largest size whose ``needs`` fits the budget, and then checks the answer with two more traces: the
answer fits and one more (one more micro-batch's worth of rows: the batch must split) does not. Where the
prediction is off (a peak held by another operation; the chunked loss's last chunk, smaller while B T
is under its chunk; the offload's threshold at small sizes), the check steps, then closes in along the line
through the nearest sizes on either side (regula falsi), to the true answer (tests/planner/test_fit.py).
The plan's uses: ``largest_sizes`` (``--batch max`` / ``--seq max``, per row) and ``fits_instead`` (what would
fit when nothing does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bp_mech.bench.strategy import Strategy, parse
from bp_mech.instruments import anatomy

AXES = ("batch", "seq")
REFITS = 3  # predictions from the curves at the last traced sizes before it closes in


@dataclass(frozen=True)
class Fit:
    """The largest size of one axis at which a strategy fits."""

    strategy: str  # its name
    axis: str  # "batch" (at the plan's seq) or "seq" (at the plan's batch)
    size: int | None  # the largest batch or seq that fits (None: not even the smallest)
    needs: int | None  # what it needs there (bytes, with headroom)
    next_needs: int | None  # what one more step of the axis needs (does not fit; None: the axis's limit)
    limit: int  # the axis's upper limit (max_position_embeddings for seq)
    traces: int  # steps traced to find it
    first: int  # the smallest size traced
    first_needs: int  # what it needs there


def reshape(sess, batch: int, seq: int) -> None:
    """Give a fake session a new batch of shape (batch, seq) (random ids, as ``planner.build`` makes them)."""
    vocab = sess.model.config.get_text_config().vocab_size
    with sess.active():
        ids = torch.randint(0, min(256, vocab), (batch, seq))
    sess.batch = {"input_ids": ids, "labels": ids.clone()}


def _curves(xs: list[int], ledgers) -> list[tuple[float, ...]]:
    """Per stage (and the forward's peak), the exact polynomial through the traced points: (a, b) of
    a + b x through two, (a, b, c) of a + b x + c x^2 through three."""
    cols = [[*led.totals().values(), led.forward_peak] for led in ledgers]
    A = torch.tensor([[x**k for k in range(len(xs))] for x in xs], dtype=torch.float64)
    return [tuple(torch.linalg.solve(A, torch.tensor(col, dtype=torch.float64)).tolist()) for col in zip(*cols)]


def _predict(curves, budget_peak: float, unit: int, limit: int) -> int:
    """The largest multiple of ``unit`` up to ``limit`` whose every curve is within ``budget_peak``."""
    def ok(x):
        return all(sum(c * x**k for k, c in enumerate(cv)) <= budget_peak for cv in curves)
    lo, hi = 0, limit // unit  # in units; ok(0) is assumed, ok(hi) tested
    if ok(hi * unit):
        return hi * unit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * unit) else (lo, mid)
    return lo * unit


def largest(sess, s: Strategy, axis: str, budget: int, other: int, limit: int, needs, quadratic: bool = False,
            step=None) -> Fit:
    """The largest ``axis`` ("batch" or "seq") at which ``s`` fits ``budget`` on the fake session ``sess``,
    the other axis held at ``other``; ``limit``: the axis's largest allowed value; ``needs(peak)``: the
    budget a peak needs (``planner.plan.needs``: the allocator's slack, the CUDA context); ``quadratic``: the seq
    axis under eager attention (three traces fit a quadratic); ``step(s) -> Ledger``: how a step is traced
    (default ``sess.ledger``; a sharded plan's rank ledger). Leaves ``sess`` on its last traced shape."""
    if axis not in AXES:
        raise ValueError(f"axis is one of {AXES}, got {axis!r}")
    unit = s.micro_batches if axis == "batch" else 1
    traced: dict[int, int] = {}  # size -> needs
    leds: dict = {}  # size -> ledger

    def trace(x):
        if x not in traced:
            reshape(sess, *((x, other) if axis == "batch" else (other, x)))
            leds[x] = (step or sess.ledger)(s)
            traced[x] = needs(leds[x].peak)
        return leds[x]

    start = unit if axis == "batch" else max(2, min(64, limit // 4))
    if start > limit:
        raise ValueError(f"the smallest {axis} {s.name} takes ({start}) is over the limit {limit}")
    points = [x for x in (start * (i + 1) for i in range(3 if quadratic else 2)) if x <= limit]
    for x in points:
        trace(x)
    if traced[start] > budget:
        return Fit(s.name, axis, None, None, traced[start], limit, len(traced), start, traced[start])
    # the largest peak whose needs fit (needs is increasing in the peak)
    lo_p, hi_p = 0, budget
    while hi_p - lo_p > 1:
        mid = (lo_p + hi_p) // 2
        lo_p, hi_p = (mid, hi_p) if needs(mid) <= budget else (lo_p, mid)
    # predict, trace the prediction and its neighbour, predict again from the curves there (at small sizes
    # another operation may hold a peak than at the answer's), a few times
    for _ in range(REFITS):
        x = max(start, _predict(_curves(points, [leds[p] for p in points]), lo_p, unit, limit)) \
            if len(points) > 1 else start
        near = [y for y in ((x - unit,) if quadratic else ()) + (x, x + unit) if start <= y <= limit]
        if all(y in traced for y in near):
            break
        for y in near:
            trace(y)
        points = near if len(near) == len(points) else points
    good = max(y for y, n in traced.items() if n <= budget)  # (start fits)
    bad = min((y for y, n in traced.items() if n > budget), default=None)
    top = limit // unit * unit
    while bad is None and good < top:  # the prediction was too low: double until one does not fit
        y = min(top, 2 * good // unit * unit)
        trace(y)
        good, bad = (y, None) if traced[y] <= budget else (good, y)
    while bad is not None and bad - good > unit:  # regula falsi: where the line through good and bad crosses
        at = good + (budget - traced[good]) / max(1, traced[bad] - traced[good]) * (bad - good)
        mid = min(bad - unit, max(good + unit, int(at) // unit * unit))
        if mid in traced:  # (the line keeps landing on one side: halve instead)
            mid = (good + bad) // 2 // unit * unit
        trace(mid)
        good, bad = (mid, bad) if traced[mid] <= budget else (good, mid)
    return Fit(s.name, axis, good, traced[good], bad and traced[bad], limit, len(traced), start, traced[start])


@dataclass(frozen=True)
class FitsInstead:
    """What would fit when nothing does."""

    strategy: str  # the leanest strategy
    needs: int  # what it needs at the asked shape
    small_shape: list[int]  # the smallest shape traced: [batch, seq]
    small_needs: int  # what it needs there
    model_state: int  # bytes after backward: parameters, gradients, optimizer state (+ the batch)
    batch: int | None = None  # the largest batch that fits (None: not even the smallest; or a seq answer instead)
    seq: int | None = None  # at batch 1: the largest sequence that fits


BATCH_LIMIT = 2**16  # the largest batch ``largest_sizes`` looks for
SEQ_LIMIT = 2**20  # the largest sequence, for a model without max_position_embeddings


def _eager(sess) -> bool:
    return anatomy.unwrapped(sess.model).config._attn_implementation == "eager"


def largest_sizes(sess, rows, axis: str, batch: int, seq: int, budget: int, needs, step=None) -> list:
    """Per plan row, the largest ``axis`` ("batch" at ``seq``, "seq" at ``batch``) its strategy fits ``budget`` at
    (``largest``: from the exact growth of a few traces, checked: it fits, one more does not); ``needs``:
    ``largest``'s."""
    text = sess.model.config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None) or 0  # (XLNet's -1: none)
    limit = BATCH_LIMIT if axis == "batch" else positions if positions > 0 else SEQ_LIMIT
    return [largest(sess, parse(r.strategy), axis, budget, seq if axis == "batch" else batch, limit, needs,
                    quadratic=axis == "seq" and _eager(sess), step=step) for r in rows]


def fits_instead(sess, batch: int, seq: int, budget: int, leanest, needs, step=None) -> FitsInstead:
    """What would fit when nothing does: the leanest plan row's budget, and the largest batch (at batch 1:
    sequence) its strategy fits at (``largest`` on the plan's fake session: it fits, one more does not)."""
    s, axis = parse(leanest.strategy), "batch" if batch > 1 else "seq"
    if axis == "batch" and batch - 1 < s.micro_batches:  # no smaller batch splits: the same without accumulation
        s = s.replace(micro_batches=1)
    other = seq if axis == "batch" else batch
    f = largest(sess, s, axis, budget, other, (batch if axis == "batch" else seq) - 1, needs,
                quadratic=axis == "seq" and _eager(sess), step=step)
    small = [f.first, other] if axis == "batch" else [other, f.first]
    return FitsInstead(s.name, leanest.needs, small, f.first_needs, leanest.stages["backward"], **{axis: f.size})
