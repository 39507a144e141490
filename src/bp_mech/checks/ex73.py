"""Checks of exercises/ex73_baseline.py (never against the answer file).

* ``shard_rows`` against Accelerate's own sharding: ``accelerate.data_loader.BatchSamplerShard`` with
  ``split_batches=True`` (the rows each process of ``accelerate launch`` gets from a batch).
* ``loss_divisor`` against float64 autograd of the global token mean: ``F.cross_entropy(...,
  reduction="mean", ignore_index=-100)`` over the whole update (every micro-batch, every rank).
  Each simulated rank runs in its own thread and calls ``all_reduce``, a sum among the threads; the
  ranks' gradients of sum_j S_{r,j} / D_r are then averaged, as DDP does. The ranks hold different
  numbers of target tokens, so a per-rank token mean, or a divisor without the 1/P, gives wrong
  gradients.

The explored contract of both, the per-sequence variant and the prediction are in ``ex73_contract``.
"""

import threading

import torch
import torch.nn.functional as F

from bp_mech.bench.compare import relative_error
from bp_mech.bench.timing import timing_threads
from bp_mech.checks.ex73_contract import CHECKS as CONTRACT

TOL = 1e-10  # float64: the simulated data-parallel gradient and the global mean's agree to rounding
V, C, T = 23, 8, 9  # vocab, width, sequence length
PADS = [0, 7, 1, 6, 0, 0, 2, 1]  # padded tail per row of a micro-batch of 8: uneven per rank for P = 2 and 4


class _Toy(torch.nn.Module):
    """A float64 next-token model: embedding, tanh mixer, head."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, C, generator=g, dtype=torch.float64))
        self.mix = torch.nn.Parameter(torch.randn(C, C, generator=g, dtype=torch.float64) / C ** 0.5)
        self.head = torch.nn.Parameter(torch.randn(V, C, generator=g, dtype=torch.float64) / C ** 0.5)

    def forward(self, ids):
        return torch.tanh(self.emb[ids] @ self.mix.T) @ self.head.T  # (B, T, V)


def _micro_batch(seed: int, pads=PADS) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(pads), T), generator=g)
    labels = ids.clone()
    for r, p in enumerate(pads):
        if p:
            ids[r, T - p:], labels[r, T - p:] = 0, -100
    return {"input_ids": ids, "labels": labels}


def _targets(labels):
    return labels[:, 1:].reshape(-1)


def _sum_loss(model, mb):
    z = model(mb["input_ids"])[:, :-1]
    return F.cross_entropy(z.reshape(-1, V), _targets(mb["labels"]), ignore_index=-100, reduction="sum")


def _threaded_divisors(m, counts):
    """Each rank's ``m.loss_divisor`` in its own thread, with a sum all-reduce among the threads (the
    package's thread harness, ``baseline_loss.divisors``: plumbing, not the reference)."""
    from bp_mech.projects.baseline_loss import divisors

    try:
        return divisors(counts, m.loss_divisor)
    except threading.BrokenBarrierError:
        raise AssertionError("loss_divisor: the ranks did not all call all_reduce the same number of times") from None


def _case(seed, P, k):
    """k micro-batches of 8 rows; rank r's contiguous rows of each; its target counts."""
    micro = [_micro_batch(seed + j, PADS[j:] + PADS[:j]) for j in range(k)]
    b = 8 // P
    shards = [[{key: v[r * b:(r + 1) * b] for key, v in mb.items()} for mb in micro] for r in range(P)]
    counts = [[(_targets(s["labels"]) != -100).sum() for s in shards[r]] for r in range(P)]
    return micro, shards, counts


def check_shard_rows(m):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    g = torch.Generator().manual_seed(3)
    E = 8
    batch = {"input_ids": torch.randint(0, V, (E, T), generator=g), "labels": torch.randint(0, V, (E, T), generator=g)}
    for P in (1, 2, 4, 8):
        for r in range(P):
            sampler = BatchSamplerShard(BatchSampler(SequentialSampler(range(E)), E, False), num_processes=P,
                                        process_index=r, split_batches=True)
            rows = next(iter(sampler))
            got = m.shard_rows(batch, r, P)
            assert isinstance(got, dict) and set(got) == set(batch), "shard_rows: return a dict with the batch's keys"
            for key in batch:
                assert torch.equal(got[key], batch[key][rows]), (
                    f"shard_rows: rank {r} of {P} got other rows than Accelerate's split_batches=True "
                    f"(BatchSamplerShard gives rows {rows}); take a contiguous block")
    for r, P in ((0, 3), (2, 2), (-1, 2)):
        try:
            m.shard_rows(batch, r, P)
        except ValueError:
            continue
        raise AssertionError(f"shard_rows: rank {r} of {P} processes over {E} rows must raise ValueError")


def check_loss_divisor(m):
    with timing_threads("cpu"):  # one intra-op thread: the rank threads do not spin against torch's pool
        _check_loss_divisor(m)


def _check_loss_divisor(m):
    for seed, P, k in ((0, 2, 1), (1, 2, 2), (2, 4, 2)):
        micro, shards, counts = _case(10 * seed, P, k)
        ref = _Toy(seed)
        n_total = sum((_targets(mb["labels"]) != -100).sum() for mb in micro)
        want = torch.autograd.grad(sum(_sum_loss(ref, mb) for mb in micro) / n_total, list(ref.parameters()))
        divs = _threaded_divisors(m, counts)
        model = _Toy(seed)
        got = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(P):  # each rank's gradient, then DDP's mean over the ranks
            rank_loss = sum(_sum_loss(model, s) for s in shards[r]) / divs[r]
            for acc, d in zip(got, torch.autograd.grad(rank_loss, list(model.parameters()))):
                acc += d / P
        err = max(relative_error(a, w) for a, w in zip(got, want))
        assert err <= TOL, (f"loss_divisor: the ranks' averaged gradient differs from float64 autograd of the global "
                            f"token mean, max rel error {err:.1e} > {TOL:g} at P={P}, k={k} (rank counts "
                            f"{[int(sum(c)) for c in counts]}); divide by the all-reduced count over P")


def check_loss_divisor__value(m):
    for seed, P, k in ((3, 2, 2), (4, 4, 1)):
        micro, _, counts = _case(10 * seed, P, k)
        z = torch.randn(8 * k, T - 1, V, dtype=torch.float64)
        labels = torch.cat([_targets(mb["labels"]).reshape(8, T - 1) for mb in micro])
        n_total = round((F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), reduction="sum")
                         / F.cross_entropy(z.reshape(-1, V), labels.reshape(-1))).item())  # torch's own count
        for r, d in enumerate(_threaded_divisors(m, counts)):
            d = torch.as_tensor(d)
            assert d.dim() == 0 and d.is_floating_point(), f"loss_divisor: return a 0-dim float tensor, got {d!r}"
            assert abs(d.item() - n_total / P) <= 1e-12 * n_total, (
                f"loss_divisor: rank {r} of {P} returned {d.item():g}, expected N / P = {n_total} / {P} = "
                f"{n_total / P:g} (N: targets of the whole update on all ranks)")


CHECKS = [check_shard_rows, check_loss_divisor, check_loss_divisor__value, *CONTRACT]
