"""Part 02 · 11: every property the exercise checks hold (``checks/ex11.py``'s declarations, derived by
``checks.engine``) rejects a solution that breaks exactly it, and the variant's and the prediction's checks reject
the classic mistakes."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import mutant

from bp_mech import accumulation, chunked_loss
from bp_mech.checks import ex11
from checks.mutants import (
    attached,
    contiguous_only,
    leaks,
    modifies_input,
    storage_order_only,
)

ANS = mutant("ex11_gradient_accumulation")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny steps: more threads only spin on a shared machine


def _split_mutating(batch, k):  # a "clean-up" of the caller's batch: the ids shifted in place
    parts = accumulation.split(batch, k)
    batch["input_ids"].add_(1)
    return parts


def _split_by_view(batch, k):  # rows flattened with .view(): fails on a non-contiguous tensor
    e = batch["input_ids"].shape[0]
    if k < 1 or e % k:
        raise ValueError("bad k")
    rows = e // k
    return [{key: v.view(e, -1)[j * rows:(j + 1) * rows].view(rows, *v.shape[1:]) for key, v in batch.items()}
            for j in range(k)]


def _naive_log_softmax(z, y, n):  # log(softmax): the softmax underflows to 0 at logits of magnitude 1000
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    y = chunked_loss.shifted_targets(y)
    logp = torch.log(torch.softmax(z, -1))
    keep = y != -100
    return -logp[keep].gather(-1, y[keep][:, None]).sum() / n


def _backward(norm_rows=None, zero_first=False, swallow=False, mutate=False):
    def f(model, batch, k):
        if zero_first:
            model.zero_grad(set_to_none=True)
        n_total = accumulation.count_targets(batch["labels"])
        total = 0.0
        for mb in accumulation.split(batch, k):
            try:
                s = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])
            except RuntimeError:
                if swallow:
                    continue
                raise
            loss = s / n_total
            loss.backward()
            total = total + loss.detach()
        if mutate:
            batch["labels"][:, 0] = -100  # "the first position is never a target" written into the batch
        return total
    return f


def _per_sequence(rows="batch", clamp=True, check=True):
    def f(model, batch, k):
        n = (batch["labels"][:, 1:] != -100).sum(1)
        r = {"batch": int((n > 0).sum()), "all": n.shape[0]}.get(rows)
        if check and int((n > 0).sum()) == 0:
            raise ValueError("no target")
        total = 0.0
        for mb in accumulation.split(batch, k):
            z, y = model(input_ids=mb["input_ids"]).logits, mb["labels"][:, 1:]
            tok = F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100,
                                  reduction="none").view(y.shape)
            cnt = (y != -100).sum(1)
            per_row = tok.sum(1) / (cnt.clamp(min=1) if clamp else cnt)
            denom = r if r is not None else max(1, int((cnt > 0).sum())) * k  # "micro": a mean per micro-batch
            loss = per_row.sum() / denom
            loss.backward()
            total = total + loss.detach()
        return total
    return f


def _no_value_error(model, batch, k):
    if int(((batch["labels"][:, 1:] != -100).sum(1) > 0).sum()) == 0:
        return torch.zeros((), dtype=torch.float64)
    return ANS.accumulated_backward_per_sequence(model, batch, k)


def _per_seq_wrapped(kind):
    def f(model, batch, k):
        if kind == "zero-first":
            model.zero_grad(set_to_none=True)
        try:
            out = ANS.accumulated_backward_per_sequence(model, batch, k)
        except RuntimeError:
            if kind == "swallow":
                return torch.zeros((), dtype=torch.float64)
            raise
        if kind == "mutate":
            batch["labels"][:, 0] = -100
        return out
    return f


def _weights(kind):
    def f(counts):
        if not counts or min(counts) < 1:
            raise ValueError("bad")
        n, k = sum(counts), len(counts)
        if kind == "sorts":
            counts.sort()
        return {"no-k": lambda: [n / c for c in counts], "inverted": lambda: [k * c / n for c in counts],
                "tuple": lambda: tuple(n / (k * c) for c in counts),
                "numpy": lambda: list(np.float64(n) / (k * np.array(counts))),
                "sorts": lambda: [n / (k * c) for c in counts]}[kind]()
    return f


A = ANS
CASES = [
    (ex11.check_split, {"split": _split_mutating}, r"batch\['input_ids'\] was modified in place"),
    (ex11.check_split, {"split": _split_by_view}, "raised RuntimeError at .*non-contiguous"),
    (ex11.check_split, {"split": lambda b, k: tuple(accumulation.split(b, k))}, "the result is a tuple"),
    (ex11.check_count_targets,
     {"count_targets": modifies_input(A.count_targets, 0, how=lambda t: t.masked_fill_(t == -100, 0))},
     "labels was modified in place"),
    (ex11.check_count_targets, {"count_targets": storage_order_only(A.count_targets)}, "non-contiguous"),
    (ex11.check_micro_batch_loss, {"micro_batch_loss": _naive_log_softmax}, "non-finite values"),
    (ex11.check_micro_batch_loss, {"micro_batch_loss": modifies_input(A.micro_batch_loss, 0)},
     "logits was modified in place"),
    (ex11.check_micro_batch_loss,
     {"micro_batch_loss": modifies_input(A.micro_batch_loss, 1, how=lambda t: t.masked_fill_(t == -100, 0))},
     "labels was modified in place"),
    (ex11.check_micro_batch_loss, {"micro_batch_loss": contiguous_only(A.micro_batch_loss)},
     "raised RuntimeError at .*view"),
    (ex11.check_accumulated_backward, {"accumulated_backward": _backward(mutate=True)},
     r"batch\['labels'\] was modified in place"),
    (ex11.check_accumulated_backward, {"accumulated_backward": _backward(zero_first=True)},
     "grad already holding"),
    (ex11.check_accumulated_backward, {"accumulated_backward": _backward(swallow=True)},
     "propagate it"),
    (ex11.check_accumulated_backward, {"accumulated_backward": attached(A.accumulated_backward)},
     "attached to the autograd graph"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": A.accumulated_backward},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence("micro")},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence("all")},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence(clamp=False)},
     "the returned loss has .* non-finite values"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _no_value_error},
     r"for a batch without any target \(R = 0\), expected ValueError"),
    (ex11.check_accumulated_backward_per_sequence,
     {"accumulated_backward_per_sequence": attached(A.accumulated_backward_per_sequence)}, "attached"),
    (ex11.check_accumulated_backward_per_sequence,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("zero-first")}, "grad already holding"),
    (ex11.check_accumulated_backward_per_sequence,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("swallow")}, "propagate it"),
    (ex11.check_accumulated_backward_per_sequence,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("mutate")}, r"batch\['labels'\] was modified in place"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("no-k")}, "measured ratio"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("inverted")}, "measured ratio"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("sorts")}, "counts was modified in place"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("tuple")}, "the prediction is a tuple"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("numpy")},
     r"the prediction\[0\] is a float64, expected a float"),
]


@pytest.mark.parametrize("check, over, message", CASES, ids=[
    "split-mutates-batch", "split-view-only", "split-tuple", "count-mutates-labels", "count-storage-order",
    "loss-log-of-softmax", "loss-mutates-logits", "loss-mutates-labels", "loss-contiguous-only",
    "backward-mutates-batch", "backward-zeroes-grad", "backward-swallows-error", "backward-attached",
    "per-seq-token-weighted", "per-seq-mean-per-micro", "per-seq-all-rows", "per-seq-nan-rows", "per-seq-no-valueerror",
    "per-seq-attached", "per-seq-zeroes-grad", "per-seq-swallows-error", "per-seq-mutates-batch", "weights-no-k",
    "weights-inverted", "weights-sort-in-place", "weights-tuple", "weights-numpy"])
def test_contract_check_rejects(check, over, message):
    function = check.__name__.removeprefix("check_").split("__")[0]
    with pytest.raises(AssertionError, match=f"^{function}: .*{message}"):
        check(mutant("ex11_gradient_accumulation", **over))


# --- the properties the engine derives (ex11's declarations), and an outsider's wrong solutions ---------------




def _sgd_step(model, batch, k):  # "one update": the parameters moved (the docstring says no optimizer step)
    out = A.accumulated_backward(model, batch, k)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    return out


def _no_shift(z, y, n):  # every position a target of its own logits
    return F.cross_entropy(z.reshape(-1, z.shape[-1]).float() if z.dtype in (torch.float16, torch.bfloat16) else
                           z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum") / n


def _mean_times_count(z, y, n):  # F.cross_entropy's mean, rescaled: NaN on a micro-batch without targets
    c = (y[:, 1:] != -100).sum()
    return F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), y[:, 1:].reshape(-1)) * c / n


def _first_always_target(y):  # n = #(labels != -100) - one per row: wrong when a row starts masked
    return (y != -100).sum() - y.shape[0]


def _split_interleaved(b, k):
    e = b["input_ids"].shape[0]
    if k < 1 or e % k:
        raise ValueError("bad k")
    return [{key: v[j::k] for key, v in b.items()} for j in range(k)]


def _split_no_remainder_check(b, k):
    if k < 1:
        raise ValueError("k < 1")
    return [dict(zip(b, vs)) for vs in zip(*(torch.tensor_split(v, k) for v in b.values()))]


def _weights_floor(counts):
    if not counts or min(counts) < 1:
        raise ValueError("bad")
    return [sum(counts) // (len(counts) * c) for c in counts]


DERIVED = {
    "split: float64 out": (ex11.check_split, {"split": lambda b, k: [{key: v.double() if v.is_floating_point() else v
                           for key, v in p.items()} for p in accumulation.split(b, k)]}, "expected torch.float32"),
    "split: interleaved rows": (ex11.check_split, {"split": _split_interleaved}, "differs from the rows"),
    "split: tensor_split, no ValueError": (ex11.check_split, {"split": _split_no_remainder_check},
                                           "expected ValueError"),
    "count: a float tensor": (ex11.check_count_targets, {"count_targets": lambda y: A.count_targets(y).float()},
                              "returned a float32 tensor, expected a 0-dim integer tensor|dtype torch.float32, expected integers"),
    "count: shifted the wrong way": (ex11.check_count_targets,
                                     {"count_targets": lambda y: (y[:, :-1] != -100).sum()}, "the count differs"),
    "count: a Python int": (ex11.check_count_targets, {"count_targets": lambda y: int(A.count_targets(y))},
                            "the count is an int, expected a tensor"),
    "count: first position assumed a target": (ex11.check_count_targets__prompt_masked,
                                               {"count_targets": _first_always_target}, "the count differs"),
    "loss: float64 out": (ex11.check_micro_batch_loss, {"micro_batch_loss": lambda z, y, n: A.micro_batch_loss(
        z.double(), y, n)}, "the share has dtype torch.float64, expected torch.float32 at float32 inputs"),
    "loss: always float32": (ex11.check_micro_batch_loss, {"micro_batch_loss": lambda z, y, n: A.micro_batch_loss(
        z.float(), y, n)}, "has dtype torch.float32, expected torch.float64"),
    "loss: grad mode left off": (ex11.check_micro_batch_loss, {"micro_batch_loss": leaks(
        A.micro_batch_loss, lambda *a: torch.set_grad_enabled(False))}, "left the grad mode changed"),
    "loss: no shift": (ex11.check_micro_batch_loss, {"micro_batch_loss": _no_shift}, "the share differs"),
    "loss: mean times count": (ex11.check_micro_batch_loss, {"micro_batch_loss": _mean_times_count},
                               "non-finite values"),
    "loss: 16-bit out": (ex11.check_micro_batch_loss__half_precision, {"micro_batch_loss": lambda z, y, n: (
        A.micro_batch_loss(z, y, n).to(z.dtype))}, "the share's dtype is 'torch.(bfloat|float)16'"),
    "backward: model left in eval mode": (ex11.check_accumulated_backward, {"accumulated_backward": leaks(
        A.accumulated_backward, lambda model, *a: model.eval())}, "left the model.training changed"),
    "backward: a hook left registered": (ex11.check_accumulated_backward, {"accumulated_backward": leaks(
        A.accumulated_backward, lambda model, *a: model.register_forward_hook(lambda *h: None))},
        "left the model's forward hooks changed"),
    "backward: an optimizer step": (ex11.check_accumulated_backward, {"accumulated_backward": _sgd_step},
                                    r"model\.\w+ was modified in place"),
    "backward: a Python float": (ex11.check_accumulated_backward, {"accumulated_backward": lambda *a: float(
        A.accumulated_backward(*a))}, "the returned loss is a float, expected a tensor"),
    "backward: divided by k again": (ex11.check_accumulated_backward, {"accumulated_backward": lambda m, b, k: (
        A.accumulated_backward(m, b, k) / k)}, "the returned loss differs"),
    "per-seq: default dtype left float64": (ex11.check_accumulated_backward_per_sequence, {
        "accumulated_backward_per_sequence": leaks(A.accumulated_backward_per_sequence,
                                                    lambda *a: torch.set_default_dtype(torch.float64))},
        "left the default dtype changed"),
    "predict: reseeds torch": (ex11.check_predict_naive_weights, {"predict_naive_weights": leaks(
        A.predict_naive_weights, lambda *a: torch.manual_seed(0))}, "left the torch RNG state changed"),
    "predict: integer division": (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights_floor},
                                  r"the prediction\[0\] is an int, expected a float"),
    "predict: no ValueError": (ex11.check_predict_naive_weights, {"predict_naive_weights": lambda c: [
        sum(c) / (len(c) * x) for x in c]}, "expected ValueError"),
}


@pytest.mark.parametrize("name", list(DERIVED))
def test_the_derived_properties_and_an_outsider_s_mistakes_are_rejected(name):
    check, over, message = DERIVED[name]
    with pytest.raises(AssertionError, match=f"^{next(iter(over))}: .*{message}"):
        check(mutant("ex11_gradient_accumulation", **over))
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32  # put back for the next test
