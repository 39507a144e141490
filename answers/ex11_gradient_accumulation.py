"""Answers for Part 02 · 11: the package's implementation (``src/bp_mech/accumulation.py``).

``accumulated_backward`` there also takes ``norm="naive"`` (the chapter's wrong variant);
its default, ``norm="token"``, is the answer.
"""

from bp_mech.accumulation import accumulated_backward, count_targets, split, token_loss_sum  # noqa: F401


def micro_batch_loss(logits, labels, n_total):
    """S_j / N: the micro-batch's summed token loss over the batch's target count."""
    return token_loss_sum(logits, labels) / n_total
