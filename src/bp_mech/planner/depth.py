"""A deep model's plan from three shallow ones: the step's memory events extrapolated in depth, exactly.

A decoder stack repeats one block. Traced at depths ``a``, ``a + p`` and ``a + 2p`` (``p``: the strategy's
period, 2 for checkpoint-every2, else 1), a step's storage events (the log ``planner.shallow.recording`` keeps:
each storage born and freed, each operator's end, each phase opened and stage marked) differ in a regular way:
between two marks, depth ``a + p`` is depth ``a`` with units of operators inserted (a block's forward, its
backward, an optimizer's per-parameter operators) and the rest kept, each kept operator's bytes grown by a
constant step (a foreach operator over all the parameters). ``extended`` finds that structure from depths
``a`` and ``a + p``, accepts it only where it predicts depth ``a + 2p`` event for event, and then writes the step
at the full depth ``L`` (``L = a + n p``) and replays it as the tracker would: each stage's bytes per class,
each phase's first peak, the host bytes at each mark, the sharded kinds and their most at once. The replay of
depth ``a`` itself must give depth ``a``'s tracked ledger, else nothing is extrapolated. Where any of this
fails (a model whose layers differ, a frozen-layer pattern, an event that does not repeat), the caller traces
at full depth: the result is the full trace's ledger to the byte (tests/planner/test_depth.py), in the time
of three shallow traces.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib

import numpy as np

from bp_mech.ledger_table import CLASSES, STAGES, Counts, Ledger

COLS = len(CLASSES) + 5  # classes, 512-rounded bytes, gathered / collective (by final kind), the same as they grow
ROUNDED, GATHERED, COLLECTIVE, GROWN = len(CLASSES), len(CLASSES) + 1, len(CLASSES) + 2, len(CLASSES) + 3
# the shallowest depth every validated family steps evenly from; from depth 1, whose first block is also its
# last, most do (three shallower traces) and some do not (bloom; any model under FSDP2): ``planner.shallow.tries``
SMALLEST = 2


def depths(layers: int, period: int, smallest: int = SMALLEST) -> tuple[int, int, int] | None:
    """The three depths traced for a stack of ``layers`` at ``period``, from ``smallest`` up (None: too shallow
    to gain)."""
    a = smallest + (layers - smallest) % period
    return (a, a + period, a + 2 * period) if layers > a + 2 * period else None


def shallow(config, layers: int):
    """``config`` with ``layers`` decoder blocks, or None where its layers are not all alike (a per-layer list
    whose entries differ, e.g. alternating attention types)."""
    text = config.get_text_config()
    n = text.num_hidden_layers
    out = copy.deepcopy(config)
    t = out.get_text_config()
    for k, v in vars(text).items():
        if isinstance(v, (list, tuple)) and len(v) == n and n > 1:
            if any(x != v[0] for x in v):
                return None
            setattr(t, k, type(v)(v[:layers]))
    t.num_hidden_layers = layers
    return out


def rows(tr) -> list[tuple]:
    """The tracker's log as rows ``(tag, numbers)``: one row per operator's end, phase opened and mark; its
    numbers are what changed since the row before (bytes per class by the storages' final labels, 512-rounded,
    gathered and collective by final kind, the same as they grow), the most the growing kinds rose within
    that gap, and a mark's host bytes."""
    idx = {c: i for i, c in enumerate(CLASSES)}
    kind, grown = getattr(tr, "kind", {}), set()
    d, top, out = [0] * COLS, [0, 0], []
    for item in tr.log:
        t = item[0]
        if t in "BFG":
            s = item[1]
            n = tr.nbytes[s]
            if t == "G":
                grown.add(s)
                j = GROWN + (kind[s] == "collective")
                d[j] += n
                top[j - GROWN] = max(top[j - GROWN], d[j])
                continue
            sign = 1 if t == "B" else -1
            d[idx[tr.label[s]]] += sign * n
            d[ROUNDED] += sign * -(-n // 512) * 512
            if s in kind:
                d[GATHERED + (kind[s] == "collective")] += sign * n
            if t == "F" and s in grown:
                d[GROWN + (kind[s] == "collective")] -= n
            continue
        out.append((item[:2] if t == "M" else item, (*d, *top, item[2] if t == "M" else 0)))
        d, top = [0] * COLS, [0, 0]
    return out


def _segments(rs):
    """Runs of operator rows, each phase-opening or mark row a segment of its own."""
    out, run = [], []
    for r in rs:
        if r[0][0] == "O":
            run.append(r)
        else:
            out += [run, [r]]
            run = []
    return out + [run]


def _numbers(rows) -> np.ndarray:
    return np.array([r[1] for r in rows], dtype=np.int64).reshape(len(rows), -1)


def _align(sa, sb):
    """``sb`` against ``sa``: ``[(inserted?, i1, i2, j1, j2), ...]`` (rows ``sa[i1:i2]`` kept as ``sb[j1:j2]``,
    or ``sb[j1:j2]`` inserted), rows matched whole first, then by their tags alone where their numbers
    changed; None where ``sb`` lost rows of ``sa``."""
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, sa, sb, autojunk=False).get_opcodes():
        if op == "replace":
            ta, tb = [r[0] for r in sa[i1:i2]], [r[0] for r in sb[j1:j2]]
            inner = difflib.SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes()
            out += [(o == "insert", i1 + k1, i1 + k2, j1 + m1, j1 + m2) if o in ("equal", "insert") else None
                    for o, k1, k2, m1, m2 in inner]
        else:
            out.append((op == "insert", i1, i2, j1, j2) if op in ("equal", "insert") else None)
    return None if None in out else out


