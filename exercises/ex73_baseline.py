"""Exercises for project 73 — the training baseline: one update over several processes.

Data parallelism over P processes (ranks): each rank takes its own rows of every micro-batch,
runs forward and backward on them, and DDP's all-reduce replaces every rank's gradient by the
*mean* of the P ranks' gradients before the (identical) update. With k micro-batches per update,
S_{r,j} the summed token loss of rank r's rows of micro-batch j and N the target tokens of the
whole update on all ranks, the update must follow the gradient of the global token mean
sum_{r,j} S_{r,j} / N, whatever the padding and however the rows fall on the ranks.

A batch is a dict ``{"input_ids": (E, T) long, "labels": (E, T) long}``; labels are -100 on
padding; position t predicts token t + 1, so a row's targets are ``labels[:, 1:] != -100``.

Check your solutions with ``bp-mech check 73`` (or
``pytest tests/test_exercises.py -m ch73 --impl exercises``). The checks compare with Accelerate's
own batch sharding and with float64 autograd of the global token mean, on ranks that hold
different numbers of target tokens.
"""

import torch


def shard_rows(batch: dict, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s rows of a batch, as Accelerate gives them with
    ``split_batches=True``.

    Math: with b = E / P, rank r gets the contiguous rows r*b ... (r+1)*b - 1 of every
    tensor, so P ranks x b rows hold exactly the rows of one process x P*b, in order.

    Args:
        batch: dict of tensors, each of shape (E, ...).
        rank: this process's index, 0 <= rank < world_size.
        world_size: P, the number of processes.

    Returns:
        A dict with the same keys, each tensor of shape (E / P, ...).

    Raises:
        ValueError: if E is not divisible by P, or rank is out of range.
    """
    raise NotImplementedError("ex73: shard_rows")


def loss_divisor(local_counts, world_size: int, all_reduce) -> torch.Tensor:
    """The number a rank divides its summed token losses by, so that DDP's mean is the
    global mean.

    Math: n_r = sum_j local_counts[j] (this rank's target tokens in the update's
    micro-batches), N = sum over ranks of n_r, obtained with ``all_reduce`` (every
    rank calls it with its own n_r and gets N back). Each rank back-propagates
    S_{r,j} / D; DDP then averages over the P ranks, so D must be N / P:
    (1/P) sum_r sum_j grad S_{r,j} / (N / P) = grad (sum_{r,j} S_{r,j} / N).
    A rank's own count n_r (a per-rank mean) is right only when every rank holds N / P
    tokens.

    Args:
        local_counts: this rank's target count of each micro-batch of the update (0-dim
            integer tensors).
        world_size: P, the number of processes.
        all_reduce: callable, tensor -> the sum of that tensor over all ranks (a new
            tensor). Call it once, with this rank's total count.

    Returns:
        D = N / P, a 0-dim floating-point tensor.
    """
    raise NotImplementedError("ex73: loss_divisor")
