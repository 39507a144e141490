"""Project 73 — the token-weighted loss across micro-batches *and* processes (the mechanism).

Data parallelism over P processes: every rank holds a copy of the model, takes its own rows of
every micro-batch, runs forward and backward on them, and the ranks' gradients are averaged
(DDP's all-reduce divides the sum by P) before every rank applies the same update. With k
micro-batches per update, S_{r,j} the summed token loss of rank r's rows of micro-batch j,
n_{r,j} their target tokens and N = sum_{r,j} n_{r,j} the target tokens of the whole update on all
ranks, the full-batch loss is the global token mean sum_{r,j} S_{r,j} / N. Its gradient comes out
of DDP's mean when each rank back-propagates

    loss_{r,j} = S_{r,j} / (N / P),          the *loss divisor* N / P,

since (1/P) sum_r sum_j grad S_{r,j} * P / N = grad (sum_{r,j} S_{r,j} / N). N is not known to any
rank alone: each rank counts its own n_r = sum_j n_{r,j} and an **all-reduce (sum)** of the counts
gives N on every rank (one integer per update, before the first forward).

The naive version divides by the rank's own count, loss_{r,j} = S_{r,j} / n_r (a per-rank token
mean); DDP's average then gives (1/P) sum_r grad S_r / n_r, which equals the global mean only when
every rank holds the same number of target tokens. With padding or variable-length documents the
ranks' counts differ and a rank with fewer tokens weighs more (Transformers' Trainer all-reduces the
count for the same reason: ``average_tokens_across_devices``).

``shard_rows`` gives rank r its contiguous block of rows, as Accelerate's ``split_batches=True``
does: P ranks x b rows see exactly the rows of one process x P b. ``simulate_ranks`` runs the P
ranks in one process (threads for the all-reduce, DDP's mean by hand): the from-scratch check of
the algebra above; ``bp_mech.projects.baseline_loop`` is the real loop on Accelerate.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from bp_mech.accumulation import count_targets, token_loss_sum

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sum of a tensor over all ranks, returned on every rank


def shard_rows(batch: dict[str, torch.Tensor], rank: int,
               world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a batch: the contiguous block [rank * b, (rank + 1) * b),
    b = E / P.

    Raises ValueError if E % P or rank is not in [0, P).
    """
    E = next(iter(batch.values())).shape[0]
    if world_size < 1 or E % world_size or not 0 <= rank < world_size:
        raise ValueError(
            f"cannot give rank {rank} of {world_size} an equal share of {E} rows")
    b = E // world_size
    return {k: v[rank * b:(rank + 1) * b] for k, v in batch.items()}


def loss_divisor(local_counts: Sequence[torch.Tensor], world_size: int,
                 all_reduce: AllReduce) -> torch.Tensor:
    """N / P: the target tokens of the whole update on all ranks (all-reduced), over the
    rank count.

    ``local_counts``: this rank's target count of each micro-batch of the update
    (0-dim integer tensors). Every rank gets the same divisor; dividing its summed token
    losses by it makes DDP's mean of the ranks' gradients the gradient of the global
    token mean.
    """
    n_local = torch.stack([torch.as_tensor(c) for c in local_counts]).sum()
    return all_reduce(n_local) / world_size


def per_rank_divisor(local_counts: Sequence[torch.Tensor], world_size: int,
                     all_reduce: AllReduce) -> torch.Tensor:
    """The bug: this rank's own target count (a per-rank token mean); equal to
    ``loss_divisor`` only when every rank holds N / P target tokens."""
    return torch.stack([torch.as_tensor(c) for c in local_counts]).sum().float()


class ThreadAllReduce:
    """A sum all-reduce among ``world_size`` threads (one per simulated rank):
    ``group.op(rank)`` is rank ``rank``'s ``all_reduce``; each call blocks until every
    rank has made its own."""

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)

    def op(self, rank: int) -> AllReduce:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()  # every rank has put its value
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()  # every rank has read, before a next call overwrites
            return total
        return all_reduce

    def run(self, rank_main: Callable[[int], None]) -> list[BaseException | None]:
        """``rank_main(r)`` for every rank, each in its own thread; returns each rank's
        exception (None where it returned). A rank that raises breaks the barrier: the
        others stop waiting for it."""
        errors: list[BaseException | None] = [None] * len(self.slots)

        def main(r: int) -> None:
            try:
                rank_main(r)
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                errors[r] = e
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(len(errors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors


def divisors(local_counts: list[list[torch.Tensor]], divisor_fn: Callable = loss_divisor) -> list[torch.Tensor]:
    """Every simulated rank's divisor, each computed in its own thread with a ``ThreadAllReduce``
    (``local_counts[r]``: rank r's count per micro-batch). An exception in a rank is re-raised."""
    P = len(local_counts)
    group, out = ThreadAllReduce(P), [None] * P

    def rank_main(r):
        out[r] = divisor_fn(local_counts[r], P, group.op(r))

    errors = [e for e in group.run(rank_main) if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out


def simulate_ranks(model, micro_batches: list[dict[str, torch.Tensor]], world_size: int,
                   divisor_fn: Callable = loss_divisor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One data-parallel update's loss and gradient, all P ranks in this process.

    Rank r takes ``shard_rows`` of every micro-batch, gets its divisor (``divisor_fn`` with an
    all-reduce among threads), and back-propagates sum_j S_{r,j} / divisor into its own gradient;
    DDP's all-reduce is the mean of the P gradients. Returns (the logged loss, sum_{r,j} S_{r,j} / N;
    the averaged gradients, one per parameter). ``model(input_ids=...).logits``: (B, T, V).
    """
    shards = [[shard_rows(mb, r, world_size) for mb in micro_batches] for r in range(world_size)]
    divs = divisors([[count_targets(mb["labels"]) for mb in shards[r]] for r in range(world_size)], divisor_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    grads, loss_sum = [torch.zeros_like(p) for p in params], 0.0
    for r in range(world_size):
        sums = [token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) for mb in shards[r]]
        rank_loss = torch.stack(sums).sum()
        for g, d in zip(grads, torch.autograd.grad(rank_loss / divs[r], params)):
            g += d / world_size  # DDP: the mean over ranks
        loss_sum = loss_sum + rank_loss.detach()
    n_total = sum(count_targets(mb["labels"]) for mb in micro_batches)
    return loss_sum / n_total, grads
