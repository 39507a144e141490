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
``accelerate_updates`` (Accelerate's ``accumulate`` and Transformers' ``num_items_in_batch``).
The experiment (full batch against 2 and 4 micro-batches) is ``bp_mech.experiments.accumulation``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from bp_mech.chunked_loss import IGNORE, shifted_targets  # IGNORE: label of a position that is not a target
from bp_mech.bench.workload import PAD_ID, Workload, make_adamw, make_batches


# --- data ------------------------------------------------------------------------------

def padded_batches(w: Workload, n: int, micro_max: int, max_pad: float) -> list[dict[str, torch.Tensor]]:
    """``n`` effective batches of E = w.batch * micro_max rows, right-padded at random.

    Row r keeps its first T - p_r tokens (p_r < max_pad * T); the rest become PAD_ID inputs
    with label -100, so micro-batches hold different numbers of target tokens. Right padding
    under a causal mask never changes a real token's logits, so no attention mask is needed.
    """
    E, T = w.batch * micro_max, w.seq
    g = torch.Generator().manual_seed(w.seed + 11)
    out = []
    for b in make_batches(w.replace(batch=E), n):
        pads = (torch.rand(E, generator=g) * max_pad * T).long().clamp(max=T - 2)  # (E,)
        pad = torch.arange(T)[None, :] >= (T - pads)[:, None]  # (E, T) True on the padded tail
        out.append({"input_ids": b["input_ids"].masked_fill(pad, PAD_ID),
                    "labels": b["labels"].masked_fill(pad, IGNORE)})
    return out


def split(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """k micro-batches along the batch dimension, in order. Raises ValueError if E % k."""
    E = batch["input_ids"].shape[0]
    if k < 1 or E % k:
        raise ValueError(f"cannot split a batch of {E} sequences into {k} equal micro-batches")
    return [{key: v[j * (E // k):(j + 1) * (E // k)] for key, v in batch.items()} for j in range(k)]


# --- the loss and the accumulated update (from scratch) --------------------------------

def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets that count: labels[:, 1:] != -100 (position t predicts t + 1)."""
    return (labels[..., 1:] != IGNORE).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies (at least float32). logits (B, T, V), labels (B, T).

    Shifts the labels (pad one -100 on the right) instead of slicing the logits, so the
    (B, T, V) logits are never copied — the same trick as Transformers' ForCausalLMLoss.
    """
    shifted = shifted_targets(labels)  # (B, T)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # float64 stays
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")


def accumulated_backward(model, batch: dict[str, torch.Tensor], k: int, norm: str = "token") -> torch.Tensor:
    """Forward/backward over k micro-batches; ``.grad`` then holds the update's gradient.

    norm="token": loss_j = S_j / N (N = targets of the whole batch); sum_j loss_j is the
    full-batch mean. norm="naive": loss_j = (S_j / n_j) / k, the mean of micro-batch means.
    Returns the accumulated loss (detached), the value a training log would show.
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
    """
    if k == 1:
        return contextlib.nullcontext([batch])
    return _token_weighted(batch, k)


def snapshot(tensors) -> list[torch.Tensor]:
    """Copies on the tensors' own device (a GPU run never round-trips 2 GB through the host)."""
    return [t.detach().clone() for t in tensors]


# --- with the framework ----------------------------------------------------------------

def accelerate_updates(model, init: dict, batches, k: int, lr: float) -> list[torch.Tensor]:
    """The same updates through Accelerate's ``accumulate`` and Transformers' own loss.

    ``model(..., labels=, num_items_in_batch=N)`` returns S_j / N (Transformers' token-weighted
    loss); ``accelerator.backward`` divides by gradient_accumulation_steps, so it gets k S_j / N.
    The prepared optimizer steps (and zeroes) only on every k-th micro-batch. Returns the first
    update's gradient; the model holds the parameters after the last update.
    """
    from accelerate import Accelerator

    model.load_state_dict(init)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    m, opt = acc.prepare(model, make_adamw(model.parameters(), lr, "cpu"))
    first_grad = None
    for b in batches:
        n = count_targets(b["labels"])  # targets of the whole effective batch
        for mb in split(b, k):
            with acc.accumulate(m):
                out = m(input_ids=mb["input_ids"], labels=mb["labels"], num_items_in_batch=n)
                acc.backward(out.loss * k)
                if acc.sync_gradients and first_grad is None:
                    first_grad = snapshot(p.grad for p in model.parameters())
                opt.step()
                opt.zero_grad()
    return first_grad
