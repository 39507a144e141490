"""Answers for Part 02 · 11: the package's implementation (``src/bp_mech/accumulation.py``).

``accumulated_backward`` there also takes ``norm="naive"`` (the chapter's wrong variant);
its default, ``norm="token"``, is the answer.
"""

import torch
import torch.nn.functional as F

from bp_mech.accumulation import (  # noqa: F401
    accumulated_backward,
    count_targets,
    split,
    token_loss_sum,
)


def micro_batch_loss(logits, labels, n_total):
    """S_j / N: the micro-batch's summed token loss over the batch's target count."""
    return token_loss_sum(logits, labels) / n_total


def accumulated_backward_per_sequence(model, batch, k):
    """Each row's mean token loss, averaged over the rows with a target."""
    n_rows = int(((batch["labels"][:, 1:] != -100).sum(1) > 0).sum())
    if n_rows == 0:
        raise ValueError("no row of the batch has a target")
    total = 0.0
    for mb in split(batch, k):
        logits = model(input_ids=mb["input_ids"]).logits
        half = logits.dtype in (torch.float16, torch.bfloat16)
        z = logits.float() if half else logits
        y = mb["labels"][:, 1:]
        tok = F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), y.reshape(-1),
                              ignore_index=-100, reduction="none").view(y.shape)
        per_row = tok.sum(1) / (y != -100).sum(1).clamp(min=1)  # 0 for a row w/o target
        loss = per_row.sum() / n_rows
        loss.backward()
        total = total + loss.detach()
    return total


def predict_naive_weights(counts):
    """Both losses are sums of the same S_j: the token mean weighs S_j by 1 / N, the
    naive mean by 1 / (k n_j). Gradients are linear, so micro-batch j's contribution
    is scaled by the ratio of the two coefficients: w_j = N / (k n_j)."""
    if not counts or min(counts) < 1:
        raise ValueError(f"counts must be a non-empty list of ints >= 1, got {counts}")
    n, k = sum(counts), len(counts)
    return [n / (k * c) for c in counts]
