"""Answers for project 73: the package's implementation (``src/bp_mech/projects/baseline_loss.py``);
the per-sequence weights and the prediction are written here.

``per_rank_divisor`` there is the chapter's wrong variant (a per-rank token mean)."""

import torch

from bp_mech.projects.baseline_loss import loss_divisor, shard_rows  # noqa: F401


def sequence_weights(local_labels, world_size: int, all_reduce) -> list:
    """DDP divides the sum of the ranks' gradients by P, so rank r must back-propagate
    P times its share of L_seq: w_s = P / (R n_s) on a row with a target, 0 on one
    without. R counts the rows with a target on every rank: one all-reduce."""
    counts = [(y[:, 1:] != -100).sum(1) for y in local_labels]  # n_s per row, (B_j,)
    rows = sum(int((n > 0).sum()) for n in counts)  # this rank's rows with a target
    R = int(all_reduce(torch.tensor(rows, dtype=torch.int64)))
    if R == 0:
        raise ValueError("no row of any rank has a target token")
    return [torch.where(n > 0, world_size / (R * n.clamp(min=1).double()),
                        torch.zeros((), dtype=torch.float64)) for n in counts]


def predict_rank_tokens(pads, seq: int, world_size: int) -> list:
    """A row's targets are its labels after the shift: seq - 1 positions, minus the
    padded tail (a fully padded row has none). split_batches gives rank r the
    contiguous block of E / P rows; sum over it."""
    b = len(pads) // world_size  # split_batches: contiguous blocks of b rows
    per_row = [max(0, seq - 1 - p) for p in pads]  # a row's first token is no target
    return [sum(per_row[r * b:(r + 1) * b]) for r in range(world_size)]
