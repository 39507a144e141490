"""Exercises for Part 02 · 11 — gradient accumulation.

An update over an effective batch is split into k micro-batches; each runs forward and
backward, the gradients add up in ``.grad``, and the optimizer steps once. The update equals
the full-batch one only if every micro-batch loss is weighted by its share of the *target
tokens of the whole effective batch* — not by 1/k.

A batch is a dict ``{"input_ids": (E, T) long, "labels": (E, T) long}`` (it may hold more keys,
e.g. an attention mask). Labels equal the inputs except where a position is not a target: on
padding, and in supervised fine-tuning on the prompt tokens, the label is -100 while the input
there may be a real token. So count targets from the labels, never from the inputs; token id 0
is a real token. Position t predicts token t + 1, so the targets of a row are ``labels[:, 1:]``
(the model shifts; you must shift too when counting). A micro-batch may hold no target at all.

Check your solutions with ``bp-mech check 11`` (or
``pytest tests/test_exercises.py -m ch11 --impl exercises``). The checks compare with the
full-batch loss and gradients of float64 autograd on padded, uneven micro-batches, with prompts
masked in the labels, a micro-batch without targets, a frozen parameter, and 16-bit logits;
and they hold each function to the contract its docstring states, on cases drawn by
hypothesis (inputs left unmodified, strided views, extreme logits, exact return types).
"""

import torch


def split(batch: dict, k: int) -> list:
    """Split a batch into k equal micro-batches along dimension 0, keeping the order.

    Math: micro-batch j holds rows j*E/k ... (j+1)*E/k - 1 of every tensor in the batch.

    Args:
        batch: dict of tensors, each of shape (E, ...) (any keys, any trailing
            dimensions).
        k: number of micro-batches, >= 1.

    Returns:
        A list (exactly ``list``) of k dicts with the same keys, each tensor of shape
        (E/k, ...); the rows of micro-batch j, concatenated in order, give the batch.
        The batch itself is not modified; non-contiguous tensors split the same way.

    Raises:
        ValueError: if k < 1 or E is not divisible by k.
    """
    raise NotImplementedError("ex11: split")


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of next-token targets that count in the loss.

    Math: n = #{(b, t) : t >= 1 and labels[b, t] != -100}. The first position of a row
    is never a target (nothing predicts it); padded positions (-100) are not targets.

    Args:
        labels: shape (B, T), long, -100 where a position is not a target.

    Returns:
        A 0-dim integer tensor (0 when there is no target). ``labels`` is not
        modified; a non-contiguous view (a slice, a transpose) counts the same.
    """
    raise NotImplementedError("ex11: count_targets")


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor,
                     n_total) -> torch.Tensor:
    """One micro-batch's share of the token-weighted loss of the effective batch.

    Math: with S_j = sum over the micro-batch's targets of
    -log softmax(logits[b, t-1])[labels[b, t]], the share is S_j / N, where
    N = ``n_total`` counts the targets of the *whole effective batch*. Summed over the
    micro-batches, the shares give the full-batch mean loss.

    Args:
        logits: shape (B, T, V), the micro-batch's logits (position t-1 predicts label
            t); float64, float32, bfloat16 or float16.
        labels: shape (B, T), long, -100 where a position is not a target.
        n_total: N, the target count of the whole effective batch (int or 0-dim tensor).

    Returns:
        A 0-dim tensor, differentiable with respect to the logits: in the logits' dtype
        for float64 and float32, in float32 for bfloat16 and float16 logits (compute the
        loss in float32, as transformers' ``ForCausalLMLoss`` does: a 16-bit sum over
        many tokens loses digits). A micro-batch without targets contributes 0, not NaN.
        Finite wherever the loss is, logits of magnitude 1000 included (a log of a
        softmax that underflows to 0 is not); the same for non-contiguous logits;
        neither ``logits`` nor ``labels`` is modified.
    """
    raise NotImplementedError("ex11: micro_batch_loss")


def accumulated_backward(model, batch: dict, k: int) -> torch.Tensor:
    """Token-weighted gradient accumulation over k micro-batches (no optimizer step).

    For each micro-batch j (from ``split``): logits = model(input_ids=...).logits,
    loss_j = micro_batch_loss(logits, labels_j, N) with
    N = count_targets(batch["labels"]), then loss_j.backward(). Do not zero the
    gradients between micro-batches: they must add up. Afterwards every parameter's
    ``.grad`` equals the gradient of the full-batch mean loss (a parameter with
    ``requires_grad=False`` gets none).

    Args:
        model: a callable module; ``model(input_ids=x).logits`` has shape (B, T, V).
        batch: dict with "input_ids" and "labels", each (E, T).
        k: number of micro-batches.

    Returns:
        The accumulated loss sum_j loss_j (detached, 0-dim), which equals the full-batch
        mean loss.

    Contract: the gradients *add* to any ``.grad`` already there (the caller zeroes
    before an update, not this function); ``batch`` is not modified; an exception
    raised by the model propagates (no micro-batch is silently skipped).
    """
    raise NotImplementedError("ex11: accumulated_backward")


def accumulated_backward_per_sequence(model, batch: dict, k: int) -> torch.Tensor:
    """Accumulation of a *per-sequence* loss: every sequence weighs the same.

    Math: with S_r the summed token loss of row r and n_r its targets (after the
    shift), over the R rows of the whole effective batch that have n_r >= 1:

        L_seq = (1/R) * sum_r S_r / n_r

    Micro-batch j contributes (1/R) * sum_{r in j, n_r >= 1} S_r / n_r; rows without a
    target contribute nothing, and R counts the rows of the *whole* batch (not of
    the micro-batch, not E). Unlike the token mean, a short answer's tokens weigh
    more than a long one's: this is a different objective, not a correction.

    Args:
        model: a callable module; ``model(input_ids=x).logits`` has shape (B, T, V).
        batch: dict with "input_ids" and "labels", each (E, T).
        k: number of micro-batches.

    Returns:
        L_seq (detached, 0-dim); every parameter's ``.grad`` gains dL_seq/dparam. As
        for ``accumulated_backward``: ``batch`` is not modified, gradients add to an
        existing ``.grad``, model exceptions propagate, 16-bit logits are upcast.

    Raises:
        ValueError: if no row of the batch has a target (R = 0).
    """
    raise NotImplementedError("ex11: accumulated_backward_per_sequence")


def predict_naive_weights(counts: list) -> list:
    """Predict how the mean of micro-batch means re-weights each micro-batch.

    The naive loss (1/k) sum_j S_j / n_j (S_j: micro-batch j's summed token loss)
    multiplies the gradient that micro-batch j contributes, relative to the full-batch
    token mean, by a factor w_j (dimensionless). Predict w_j, before measuring, for k
    micro-batches holding ``counts[j]`` = n_j targets. The check measures it as the
    ratio of the naive to the token-weighted gradient on micro-batch j's own rows of a
    parameter table, in float64 (relative tolerance 1e-9).

    Args:
        counts: n_1 ... n_k, a list of ints, each >= 1 (not modified).

    Returns:
        A list of k Python floats, w_j in the order of ``counts``.

    Raises:
        ValueError: if ``counts`` is empty or a count is < 1.
    """
    raise NotImplementedError("ex11: predict_naive_weights")
