"""Checks of exercises/ex73_baseline.py: one declaration per function (``engine.Contract``).

References: Accelerate's own sharding (``accelerate.data_loader.BatchSamplerShard`` with
``split_batches=True``, the rows each process of ``accelerate launch`` gets), N / P with N the target count of
the whole update, float64 autograd of the per-sequence mean over the whole update against the ranks'
averaged gradient of sum w S (DDP's mean by hand), and for the prediction a count of each rank's targets
after Accelerate's sharding; never the answer file. The ranks are simulated: each in its own thread, with an
``all_reduce`` that sums among the threads (``ranks``), counted, and failing on demand (a collective that
raises). The domains are the docstrings': every E, P and rank, P = 1, ranks and micro-batches of uneven
target counts, a rank without any target, rows without target, a fully padded row, P < 1, E % P != 0, a rank
outside [0, P), trailing shapes (E,) and (E, 2, 3). The engine derives the rest: inputs unchanged, strided
views, dtypes, exact types, state restored.
"""

import threading

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed, describe
from bp_mech.checks.engine import Contract, Raises, checks

V, C, T = 13, 6, 7  # vocab, width, sequence length
SEEDS, VIEWS = st.integers(0, 2**16), st.sampled_from(("slice", "transpose"))


def accelerate_rows(E: int, rank: int, P: int) -> list:
    """The rows of a batch of E that Accelerate's ``split_batches=True`` gives process ``rank`` of P."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    return next(iter(BatchSamplerShard(BatchSampler(SequentialSampler(range(E)), E, False), num_processes=P,
                                       process_index=rank, split_batches=True)))


# --- shard_rows --------------------------------------------------------------------------------


def _shard(c):
    g, e = torch.Generator().manual_seed(c["seed"]), c["E"]
    return {"batch": {"input_ids": torch.randint(0, V, (e, T), generator=g),
                      "weights": torch.randn(e, generator=g, dtype=torch.float64),
                      "hidden": torch.randn(e, 2, 3, generator=g, dtype=torch.float64)},
            "rank": c["rank"], "world_size": c["P"]}


def _shard_ref(batch, rank, world_size):
    e = batch["input_ids"].shape[0]
    if world_size < 1 or e % world_size or not 0 <= rank < world_size:
        return Raises(ValueError, f"rank {rank} of {world_size} processes over {e} rows")
    rows = accelerate_rows(e, rank, world_size)
    return ({key: v[rows] for key, v in batch.items()},)


def _shard_cases(P, b):
    return st.fixed_dictionaries({"seed": SEEDS, "E": st.just(P * b), "P": st.just(P), "view": VIEWS,
                                  "rank": st.sampled_from([*range(P)] * 2 + [P, P + 1, -1])})


def _scase(seed, E, P, rank):
    return {"seed": seed, "E": E, "P": P, "rank": rank}


SHARD = Contract(
    "shard_rows", _shard, _shard_ref, ("the shard",), returns=dict, dtypes={torch.float32: 1e-7},
    ref_name="Accelerate's split_batches=True rows (BatchSamplerShard)",
    draw=st.tuples(st.integers(1, 4), st.integers(1, 3)).flatmap(lambda pb: _shard_cases(*pb)),
    examples={"": [_scase(3, 8, P, r) for P in (1, 2, 4, 8) for r in range(P)][::2] + [
        _scase(4, 4, P, r) for r, P in ((0, 3), (2, 2), (-1, 2), (0, 0), (0, -2), (4, 4), (5, 4), (-1, 4))]})


# --- the simulated ranks -------------------------------------------------------------------------


class CollectiveError(RuntimeError):
    """What a failing all-reduce raises (a collective that timed out, a rank that died)."""


def ranks(fn, per_rank: list, collective: str = "sum"):
    """``fn(per_rank[r], P, all_reduce)`` for every rank, each in its own thread, with a sum all-reduce among
    the threads (``ThreadAllReduce``, the package's harness: plumbing, not the reference); ``collective``
    "failing": every all-reduce raises ``CollectiveError``.

    Args:
        fn: the graded function; per_rank: each rank's first argument; collective: "sum" or "failing".

    Returns:
        (each rank's result, the all-reduce calls of each rank); the first rank's exception is raised.

    Example:
        >>> ranks(lambda c, P, ar: ar(torch.tensor(c)) / P, [1, 3])[0]
        [tensor(2.), tensor(2.)]
    """
    from bp_mech.projects.baseline_loss import ThreadAllReduce

    P = len(per_rank)
    group, out, calls = ThreadAllReduce(P, timeout_s=5.0), [None] * P, [0] * P

    def rank_main(r):
        op = group.op(r)

        def all_reduce(t):
            calls[r] += 1
            if collective == "failing":
                raise CollectiveError("the all-reduce failed (raised by the check's collective)")
            return op(t)
        out[r] = fn(per_rank[r], P, all_reduce)

    errors = group.run(rank_main)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise CheckFailed(f"{fn.__name__}: the ranks did not all call all_reduce the same number of times (calls "
                          f"per rank {calls})")
    return out, calls


# --- loss_divisor --------------------------------------------------------------------------------


def _divisor(c):
    k = max(len(row) for row in c["counts"])
    return {"local_counts": [[torch.tensor(n) for n in (row + [0] * k)[:k]] for row in c["counts"]],
            "world_size": len(c["counts"]), "collective": c.get("collective", "sum")}


def _divisor_ref(local_counts, world_size, collective):
    if collective == "failing":
        return Raises(CollectiveError, "a failed all-reduce (let the collective's exception propagate)")
    n = sum(int(x) for row in local_counts for x in row)
    return [torch.tensor(n / world_size, dtype=torch.float64)] * world_size, [1] * world_size


def _each_rank(f):
    """The driver: every rank's D, in its own thread, and the all-reduce calls of each rank."""
    def run(local_counts, world_size, collective):
        out, calls = ranks(f, local_counts, collective)
        for r, d in enumerate(out):
            if not (torch.is_tensor(d) and d.dim() == 0 and d.is_floating_point()):
                counts = [[int(x) for x in c] for c in local_counts]
                raise CheckFailed(f"loss_divisor: rank {r} returned {describe(d)}, expected a 0-dim floating-point "
                                  f"tensor at P={world_size}, rank counts per micro-batch {counts}")
        return out, calls
    return run


DIVISOR = Contract(
    "loss_divisor", _divisor, _divisor_ref, ("D per rank", "all_reduce calls per rank"), use=_each_rank,
    ref_name="N / P (N: the target count of the whole update, on all ranks), one all-reduce",
    tol=float(torch.finfo(torch.float32).eps),  # one rounding of N / P, in float32 at least
    note=lambda c: f"rank counts per micro-batch {c['counts']}", draw=st.fixed_dictionaries({"counts": st.lists(
        st.lists(st.integers(0, 40), min_size=1, max_size=3), min_size=1, max_size=4).filter(
        lambda c: sum(map(sum, c)) > 0)}),
    examples={"": [{"counts": c} for c in ([[30, 2]], [[31], [40]], [[5, 9], [0, 0], [7, 1], [3, 2]],
                                           [[0], [11], [1]])] + [{"counts": [[3], [5]], "collective": "failing"}]})


# --- sequence_weights (variant) --------------------------------------------------------------------


class RowLoss(torch.nn.Module):
    """The check's float64 model: each rank's input ids per micro-batch, and S_s = a row's summed token loss of
    tanh(emb[ids]) @ head.T (the gradient through which the weights are checked)."""

    def __init__(self, seed: int, ids: list):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, C, generator=g, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(V, C, generator=g, dtype=torch.float64))
        self.ids = ids  # ids[r][j]: rank r's input ids of micro-batch j

    def forward(self, ids, labels):
        z = torch.tanh(self.emb[ids]) @ self.head.T  # (B, T, V)
        ce = F.cross_entropy(z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100,
                             reduction="none")
        return ce.reshape(len(ids), T - 1).sum(1)  # S_s, (B,)


def _labels(g, pads) -> torch.Tensor:
    y = torch.randint(1, V, (len(pads), T), generator=g)
    for i, p in enumerate(pads):
        if p:
            y[i, T - p:] = -100
    return y


def _sequence(c):
    g, P, k, pads = torch.Generator().manual_seed(c["seed"]), c["P"], c["k"], c["pads"]
    micro = [(torch.randint(0, V, (8, T), generator=g), _labels(g, pads[j:] + pads[:j])) for j in range(k)]
    b = 8 // P
    shard = lambda t, r: t[r * b:(r + 1) * b]  # noqa: E731 (rank r's contiguous rows, as shard_rows)
    return {"local_labels": [[shard(y, r) for _, y in micro] for r in range(P)], "world_size": P,
            "collective": "sum", "model": RowLoss(c["seed"], [[shard(x, r) for x, _ in micro] for r in range(P)])}


def _sequence_ref(local_labels, world_size, collective, model):
    ids = [x for row in model.ids for x in row]
    labels = [y for row in local_labels for y in row]
    n = torch.cat([(y[:, 1:] != -100).sum(1) for y in labels])
    if not (n > 0).any():
        return Raises(ValueError, "no row of any rank has a target (R = 0)")
    S = torch.cat([model(x, y) for x, y in zip(ids, labels)])
    params = list(model.parameters())
    return (torch.autograd.grad((S[n > 0] / n[n > 0]).sum() / int((n > 0).sum()), params),
            [torch.zeros(int((y[:, 1:] != -100).sum(1).eq(0).sum()), dtype=torch.float64) for y in labels],
            [1] * world_size)


def _ddp(f):
    """The driver: the ranks' weights (each rank in its thread), then DDP's mean over the ranks of the gradient
    of sum w S, the weights of the rows without a target, and the all-reduce calls of each rank."""
    def run(local_labels, world_size, collective, model):
        out, calls = ranks(f, local_labels, collective)
        params, got, empty = list(model.parameters()), [0, 0], []
        for r, w in enumerate(out):
            k, b = len(local_labels[r]), len(local_labels[r][0])
            if type(w) is not list or len(w) != k or not all(torch.is_tensor(x) and x.shape == (b,)
                                                                  and x.dtype == torch.float64 for x in w):
                raise CheckFailed(f"sequence_weights: rank {r} returned {describe(w)}, expected a list of {k} float64 "
                                  f"tensors of shape ({b},) at P={world_size}, k={k}")
            loss = sum((x * model(ids, y)).sum() for x, ids, y in zip(w, model.ids[r], local_labels[r]))
            got = [a + d / world_size for a, d in zip(got, torch.autograd.grad(loss, params))]  # DDP's mean
            empty += [x[(y[:, 1:] != -100).sum(1) == 0].detach() for x, y in zip(w, local_labels[r])]
        return tuple(got), empty, calls
    return run


# padded tails of a micro-batch of 8 rows (micro-batch j rotates them by j): uneven ranks, rows with one target
# (a tail of T - 2), rows without target (T - 1 or T), a rank without any target
_PADS = ([0] * 8, [0, 7, 1, 6, 0, 0, 2, 1], [T, T, 0, 3, T - 1, 1, 0, 2], [T, T, T, T, 0, 1, 2, 3],
         [1, 3, 5, 0, 0, 0, T, 2], [T - 2, 0, T - 2, 4, T, 1, T - 2, T - 2])


SEQUENCE = Contract(
    "sequence_weights", _sequence, _sequence_ref, ("the ranks' averaged gradient", "the weights of rows without "
                                                   "a target", "all_reduce calls per rank"), use=_ddp,
    ref_name="float64 autograd of the per-sequence mean over the whole update (rows without target: 0)",
    note=lambda c: f"P={c['P']}, k={c['k']}, pads {c['pads']}", draw=st.fixed_dictionaries({
        "seed": SEEDS, "P": st.sampled_from((1, 2, 4)), "k": st.integers(1, 3), "pads": st.sampled_from(_PADS),
        "view": VIEWS}),
    examples={"": [{"seed": s, "P": P, "k": k, "pads": p} for s, P, k, p in (
        (1, 2, 2, _PADS[1]), (2, 4, 1, _PADS[2]), (3, 2, 3, _PADS[3]), (4, 1, 2, _PADS[4]), (6, 2, 2, _PADS[5]),
        (5, 4, 2, [T] * 8))]})


# --- the prediction ----------------------------------------------------------------------------------


def measured_rank_tokens(pads, seq, world_size) -> list:
    """Each rank's target tokens after Accelerate's sharding of the padded batch (labels -100 on the tails)."""
    labels = torch.ones(len(pads), seq, dtype=torch.long)
    for i, p in enumerate(pads):
        if p:
            labels[i, seq - p:] = -100
    return [int((labels[accelerate_rows(len(pads), r, world_size)][:, 1:] != -100).sum())
            for r in range(world_size)]


PREDICT = Contract(
    "predict_rank_tokens", lambda c: {"pads": [min(p, c["seq"]) for p in c["pads"]], "seq": c["seq"],
                                      "world_size": c["P"]},
    lambda pads, seq, world_size: (measured_rank_tokens(pads, seq, world_size),), ("the prediction",), returns=list,
    ref_name="the count after Accelerate's sharding", note=lambda c: "exact: counts",
    draw=st.tuples(st.sampled_from((1, 2, 4)), st.integers(1, 3)).flatmap(lambda pb: st.fixed_dictionaries({
        "P": st.just(pb[0]), "seq": st.integers(2, 9), "pads": st.lists(st.integers(0, 9), min_size=pb[0] * pb[1],
                                                                        max_size=pb[0] * pb[1])})),
    examples={"": [{"P": 2, "seq": 6, "pads": [0, 6, 1, 3]}, {"P": 4, "seq": 5, "pads": [5, 0, 2, 4, 1, 0, 3, 5]},
                   {"P": 1, "seq": 2, "pads": [0, 1, 2]}]})

CHECKS = checks(SHARD, DIVISOR, SEQUENCE, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex73.check_loss_divisor, ...
