"""Part 02 · 11 — gradient accumulation: k micro-batches, one update.

One update over an effective batch of E sequences can run as one forward/backward (the full
batch) or as k forward/backward passes over micro-batches of E/k sequences whose gradients
add up in ``.grad`` before the optimizer steps once. Gradients add; the loss normalisation
decides whether their sum is the full-batch gradient. With S_j the summed token loss of
micro-batch j, n_j its target tokens and N = sum_j n_j:

* token-weighted: micro-batch j contributes S_j / N, and sum_j S_j / N is the full-batch
  mean loss exactly (up to rounding), whatever the padding;
* naive mean of means: (1/k) sum_j S_j / n_j, equal only when every n_j = N / k. With
  padding (labels -100) a short micro-batch's tokens weigh more; Transformers fixed this
  with ``num_items_in_batch`` (its loss divides the sum by the whole batch's count).

From scratch: ``count_targets``, ``token_loss_sum``, ``accumulated_backward`` (both
normalisations) and right-padded data (``padded_batches``, ``split``); with the framework:
``bp_mech.accumulation_framework.accelerate_updates`` (Accelerate's ``accumulate`` and Transformers'
``num_items_in_batch``).
The experiment (full batch against 2 and 4 micro-batches) is ``bp_mech.experiments.accumulation``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from bp_mech.chunked_loss import IGNORE, shifted_targets  # IGNORE: label of a position that is not a target
from bp_mech.instruments.workload import PAD_ID, Workload, make_batches


# --- data ------------------------------------------------------------------------------

def padded_batches(w: Workload, n: int, micro_max: int,
                   max_pad: float) -> list[dict[str, torch.Tensor]]:
    """``n`` effective batches of E = w.batch * micro_max rows, right-padded at random.

    Row r keeps its first T - p_r tokens (p_r < max_pad * T); the rest become PAD_ID
    inputs with label -100, so micro-batches hold different numbers of target tokens.
    Right padding under a causal mask never changes a real token's logits, so no
    attention mask is needed. The padding is drawn from a generator seeded with
    ``w.seed + 11``: the same call gives the same batches.

    Args:
        w: the workload; ``w.batch`` is the smallest micro-batch, ``w.seq`` is T.
        n: number of effective batches.
        micro_max: the largest number of micro-batches the batches will be split into
            (E = w.batch * micro_max rows, so every k dividing micro_max splits evenly).
        max_pad: the largest padded fraction of a row, in [0, 1); at most T - 2 tokens
            are padded, so every row keeps at least one target.

    Returns:
        A list of ``n`` dicts with ``input_ids`` and ``labels``, each a long tensor of
        shape (E, T).

    Example:
        >>> from bp_mech.instruments.workload import parse_workload
        >>> w = parse_workload("tiny-b1s8")
        >>> b = padded_batches(w, 1, micro_max=2, max_pad=0.5)[0]
        >>> b["input_ids"].shape, b["labels"].shape
        (torch.Size([2, 8]), torch.Size([2, 8]))
        >>> bool(((b["labels"] == -100) == (b["input_ids"] == PAD_ID)).all())
        True
    """
    E, T = w.batch * micro_max, w.seq
    g = torch.Generator().manual_seed(w.seed + 11)
    out = []
    for b in make_batches(w.replace(batch=E), n):
        pads = (torch.rand(E, generator=g) * max_pad * T).long().clamp(max=T - 2)
        pad = torch.arange(T)[None, :] >= (T - pads)[:, None]  # (E, T): padded tail
        out.append({"input_ids": b["input_ids"].masked_fill(pad, PAD_ID),
                    "labels": b["labels"].masked_fill(pad, IGNORE)})
    return out


def split(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """k micro-batches along the batch dimension, in order.

    Args:
        batch: dict of tensors, each of shape (E, ...) (any keys, any trailing
            dimensions).
        k: number of micro-batches, >= 1.

    Returns:
        A list of k dicts with the same keys; micro-batch j holds rows j E/k to (j + 1)
        E/k - 1, each tensor of shape (E/k, ...) (views, not copies).

    Raises:
        ValueError: if k < 1 or E is not divisible by k.

    Example:
        >>> b = {"input_ids": torch.arange(8).view(4, 2)}
        >>> [mb["input_ids"][:, 0].tolist() for mb in split(b, 2)]
        [[0, 2], [4, 6]]
        >>> split(b, 3)
        Traceback (most recent call last):
        ValueError: cannot split a batch of 4 sequences into 3 equal micro-batches
    """
    E = batch["input_ids"].shape[0]
    if k < 1 or E % k:
        raise ValueError(
            f"cannot split a batch of {E} sequences into {k} equal micro-batches")
    return [{key: v[j * (E // k):(j + 1) * (E // k)] for key, v in batch.items()}
            for j in range(k)]


# --- the loss and the accumulated update (from scratch) --------------------------------

def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets that count: labels[:, 1:] != -100 (position t predicts t + 1).

    Args:
        labels: shape (B, T), long, -100 where a position is not a target.

    Returns:
        A 0-dim integer tensor, the number of targets (0 when there is none).

    Example:
        >>> labels = torch.tensor([[5, 6, 7], [8, 9, -100]])  # a row's first: no target
        >>> int(count_targets(labels))
        3
    """
    return (labels[..., 1:] != IGNORE).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies,
    S = sum_t -log softmax(logits[b, t])[labels[b, t + 1]].

    Shifts the labels (pad one -100 on the right) instead of slicing the logits, so
    the (B, T, V) logits are never copied, as Transformers' ForCausalLMLoss does.

    Args:
        logits: shape (B, T, V); float64, float32, bfloat16 or float16.
        labels: shape (B, T), long, -100 where a position is not a target.

    Returns:
        A 0-dim tensor, differentiable with respect to the logits, in at least float32
        (16-bit logits are upcast, float64 stays float64); 0 when there is no target.

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform: each target costs log 4
        >>> labels = torch.tensor([[1, 2, 3]])  # 2 targets: 2 log 4
        >>> round(token_loss_sum(logits, labels).item(), 4)
        2.7726
        >>> token_loss_sum(logits.bfloat16(), labels).dtype
        torch.float32
    """
    shifted = shifted_targets(labels)  # (B, T)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), shifted.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def accumulated_backward(model, batch: dict[str, torch.Tensor], k: int,
                         norm: str = "token") -> torch.Tensor:
    """Forward/backward over k micro-batches; ``.grad`` holds the update's gradient.

    norm="token": loss_j = S_j / N (N = targets of the whole batch); sum_j loss_j is the
    full-batch mean. norm="naive": loss_j = (S_j / n_j) / k, the mean of micro-batch
    means. The gradients add into ``.grad`` (zero it before, as before any update).

    Args:
        model: a causal LM; ``model(input_ids=...)`` returns an object with ``.logits``
            (B, T, V).
        batch: ``input_ids`` and ``labels``, long (E, T) tensors; E divisible by k.
        k: number of micro-batches.
        norm: "token" or "naive".

    Returns:
        The accumulated loss, a detached 0-dim tensor (what a training log shows).

    Raises:
        ValueError: ``norm`` is neither "token" nor "naive".

    Example:
        >>> from bp_mech.instruments.workload import (build_model, make_batches,
        ...                                           parse_workload)
        >>> w = parse_workload("tiny-b4s8"); model = build_model(w)
        >>> batch = make_batches(w, 1)[0]
        >>> full = accumulated_backward(model, batch, k=1)  # token-weighted: k=2 same
        >>> torch.allclose(accumulated_backward(model, batch, k=2), full)
        True
    """
    if norm not in ("token", "naive"):
        raise ValueError(f"unknown normalisation {norm!r}")
    n_total = count_targets(batch["labels"])
    total = 0.0
    for mb in split(batch, k):
        s = token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])
        loss = s / n_total if norm == "token" else s / count_targets(mb["labels"]) / k
        loss.backward()
        total = total + loss.detach()
    return total


@contextlib.contextmanager
def _token_weighted(batch: dict[str, torch.Tensor], k: int):
    n_total = count_targets(batch["labels"])
    yield [dict(mb, num_items_in_batch=n_total) for mb in split(batch, k)]


def token_weighted(batch: dict[str, torch.Tensor], k: int):
    """The accumulation switch (a context manager): the micro-batches of one update.

    k > 1: the k micro-batches of ``split``, each carrying ``num_items_in_batch`` = N, the target
    tokens of the whole batch, so that ``model(**mb).loss`` is Transformers' S_j / N and the gradients
    the k backward passes add up are the full batch's (token-weighted). k == 1: off,
    ``nullcontext([batch])``: the batch as it is, with the model's own mean loss.

    Args:
        batch: ``input_ids`` and ``labels`` (and any other model inputs), tensors of shape (E, ...).
        k: number of micro-batches, >= 1; E divisible by k.

    Returns:
        A context manager whose ``with ... as mbs`` value is the list of micro-batch dicts to
        run forward/backward on, in order.

    Example:
        >>> batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": torch.ones(4, 3, dtype=torch.long)}
        >>> with token_weighted(batch, 2) as mbs:
        ...     [(mb["input_ids"].shape[0], int(mb["num_items_in_batch"])) for mb in mbs]
        [(2, 8), (2, 8)]
        >>> with token_weighted(batch, 1) as mbs:
        ...     mbs[0] is batch
        True
    """
    if k == 1:
        return contextlib.nullcontext([batch])
    return _token_weighted(batch, k)


def snapshot(tensors) -> list[torch.Tensor]:
    """Copies on the tensors' own device (a GPU run never round-trips 2 GB through the host).

    Args:
        tensors: an iterable of tensors (for example ``p.grad for p in model.parameters()``).

    Returns:
        A list of detached clones, in order, each with its tensor's shape, dtype and device.

    Example:
        >>> t = torch.ones(2, requires_grad=True)
        >>> s = snapshot([t * 2])
        >>> s[0].tolist(), s[0].requires_grad
        ([2.0, 2.0], False)
    """
    return [t.detach().clone() for t in tensors]
