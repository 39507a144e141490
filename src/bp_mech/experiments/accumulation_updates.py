"""Part 02 · 11's equivalence run: the updates one normalisation of the accumulated loss gives.

``train_updates`` trains a model from given weights with AdamW over a few effective batches, as k
micro-batches each, and keeps what the experiment (``bp_mech.experiments.accumulation``) compares with
the full batch: the losses, the first update's gradient and the parameters after it.

The token-weighted normalisation is the one training step, ``bench.step.train_step`` under
``Strategy(micro_batches=k)`` (Transformers' loss with ``num_items_in_batch`` = the whole batch's
target tokens). The naive one, the mean of the micro-batch means (``accumulation.accumulated_backward``
with ``norm="naive"``), is the mistake the chapter demonstrates: it stays this small explicit loop
rather than a bug inside ``Strategy`` (``bench.step`` lists it among the loops outside the one step).
"""

from __future__ import annotations

import contextlib
import math

from bp_mech import accumulation
from bp_mech.bench.compare import all_finite
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import Strategy
from bp_mech.instruments.adamw import make_adamw


def train_updates(model, init: dict, batches, k: int, norm: str, cfg, device) -> dict:
    """``len(batches)`` updates from ``init`` under one normalisation of the accumulated loss.

    Args:
        model: a causal LM; trained in place from ``init``.
        init: the state dict every run starts from.
        batches: effective batches (``input_ids``, ``labels`` of shape (E, T)), one update each.
        k: micro-batches per update; E divisible by k.
        norm: "token" (the one training step under ``micro{k}``) or "naive" (the mistake's
            explicit loop).
        cfg: the experiment's config; ``cfg.lr`` is AdamW's learning rate.
        device: where the model lives (``make_adamw``'s implementation).

    Returns:
        ``{"losses": [...], "finite": bool (every loss and gradient), "grad": the first update's
        gradient, "params_1": the parameters after it}`` (snapshots); the model holds the parameters
        after the last update.

    Example:
        >>> from types import SimpleNamespace
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> w = parse_workload("tiny-b2s8"); model = build_model(w)
        >>> init = {n: t.clone() for n, t in model.state_dict().items()}
        >>> batches = accumulation.padded_batches(w, 1, 2, 0.5)
        >>> full, two = (train_updates(model, init, batches, k, "token", SimpleNamespace(lr=1e-3), "cpu")
        ...              for k in (1, 2))
        >>> abs(two["losses"][0] - full["losses"][0]) < 1e-5, two["finite"]
        (True, True)
    """
    if norm not in ("token", "naive"):
        raise ValueError(f"unknown normalisation {norm!r}")
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)  # after a failed candidate, stale gradients may remain
    opt = make_adamw(model.parameters(), cfg.lr, device)
    losses, finite, out, seen = [], True, {}, {}

    def read(phase, state):  # an observer: the gradient as the optimizer phase begins, before the update
        if phase == "optimizer":
            grads = [p.grad for p in model.parameters()]
            seen.update(finite=all_finite(grads), grad=accumulation.snapshot(grads) if i == 0 else None)
        return contextlib.nullcontext()

    for i, b in enumerate(batches):
        if norm == "token":
            losses.append(train_step(model, opt, b, Strategy(micro_batches=k), observers=[read]).loss.item())
        else:  # the mistake shown: the mean of the micro-batch means, in its own loop
            losses.append(accumulation.accumulated_backward(model, b, k, norm).item())
            read("optimizer", None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finite = finite and seen["finite"]
        if i == 0:
            out["grad"] = seen["grad"]
            out["params_1"] = accumulation.snapshot(model.parameters())
    out.update(losses=losses, finite=finite and all(math.isfinite(x) for x in losses))
    return out
