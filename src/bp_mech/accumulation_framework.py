"""Part 02 · 11 — gradient accumulation with the framework: Accelerate's ``accumulate`` and
Transformers' ``num_items_in_batch``, against the hand-written loop of ``bp_mech.accumulation``.

``accelerate_updates`` runs the same updates as ``accumulation.accumulated_backward`` and an AdamW step
per effective batch, the framework's way: the prepared optimizer steps only on every k-th micro-batch,
and the model's own loss is token-weighted by the whole batch's target count.
"""

from __future__ import annotations

import torch

from bp_mech.accumulation import count_targets, snapshot, split
from bp_mech.instruments.adamw import make_adamw


def accelerate_updates(model, init: dict, batches, k: int,
                       lr: float) -> list[torch.Tensor]:
    """The same updates through Accelerate's ``accumulate`` and Transformers' own loss.

    ``model(..., labels=, num_items_in_batch=N)`` returns S_j / N (Transformers'
    token-weighted loss); ``accelerator.backward`` divides by
    gradient_accumulation_steps, so it gets k S_j / N. The prepared optimizer steps (and
    zeroes) only on every k-th micro-batch. CPU, ``make_adamw``'s AdamW; Accelerate's
    own idiom, kept as such (``bench.step`` lists it).

    Args:
        model: a Transformers causal LM (its forward takes ``labels`` and
            ``num_items_in_batch``).
        init: a state dict loaded into ``model`` first, so that runs start from the same
            weights.
        batches: effective batches (``input_ids`` and ``labels`` of shape (E, T)), one
            update each.
        k: micro-batches per update (gradient_accumulation_steps); E divisible by k.
        lr: AdamW's learning rate.

    Returns:
        The first update's gradient, one tensor per parameter in ``model.parameters()``
        order; the model holds the parameters after the last update.

    Example:
        >>> from bp_mech.instruments.workload import (build_model, make_batches,
        ...                                           parse_workload)
        >>> w = parse_workload("tiny-b2s8"); model = build_model(w)
        >>> batches = make_batches(w, 1)
        >>> g = accelerate_updates(model, model.state_dict(), batches, k=2, lr=1e-3)
        >>> [x.shape for x in g] == [p.shape for p in model.parameters()]
        True
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
                out = m(input_ids=mb["input_ids"], labels=mb["labels"],
                        num_items_in_batch=n)
                acc.backward(out.loss * k)
                if acc.sync_gradients and first_grad is None:
                    first_grad = snapshot(p.grad for p in model.parameters())
                opt.step()
                opt.zero_grad()
    return first_grad
