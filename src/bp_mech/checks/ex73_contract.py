"""Contract checks of exercises/ex73_baseline.py, explored (``properties.explore``).

* ``shard_rows``: Accelerate's ``BatchSamplerShard(split_batches=True)`` rows for drawn E, P, rank, on
  contiguous and non-contiguous tensors of several trailing shapes; the batch unmodified; ValueError.
* ``loss_divisor``: N / P for drawn counts (a rank may hold none), the counts unmodified, one all-reduce
  per rank (counted), a failing all-reduce's exception passed through.
* ``sequence_weights`` (variant): float64 autograd of the per-sequence mean over the whole update, against
  the ranks' averaged gradient of sum w S (each rank in its own thread, DDP's mean by hand); weights of
  rows without target exactly 0; labels unmodified; strided labels; ValueError when no row has a target.
* ``predict_rank_tokens``: measured by sharding the batch with Accelerate and counting the targets (exact).
"""

import threading

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.bench.compare import relative_error
from bp_mech.bench.timing import timing_threads
from bp_mech.checks.common import call
from bp_mech.checks.properties import (
    assert_finite,
    assert_type,
    call_unmodified,
    explore,
    strided,
)

V, C, T = 13, 6, 7
TOL = 1e-10  # float64 throughout: the simulated data-parallel gradient agrees with autograd's to rounding


def _accelerate_rows(E: int, rank: int, P: int) -> list:
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    return next(iter(BatchSamplerShard(BatchSampler(SequentialSampler(range(E)), E, False), num_processes=P,
                                       process_index=rank, split_batches=True)))


def check_shard_rows__contract(m):
    call("shard_rows", m.shard_rows, {"x": torch.zeros(4, 2)}, 0, 2, at="rank 0 of 2")  # a stub stops here
    cases = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**16), st.sampled_from(["", "slice",
                                                                                                   "transpose"]))

    def body(case):
        P, b, seed, how = case
        E, g = P * b, torch.Generator().manual_seed(seed)
        batch = {"input_ids": torch.randint(0, V, (E, T), generator=g), "weights": torch.randn(E, generator=g),
                 "hidden": torch.randn(E, 2, 3, generator=g)}
        if how:
            batch = {k: strided(v, how) for k, v in batch.items()}
        for r in range(P):
            at = f"rank {r} of {P}, {E} rows{', ' + how + ' views' if how else ''}"
            got = call_unmodified("shard_rows", m.shard_rows, batch, r, P, names=("batch", "rank", "world_size"),
                                  at=at)
            assert_type("shard_rows", "the result", got, dict, at)
            assert set(got) == set(batch), f"shard_rows: keys {sorted(got)}, expected {sorted(batch)} at {at}"
            rows = _accelerate_rows(E, r, P)
            for k, v in batch.items():
                assert torch.is_tensor(got[k]) and torch.equal(got[k], v[rows]), (
                    f"shard_rows: {k!r} holds other rows than Accelerate's split_batches=True (rows {rows}) at {at}")

    explore(cases, body)
    batch = {"input_ids": torch.zeros(4, T, dtype=torch.long)}
    for r, P in ((0, 0), (0, -2), (4, 4), (-1, 4), (0, 3)):
        try:
            m.shard_rows(batch, r, P)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"shard_rows: rank {r} of {P} processes over 4 rows raised {type(e).__name__}, "
                                 "expected ValueError") from None
        raise AssertionError(f"shard_rows: rank {r} of {P} processes over 4 rows must raise ValueError")


def _run_ranks(fn, per_rank: list, *, fail: bool = False):
    """``fn(per_rank[r], P, all_reduce)`` in one thread per rank; returns (results, all-reduce calls per rank).
    ``fail``: the all-reduce raises (a failed collective); the exceptions are returned instead."""
    from bp_mech.projects.baseline_loss import ThreadAllReduce

    P = len(per_rank)
    group, out, calls = ThreadAllReduce(P, timeout_s=5.0), [None] * P, [0] * P

    class CollectiveError(RuntimeError):
        pass

    def rank_main(r):
        op = group.op(r)

        def all_reduce(t):
            calls[r] += 1
            if fail:
                raise CollectiveError("the all-reduce failed")
            return op(t)
        out[r] = fn(per_rank[r], P, all_reduce)

    errors = group.run(rank_main)  # each rank's exception, returned to this thread
    if fail:
        return errors, calls
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise AssertionError(f"{fn.__name__}: the ranks did not all call all_reduce the same number of times "
                             f"(calls per rank {calls})")
    return out, calls


