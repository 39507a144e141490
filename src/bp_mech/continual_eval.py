"""Part 02 · 56 — the numbers of continual pretraining: loss per token, domain gain, holdout drift.

``eval_batches`` cuts an evaluation text into non-overlapping windows, so every token is
counted once; ``token_loss`` is the mean next-token loss per target token over them (the
L(D) of ``bp_mech.continual_pretrain``);
``gain_and_drift`` turns a run's evaluations into domain gain and holdout drift;
``resume_difference`` compares a run resumed from a saved state with the uninterrupted
one.
"""

from __future__ import annotations

import math

import torch

from bp_mech.chunked_loss import IGNORE
from bp_mech.accumulation import count_targets, token_loss_sum
from bp_mech.instruments.workload import PAD_ID


def eval_batches(ids: torch.Tensor, seq: int,
                 batch: int) -> list[dict[str, torch.Tensor]]:
    """The whole text once, as non-overlapping windows of ``seq`` tokens.

    ``batch`` windows make one batch.

    The last window is right-padded: PAD_ID inputs with label -100 (not targets). Under
    a causal mask right padding never changes a real token's logits.

    Args:
        ids: (N,) token ids of the text.
        seq: tokens per window.
        batch: windows per batch; the last batch may hold fewer.

    Returns:
        A list of ``{"input_ids", "labels"}`` dicts of (b, seq) int64 tensors, b <=
        ``batch``.

    Example:
        >>> batches = eval_batches(torch.arange(1, 21), seq=8, batch=2)
        >>> ([tuple(b["labels"].shape) for b in batches],
        ...  batches[-1]["labels"][0].tolist())
        ([(2, 8), (1, 8)], [17, 18, 19, 20, -100, -100, -100, -100])
    """
    windows = math.ceil(len(ids) / seq)
    x = torch.full((windows * seq,), PAD_ID, dtype=torch.long)
    y = torch.full((windows * seq,), IGNORE, dtype=torch.long)
    x[:len(ids)], y[:len(ids)] = ids, ids
    x, y = x.view(windows, seq), y.view(windows, seq)
    return [{"input_ids": x[i:i + batch], "labels": y[i:i + batch]}
            for i in range(0, windows, batch)]


@torch.no_grad()
def token_loss(model, batches) -> float:
    """Mean next-token cross-entropy per target token over all ``batches``.

    In nats per token.

    Each batch holds ``input_ids`` and ``labels`` (B, T); label -100 marks a position
    that is not a target. The token losses of all batches are summed, and divided once
    by the number of targets of all batches (float64 accumulation): every token weighs
    the same, however the batches are filled. The model runs in eval mode, without
    gradients, and gets its train/eval mode back.

    Args:
        model: a causal LM whose output has ``.logits`` (B, T, V).
        batches: an iterable of ``{"input_ids", "labels"}`` dicts, e.g. from
            ``eval_batches``.

    Returns:
        The mean loss per target token, a Python float.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> loss = token_loss(model, eval_batches(torch.arange(40), seq=8, batch=2))
        >>> # near log(vocab) at init; train mode kept
        >>> abs(loss - math.log(384)) < 1, model.training
        (True, True)
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for b in batches:
            labels = b["labels"].to(device)
            logits = model(input_ids=b["input_ids"].to(device)).logits  # (B, T, V)
            total += token_loss_sum(logits, labels).double()
            count += int(count_targets(labels))
            del logits
    finally:  # also when the model raises
        model.train(was_training)
    return (total / count).item()


def resume_difference(main: dict, resumed: dict, clock: dict, final, got) -> dict:
    """A resumed ``domain_run`` against the uninterrupted one, from the saved state's ``clock``.

    The losses of the steps after it (relative), the evaluations both made (absolute)
    and the final weights ``got`` against ``final`` (relative; 0.0 everywhere: bit for
    bit).

    Args:
        main: the uninterrupted run's ``domain_run`` result, its steps counted from
            update 0.
        resumed: the resumed run's ``domain_run`` result; its evaluations hold
            ``domain`` and ``holdout``.
        clock: the saved state's clock, ``{"updates", "skipped"}``: ``main``'s steps
            after it are compared.
        final: the uninterrupted run's final parameter tensors.
        got: the resumed run's final parameter tensors, in the same order.

    Returns:
        ``from_update``; ``loss_rel_diff`` (largest relative step-loss difference; inf
        when the step counts differ); ``eval_abs_diff`` (largest absolute difference of
        the evaluations both made); ``weight_rel_diff`` (largest max-abs difference over
        a tensor's max-abs); ``bitwise`` (all three 0.0); ``steps`` (the resumed run's
        step count).

    Example:
        >>> main = dict(steps=[dict(loss=3.0), dict(loss=2.5)], evals=[dict(update=2, domain=2.0, holdout=3.0)])
        >>> resumed = dict(steps=[dict(loss=2.5)], evals=[dict(update=2, domain=2.0, holdout=3.0)])
        >>> d = resume_difference(main, resumed, dict(updates=1, skipped=0), [torch.ones(2)], [torch.ones(2)])
        >>> d["from_update"], d["steps"], d["bitwise"]
        (1, 1, True)
    """
    calls = clock["updates"] + clock["skipped"]
    a, b = [r["loss"] for r in main["steps"][calls:]], [r["loss"] for r in resumed["steps"]]
    loss_diff = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else math.inf
    ref = {e["update"]: e for e in main["evals"]}
    eval_diff = max((abs(e[k] - ref[e["update"]][k]) for e in resumed["evals"] if e["update"] in ref
                     for k in ("domain", "holdout")), default=0.0)
    weight_diff = max(((g.detach().double() - f.double()).abs().max() / f.double().abs().max().clamp_min(1e-300)).item()
                      for g, f in zip(got, final))
    bitwise = loss_diff == 0.0 and eval_diff == 0.0 and weight_diff == 0.0
    return dict(from_update=clock["updates"], loss_rel_diff=loss_diff, eval_abs_diff=eval_diff,
                weight_rel_diff=weight_diff, bitwise=bitwise, steps=len(b))


def gain_and_drift(evals: list[dict]) -> dict:
    """Domain gain and holdout drift between the first and the last evaluation (nats per token).

    Absolute and relative to the first, and the largest holdout drift on the way (and
    where).

    Args:
        evals: ``domain_run`` evaluations, ``[{"update", "domain", "holdout"}, ...]``,
            in update order.

    Returns:
        ``domain_gain``, ``holdout_drift``, ``domain_gain_rel``, ``holdout_drift_rel``,
        ``updates`` (between the first and the last), ``max_holdout_drift`` and
        ``max_drift_update`` (where it was reached).

    Example:
        >>> d = gain_and_drift([dict(update=0, domain=4.0, holdout=3.0), dict(update=5, domain=3.0, holdout=3.5),
        ...                     dict(update=10, domain=2.0, holdout=3.25)])
        >>> d["domain_gain"], d["holdout_drift"], d["max_holdout_drift"], d["max_drift_update"]
        (2.0, 0.25, 0.5, 5)
    """
    first, last = evals[0], evals[-1]
    gain, drift = first["domain"] - last["domain"], last["holdout"] - first["holdout"]
    peak = max(evals, key=lambda e: e["holdout"])
    return dict(domain_gain=gain, holdout_drift=drift, domain_gain_rel=gain / first["domain"],
                holdout_drift_rel=drift / first["holdout"], updates=last["update"] - first["update"],
                max_holdout_drift=peak["holdout"] - first["holdout"], max_drift_update=peak["update"])
