"""Part 02 · 11, the mechanism (``bp_mech.accumulation``): padded uneven data, the token-weighted
accumulated loss is the full batch's and the naive one is not, Accelerate's scaling, and the exercise
checks (mutants). The experiment's tests are in tests/experiments/test_accumulation.py."""


import pytest
import torch
import torch.nn.functional as F

from bp_mech import accumulation, chunked_loss
from bp_mech.update_dynamics import global_grad_norm
from bp_mech.instruments.workload import PAD_ID, build_model, parse_workload
from bp_mech.checks import ex11

W = parse_workload("tiny-b2s16")
UPDATES, MICRO_MAX, MAX_PAD = 2, 4, 0.75  # the experiment's padding, two batches


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    return model, init, accumulation.padded_batches(W, UPDATES, MICRO_MAX, MAX_PAD)


def test_padded_batches_are_uneven(setup):
    _, _, batches = setup
    for b in batches:
        assert b["input_ids"].shape == (W.batch * MICRO_MAX, W.seq)
        assert torch.equal(b["input_ids"] == PAD_ID, b["labels"] == chunked_loss.IGNORE)
        for k in (2, 4):
            counts = [int(accumulation.count_targets(mb["labels"])) for mb in accumulation.split(b, k)]
            assert len(set(counts)) > 1, f"micro-batches of k={k} must hold different target counts: {counts}"


def test_right_padding_leaves_real_logits_unchanged(setup):
    model, init, batches = setup
    model.load_state_dict(init)
    b = batches[0]
    real = b["labels"] != chunked_loss.IGNORE
    from bp_mech.instruments.workload import make_batches
    plain = make_batches(W.replace(batch=W.batch * MICRO_MAX), 1)[0]["input_ids"]
    assert torch.equal(plain[real], b["input_ids"][real])
    with torch.no_grad():
        a, p = model(input_ids=b["input_ids"]).logits, model(input_ids=plain).logits
    assert (a[real] - p[real]).abs().max().item() < 1e-5


def test_accumulated_loss_is_the_full_batch_loss(setup):
    model, init, batches = setup
    model.load_state_dict(init)
    b = batches[0]
    want = torch.nn.functional.cross_entropy(
        model(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, 384), b["labels"][:, 1:].reshape(-1))
    model.zero_grad(set_to_none=True)
    got = accumulation.accumulated_backward(model, b, 4, "token")
    naive = accumulation.accumulated_backward(model, b, 4, "naive")
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    assert abs(naive.item() - want.item()) > 1e-7 * want.item()
    with pytest.raises(ValueError):
        accumulation.accumulated_backward(model, b, 4, "mean")


def test_split_refuses_uneven():
    b = {"input_ids": torch.zeros(6, 4, dtype=torch.long)}
    assert len(accumulation.split(b, 3)) == 3
    for k in (0, 4):
        with pytest.raises(ValueError):
            accumulation.split(b, k)


def test_accelerate_divides_by_k_so_the_loss_is_scaled(setup):
    """accelerator.backward(loss) divides by gradient_accumulation_steps: without * k the
    gradient is 1/k of the full batch's (the conformance row passes only with the scaling)."""
    from accelerate import Accelerator

    model, init, batches = setup
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    accumulation.accumulated_backward(model, batches[0], 2)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    n = accumulation.count_targets(batches[0]["labels"])
    for mb in accumulation.split(batches[0], 2):
        with acc.accumulate(model):
            acc.backward(model(input_ids=mb["input_ids"], labels=mb["labels"], num_items_in_batch=n).loss)
    got = [p.grad for p in model.parameters()]
    diff = global_grad_norm([a.double() - b.double() for a, b in zip(got, want)])
    ratio = diff / global_grad_norm(want, torch.float64)
    assert abs(ratio.item() - 0.5) < 1e-5


# --- mutants: the checks catch the classic mistakes --------------------------------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex11_gradient_accumulation", **over)


def _naive_backward(model, batch, k):  # mean of micro-batch means
    total = 0.0
    for mb in accumulation.split(batch, k):
        s = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])
        loss = s / accumulation.count_targets(mb["labels"]) / k
        loss.backward()
        total = total + loss.detach()
    return total


def _zeroing_backward(model, batch, k):  # zero_grad inside the loop: only the last micro-batch survives
    n = accumulation.count_targets(batch["labels"])
    total = 0.0
    for mb in accumulation.split(batch, k):
        model.zero_grad()
        loss = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / n
        loss.backward()
        total = total + loss.detach()
    return total


def _unscaled_backward(model, batch, k):  # plain micro-batch means, no 1/k at all
    total = 0.0
    for mb in accumulation.split(batch, k):
        s = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])
        loss = s / accumulation.count_targets(mb["labels"])
        loss.backward()
        total = total + loss.detach()
    return total