_COUNTS = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=3), min_size=1, max_size=4)


def check_loss_divisor__contract(m):
    with timing_threads("cpu"):
        _check_loss_divisor_contract(m)


def _check_loss_divisor_contract(m):
    _run_ranks(m.loss_divisor, [[torch.tensor(3)], [torch.tensor(5)]])  # a stub stops here
    def body(counts):
        k = len(counts[0])
        per_rank = [[torch.tensor(c) for c in (row + [0] * k)[:k]] for row in counts]
        P, N = len(per_rank), sum(int(c) for row in per_rank for c in row)
        at = f"P={P}, rank counts {[[int(c) for c in row] for row in per_rank]}"

        def fn(local, P_, all_reduce):
            return call_unmodified("loss_divisor", m.loss_divisor, local, P_, all_reduce,
                                   names=("local_counts", "world_size", "all_reduce"), at=at)
        out, calls = _run_ranks(fn, per_rank)
        assert all(c == 1 for c in calls), f"loss_divisor: all_reduce was called {calls} times per rank at {at}"
        for r, d in enumerate(out):
            assert torch.is_tensor(d) and d.dim() == 0 and d.is_floating_point(), (
                f"loss_divisor: rank {r} returned {d!r}, expected a 0-dim floating-point tensor at {at}")
            assert_finite("loss_divisor", f"rank {r}'s divisor", d, at)
            # one rounding of N / P in the divisor's dtype (float32 from an integer count divided by P)
            assert abs(d.item() - N / P) <= torch.finfo(d.dtype).eps * N / P, (
                f"loss_divisor: rank {r} returned {d.item():g}, expected N / P = {N} / {P} = {N / P:g} at {at}")

    explore(_COUNTS.filter(lambda c: sum(map(sum, c)) > 0), body)
    errors, _ = _run_ranks(m.loss_divisor, [[torch.tensor(3)], [torch.tensor(5)]], fail=True)
    for r, e in enumerate(errors):
        if isinstance(e, NotImplementedError):
            raise e
        if type(e).__name__ != "CollectiveError":
            got = "returned a value" if e is None else f"raised {type(e).__name__}"
            raise AssertionError(f"loss_divisor: the all-reduce raised CollectiveError on rank {r} and loss_divisor "
                                 f"{got} (let the collective's exception propagate)")


# --- the per-sequence mean (variant) ----------------------------------------------------------------

def _labels(g, pads) -> torch.Tensor:
    y = torch.randint(1, V, (len(pads), T), generator=g)
    for i, p in enumerate(pads):
        if p:
            y[i, T - p:] = -100
    return y


def _row_sums(model_params, ids, labels):
    emb, head = model_params
    z = torch.tanh(emb[ids]) @ head.T  # (B, T, V)
    ce = F.cross_entropy(z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none")
    return ce.reshape(len(ids), T - 1).sum(1)  # S_s, (B,)


# padded tails of a micro-batch of 8 rows (micro-batch j rotates them by j): uneven ranks, rows without target
# (a tail of T - 1 or T), a rank without any target; a few patterns keep hypothesis's shrinking quick
PADS = ([0] * 8, [0, 7, 1, 6, 0, 0, 2, 1], [T, T, 0, 3, T - 1, 1, 0, 2], [T, T, T, T, 0, 1, 2, 3],
        [1, 3, 5, 0, 0, 0, T, 2])
_SEQ = st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(0, 7), st.sampled_from(PADS),
                 st.booleans())


def check_sequence_weights(m):
    with timing_threads("cpu"):  # one intra-op thread: the rank threads do not spin against torch's pool
        _check_sequence_weights(m)