def _grown(sa, sb, sc):
    """How one segment grows from depth a to a + p to a + 2p: ``sb`` as ``sa`` with units of rows inserted (a
    block's forward, its backward, an optimizer's per-parameter operators), ``sc`` with each unit twice, the
    rows of ``sa`` kept in order with numbers that step by the same amount each time (a foreach operator over
    all the parameters). The pieces ``[(unit?, rows, step), ...]``, else None."""
    pieces, at, aligned = [], 0, _align(sa, sb)  # at: where in sc the next piece starts
    if aligned is None:
        return None
    for unit, i1, i2, j1, j2 in aligned:
        if unit:
            rows = sb[j1:j2]
            if sc[at:at + 2 * len(rows)] != rows + rows:
                return None
            pieces.append((True, rows, None))
            at += 2 * len(rows)
            continue
        x, y, z = sa[i1:i2], sb[j1:j2], sc[at:at + i2 - i1]
        if [r[0] for r in z] != [r[0] for r in x]:
            return None
        a, b, c = _numbers(x), _numbers(y), _numbers(z)
        if not np.array_equal(c - b, b - a):
            return None
        pieces.append((False, x, b - a))
        at += i2 - i1
    return pieces if at == len(sc) else None


def structure(ra, rb, rc):
    """How each segment (``_segments``) grows with depth (``_grown``'s pieces); None where one does not."""
    sa, sb, sc = _segments(ra), _segments(rb), _segments(rc)
    if not len(sa) == len(sb) == len(sc):
        return None
    out = [_grown(x, y, z) for x, y, z in zip(sa, sb, sc)]
    return None if any(p is None for p in out) else out


def unroll(parts, n: int) -> list[tuple]:
    """The rows at ``n`` periods past depth a."""
    out = []
    for pieces in parts:
        for unit, rows, step in pieces:
            if unit:
                out += rows * n
            else:
                out += [(r[0], tuple(int(v) for v in q)) for r, q in zip(rows, _numbers(rows) + n * step)]
    return out


@dataclasses.dataclass
class Replay:
    """What the tracker would hold after the rows: the marks' and the phases' first peaks' numbers, the host
    bytes at each mark, and the most bytes of each growing kind at once."""

    marks: dict  # stage -> numbers (cumulative)
    peaks: dict  # phase -> numbers at its first peak
    host: dict  # stage -> host bytes
    most: dict  # gathered / collective -> most bytes at once