def _input_mask_backward(model, batch, k):  # N counted from the inputs (not PAD), not from the labels
    n = (batch["input_ids"][:, 1:] != ex11.PAD).sum()
    total = 0.0
    for mb in accumulation.split(batch, k):
        loss = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / n
        loss.backward()
        total = total + loss.detach()
    return total


def _reweighted_mean_backward(model, batch, k):  # mean * n_j / N: 0/0 = NaN on a micro-batch without targets
    n = accumulation.count_targets(batch["labels"])
    total = 0.0
    for mb in accumulation.split(batch, k):
        logits, y = model(input_ids=mb["input_ids"]).logits, mb["labels"]
        mean = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
        loss = mean * accumulation.count_targets(y) / n
        loss.backward()
        total = total + loss.detach()
    return total


def _autograd_grad_backward(model, batch, k):  # torch.autograd.grad over every parameter, frozen ones too
    n = accumulation.count_targets(batch["labels"])
    params, total = list(model.parameters()), 0.0
    for mb in accumulation.split(batch, k):
        loss = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / n
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.grad = g if p.grad is None else p.grad + g
        total = total + loss.detach()
    return total


def _undetached_backward(model, batch, k):  # returns the loss with its graph
    n = accumulation.count_targets(batch["labels"])
    total = 0.0
    for mb in accumulation.split(batch, k):
        loss = accumulation.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / n
        loss.backward(retain_graph=True)
        total = total + loss
    return total


def _loss_in_logits_dtype(z, y, n):  # no upcast: the 16-bit sum loses digits
    shifted = F.pad(y, (0, 1), value=-100)[..., 1:]
    s = F.cross_entropy(z.reshape(-1, z.shape[-1]), shifted.reshape(-1), ignore_index=-100, reduction="sum")
    return (s / n).float()


@pytest.mark.parametrize("check,over", [
    (ex11.check_accumulated_backward, dict(accumulated_backward=_naive_backward)),
    (ex11.check_accumulated_backward, dict(accumulated_backward=_zeroing_backward)),
    (ex11.check_accumulated_backward, dict(accumulated_backward=_unscaled_backward)),
    (ex11.check_accumulated_backward, dict(accumulated_backward=_undetached_backward)),
    (ex11.check_accumulated_backward__prompt_masked, dict(accumulated_backward=_input_mask_backward)),
    (ex11.check_accumulated_backward__prompt_masked, dict(accumulated_backward=_reweighted_mean_backward)),
    (ex11.check_accumulated_backward__prompt_masked, dict(accumulated_backward=_autograd_grad_backward)),
    (ex11.check_micro_batch_loss,
     dict(micro_batch_loss=lambda z, y, n:
          accumulation.token_loss_sum(z, y) / accumulation.count_targets(y) / 2)),  # mean of means (k=2)
    (ex11.check_micro_batch_loss,
     dict(micro_batch_loss=lambda z, y, n: accumulation.token_loss_sum(z, y) / n.item())),  # n_total as a tensor only
    (ex11.check_micro_batch_loss,
     dict(micro_batch_loss=lambda z, y, n: torch.tensor(accumulation.token_loss_sum(z, y).item() / int(n),
                                                         dtype=z.dtype))),  # a number, cut from the graph
    (ex11.check_micro_batch_loss__half_precision, dict(micro_batch_loss=_loss_in_logits_dtype)),
    (ex11.check_count_targets, dict(count_targets=lambda y: (y != -100).sum())),  # forgot the shift
    (ex11.check_count_targets, dict(count_targets=lambda y: (y[:, 1:] > 0).sum())),  # token 0 taken for padding
    (ex11.check_count_targets__prompt_masked, dict(count_targets=lambda y: int((y[:, 1:] != -100).sum()))),
    (ex11.check_split, dict(split=lambda b, k: [{key: v for key, v in b.items()}] * k)),
    (ex11.check_split, dict(split=lambda b, k: [dict(zip(b, vs)) for vs in zip(*(v.chunk(k) for v in b.values()))])),
    (ex11.check_split, dict(split=lambda b, k: accumulation.split(b, k) if k > 0 else [])),  # k <= 0 accepted
    (ex11.check_split, dict(split=lambda b, k: [{"input_ids": p["input_ids"], "labels": p["labels"]}
                                                for p in accumulation.split(b, k)])),  # other keys dropped
], ids=["naive-mean-of-means", "zero-grad-per-micro", "no-scaling", "loss-not-detached", "count-from-inputs",
        "mean-times-count-nan", "autograd-grad-frozen", "loss-mean-of-means", "n-total-tensor-only",
        "loss-not-differentiable", "loss-in-16-bit", "count-no-shift", "count-token-0-as-pad", "count-python-int",
        "split-copies", "split-no-valueerror", "split-accepts-negative-k", "split-drops-keys"])
def test_checks_catch_mistakes(check, over):
    function = check.__name__.removeprefix("check_").split("__")[0]
    with pytest.raises(AssertionError, match=f"^{function}: "):
        check(_solution(**over))