def _check_sequence_weights(m):
    _run_ranks(m.sequence_weights, [[torch.tensor([[1, 2, 3]])], [torch.tensor([[1, 2, -100]])]])  # a stub stops here
    def body(case):
        P, k, seed, pads, view = case
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(V, C, generator=g, dtype=torch.float64), torch.randn(V, C, generator=g,
                                                                                    dtype=torch.float64)]
        micro = [(torch.randint(0, V, (8, T), generator=g), _labels(g, pads[j:] + pads[:j])) for j in range(k)]
        n = torch.cat([(y[:, 1:] != -100).sum(1) for _, y in micro])
        if not (n > 0).any():
            return
        at = f"P={P}, k={k}, pads {pads}{', strided labels' if view else ''}"
        leaves = [p.clone().requires_grad_() for p in params]  # the reference: autograd of L_seq, one process
        S = torch.cat([_row_sums(leaves, x, y) for x, y in micro])
        want = torch.autograd.grad((S[n > 0] / n[n > 0]).sum() / int((n > 0).sum()), leaves)
        b = 8 // P
        shards = [[(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for x, y in micro] for r in range(P)]
        labels = [[strided(y, "transpose") if view else y for _, y in shards[r]] for r in range(P)]

        def fn(local, P_, all_reduce):
            return call_unmodified("sequence_weights", m.sequence_weights, local, P_, all_reduce,
                                   names=("local_labels", "world_size", "all_reduce"), at=at)
        out, _ = _run_ranks(fn, labels)
        got = [torch.zeros_like(p) for p in params]
        for r in range(P):
            w = out[r]
            assert isinstance(w, list) and len(w) == k, f"sequence_weights: return a list of {k} tensors at {at}"
            for j, wj in enumerate(w):
                assert torch.is_tensor(wj) and wj.dtype == torch.float64 and wj.shape == (b,), (
                    f"sequence_weights: micro-batch {j}'s weights are {wj!r}, expected a float64 tensor of shape "
                    f"({b},) at {at}")
                assert_finite("sequence_weights", f"rank {r}'s weights", wj, at)
                empty = (labels[r][j][:, 1:] != -100).sum(1) == 0
                assert (wj[empty] == 0).all(), f"sequence_weights: a row without target has weight {wj[empty]} at {at}"
            leaves = [p.clone().requires_grad_() for p in params]
            loss = sum((wj * _row_sums(leaves, x, y)).sum() for wj, (x, y) in zip(w, shards[r]))
            for acc, d in zip(got, torch.autograd.grad(loss, leaves, allow_unused=True)):
                acc += (d if d is not None else 0) / P  # DDP: the mean over ranks
        err = max(relative_error(a, w) for a, w in zip(got, want))
        assert err <= TOL, (f"sequence_weights: the ranks' averaged gradient differs from float64 autograd of the "
                            f"per-sequence mean, max rel error {err:.1e} > {TOL:g} at {at}")

    explore(_SEQ, body)
    try:
        _run_ranks(m.sequence_weights, [[torch.full((2, T), -100)], [torch.full((2, T), -100)]])
    except ValueError:
        return
    raise AssertionError("sequence_weights: no row of any rank has a target (R = 0) and no ValueError was raised")


def check_predict_rank_tokens(m):
    call("predict_rank_tokens", m.predict_rank_tokens, [0, 1], 4, 2, at="pads [0, 1]")  # a stub stops here
    cases = st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(2, 9),
                      st.lists(st.integers(0, 9), min_size=12, max_size=12))

    def body(case):
        P, b, seq, raw = case
        pads = [min(p, seq) for p in raw[:P * b]]
        at = f"pads {pads}, seq {seq}, {P} processes"
        got = call("predict_rank_tokens", m.predict_rank_tokens, list(pads), seq, P, at=at)
        assert isinstance(got, list) and len(got) == P, f"predict_rank_tokens: return a list of {P} ints at {at}"
        for x in got:
            assert_type("predict_rank_tokens", "a count", x, int, at)
        labels = torch.ones(len(pads), seq, dtype=torch.long)
        for i, p in enumerate(pads):
            if p:
                labels[i, seq - p:] = -100
        measured = [int((labels[_accelerate_rows(len(pads), r, P)][:, 1:] != -100).sum()) for r in range(P)]
        assert got == measured, (f"predict_rank_tokens: predicted {got} target tokens per rank, measured {measured} "
                                 f"with Accelerate's sharding (exact: counts) at {at}")

    explore(cases, body, examples=20)


CHECKS = [check_shard_rows__contract, check_loss_divisor__contract, check_sequence_weights, check_predict_rank_tokens]