def replay(rs) -> Replay:
    tags = [r[0] for r in rs]
    nums = np.array([r[1] for r in rs], dtype=np.int64).reshape(len(rs), -1)
    total = np.cumsum(nums[:, :COLS], axis=0)
    current = total[:, :len(CLASSES)].sum(axis=1)
    marks, host, best = {}, {}, {}
    for i, t in enumerate(tags):
        if t[0] == "M":
            marks[t[1]], host[t[1]] = total[i], int(nums[i, -1])
        elif t[0] == "S" or t[2]:  # a phase opened, or an operator with outputs: the tracker's peak checks
            if t[1] not in best or current[i] > current[best[t[1]]]:
                best[t[1]] = i
    before = np.vstack([np.zeros((1, COLS), dtype=np.int64), total[:-1]])
    most = {k: int(max(0, (before[:, GROWN + j] + nums[:, COLS + j]).max(initial=0)))
            for j, k in enumerate(("gathered", "collective"))}
    return Replay(marks, {p: total[i] for p, i in best.items()}, host, most)


def snapshots(r: Replay) -> dict:
    """The tracker's snapshots (``planner.shard.PEAKS``): each stage's numbers and the forward's peak."""
    out = {x: r.marks[x] for x in ("load", "forward", "backward", "zero_grad")}
    out.update(backward_peak=r.peaks["backward"], forward_peak=r.peaks["forward"],
               optimizer_peak=r.peaks["optimizer"] if "optimizer" in r.peaks else r.marks["backward"])
    return out


def ledger(r: Replay, like: Ledger, counts: Counts | None) -> Ledger:
    """The ``Ledger`` the replay gives, its other fields as ``like``'s (the depth-a trace) and ``counts``."""
    snap = snapshots(r)
    return dataclasses.replace(
        like, stages={x: dict(zip(CLASSES, map(int, snap[x][:len(CLASSES)]))) for x in STAGES},
        host=dict(r.host), forward_peak=int(r.peaks["forward"][:len(CLASSES)].sum()),
        rounded={x: int(snap[x][ROUNDED]) for x in STAGES}, counts=counts)


def counts_at(ca: Counts, cb: Counts, cc: Counts, n: int) -> Counts | None:
    """The counts at ``n`` periods past depth a, where they step evenly (else None)."""
    if ca is None:
        return None if cb is not None or cc is not None else ca
    a, b, c = (dataclasses.astuple(x) for x in (ca, cb, cc))
    if any(z - y != y - x for x, y, z in zip(a, b, c)):
        return None
    return Counts(*(x + n * (y - x) for x, y in zip(a, b)))


def extended(traced, n: int):
    """The ledger (or rank ledger) ``n`` periods past depth a, from the three shallow ``traced`` results
    ((ledger, rows) at a, a + p, a + 2p); None where the step does not repeat so."""
    from bp_mech.planner.shard import PEAKS, RankLedger

    (la, ra), (lb, rb), (lc, rc) = traced
    parts = structure(ra, rb, rc)
    rank = isinstance(la, RankLedger)
    base = [x.ledger if rank else x for x in (la, lb, lc)]
    counts = counts_at(*(x.counts for x in base), n)
    if parts is None or (counts is None and base[0].counts is not None) or \
            any((x.updates, x.skipped) != (base[0].updates, base[0].skipped) for x in base):
        return None

    def make(r: Replay, c):
        led = ledger(r, base[0], c)
        if not rank:
            return led
        snap = snapshots(r)
        return RankLedger(led, la.shard, la.gpus, {x: int(snap[x][GATHERED]) for x in PEAKS},
                          {x: int(snap[x][COLLECTIVE]) for x in PEAKS},
                          {x: dict(zip(CLASSES, map(int, snap[x][:len(CLASSES)]))) for x in PEAKS}, r.most)

    if make(replay(ra), base[0].counts) != la:  # the replay must give the traced depth back
        return None
    return make(replay(unroll(parts, n)), counts)
