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
        A dict with the same keys, each tensor of shape (E / P, ...) (a view of the
        batch's rows is fine).

    Raises:
        ValueError: if P < 1, E is not divisible by P, or rank is not in [0, P).

    Contract (checked): the rows are Accelerate's, for every E, P and rank; the batch
    is not modified; non-contiguous tensors (a slice, a transposed layout) give the
    same rows; tensors of other trailing shapes ((E,), (E, T, C)) are split alike.
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

    Contract (checked): D = N / P exactly for any counts (a rank may hold no target
    at all); ``local_counts`` is not modified; ``all_reduce`` is called exactly once;
    an exception it raises (a failed collective) propagates.
    """
    raise NotImplementedError("ex73: loss_divisor")


def sequence_weights(local_labels, world_size: int, all_reduce) -> list:
    """Per-row loss weights for the per-*sequence* mean across processes.

    Math: another reduction than the token mean. Every row (sequence) s with n_s >= 1
    target tokens weighs the same, whatever its length:

        L_seq = (1 / R) sum_{s : n_s > 0} S_s / n_s,

    S_s the row's summed token loss, n_s its target count (``labels[s, 1:] != -100``),
    R the number of rows with at least one target in the whole update (every
    micro-batch, every rank). Rank r back-propagates sum_{j, i} w_{j,i} S_{j,i} over
    its rows and DDP averages the ranks' gradients over the P ranks; return the
    weights w that make that average the gradient of L_seq (0 for a row without
    target).

    Args:
        local_labels: this rank's labels, one (B_j, T) int64 tensor per micro-batch.
        world_size: P, the number of processes.
        all_reduce: callable, tensor -> the sum of that tensor over all ranks (a new
            tensor). Call it exactly once.

    Returns:
        A list of (B_j,) float64 tensors, one per micro-batch: the weight of each row.

    Raises:
        ValueError: if no row of any rank has a target (R = 0).

    Contract (checked): the ranks' averaged gradient is float64 autograd's of L_seq;
    rows without target get weight exactly 0 (no NaN); the labels are not modified;
    non-contiguous labels give the same weights.
    """
    raise NotImplementedError("ex73: sequence_weights")


def predict_rank_tokens(pads, seq: int, world_size: int) -> list:
    """Predict: the target tokens each rank holds of one batch, before sharding it.

    The batch has E = len(pads) rows of ``seq`` tokens; row i is right-padded with
    pads[i] positions (labels -100 on its last pads[i] positions, 0 <= pads[i] <=
    seq). The check builds that batch, shards it with Accelerate's
    ``BatchSamplerShard(split_batches=True)`` over ``world_size`` processes and
    counts each rank's targets (exact: counts).

    Returns:
        A list of ``world_size`` Python ints, rank 0 first.
    """
    raise NotImplementedError("ex73: predict_rank_tokens")
