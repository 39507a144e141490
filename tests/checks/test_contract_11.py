"""Part 02 · 11: every property the contract checks hold (``checks/ex11_contract.py``) rejects a solution
that breaks exactly it, and the variant's and the prediction's checks reject the classic mistakes."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import mutant

from bp_mech import accumulation, chunked_loss
from bp_mech.checks import ex11, ex11_contract
from checks.mutants import (
    attached,
    contiguous_only,
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
    (ex11_contract.check_split__contract, {"split": _split_mutating}, r"batch\['input_ids'\] was modified in place"),
    (ex11_contract.check_split__contract, {"split": _split_by_view}, "raised RuntimeError at .*non-contiguous"),
    (ex11_contract.check_split__contract, {"split": lambda b, k: tuple(accumulation.split(b, k))}, "the result is a tuple"),
    (ex11_contract.check_count_targets__contract,
     {"count_targets": modifies_input(A.count_targets, 0, how=lambda t: t.masked_fill_(t == -100, 0))},
     "labels was modified in place"),
    (ex11_contract.check_count_targets__contract, {"count_targets": storage_order_only(A.count_targets)}, "non-contiguous"),
    (ex11_contract.check_micro_batch_loss__contract, {"micro_batch_loss": _naive_log_softmax}, "non-finite values"),
    (ex11_contract.check_micro_batch_loss__contract, {"micro_batch_loss": modifies_input(A.micro_batch_loss, 0)},
     "logits was modified in place"),
    (ex11_contract.check_micro_batch_loss__contract,
     {"micro_batch_loss": modifies_input(A.micro_batch_loss, 1, how=lambda t: t.masked_fill_(t == -100, 0))},
     "labels was modified in place"),
    (ex11_contract.check_micro_batch_loss__contract, {"micro_batch_loss": contiguous_only(A.micro_batch_loss)},
     "raised RuntimeError at .*view"),
    (ex11_contract.check_accumulated_backward__contract, {"accumulated_backward": _backward(mutate=True)},
     r"batch\['labels'\] was modified in place"),
    (ex11_contract.check_accumulated_backward__contract, {"accumulated_backward": _backward(zero_first=True)},
     "grad already holding"),
    (ex11_contract.check_accumulated_backward__contract, {"accumulated_backward": _backward(swallow=True)},
     "did not propagate"),
    (ex11_contract.check_accumulated_backward__contract, {"accumulated_backward": attached(A.accumulated_backward)},
     "attached to the autograd graph"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": A.accumulated_backward},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence("micro")},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence("all")},
     "returned loss"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _per_sequence(clamp=False)},
     "returned loss is nan"),
    (ex11.check_accumulated_backward_per_sequence, {"accumulated_backward_per_sequence": _no_value_error},
     r"for R = 0 \(the per-sequence mean is undefined\), expected ValueError"),
    (ex11_contract.check_accumulated_backward_per_sequence__contract,
     {"accumulated_backward_per_sequence": attached(A.accumulated_backward_per_sequence)}, "attached"),
    (ex11_contract.check_accumulated_backward_per_sequence__contract,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("zero-first")}, "grad already holding"),
    (ex11_contract.check_accumulated_backward_per_sequence__contract,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("swallow")}, "did not propagate"),
    (ex11_contract.check_accumulated_backward_per_sequence__contract,
     {"accumulated_backward_per_sequence": _per_seq_wrapped("mutate")}, r"batch\['labels'\] was modified in place"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("no-k")}, "measured ratio"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("inverted")}, "measured ratio"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("sorts")}, "counts was modified in place"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("tuple")}, "the prediction is a tuple"),
    (ex11.check_predict_naive_weights, {"predict_naive_weights": _weights("numpy")}, "expected a list of .* floats"),
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
