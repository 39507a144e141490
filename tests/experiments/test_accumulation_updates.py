"""``experiments.accumulation_updates``: the first loss and gradient of each normalisation against its
definition by hand (one autograd pass over the micro-batches), and the update after it. Micro-batches with
different target counts make the two normalisations differ."""

import copy
from types import SimpleNamespace

import pytest
import torch

from bp_mech.experiments.accumulation_updates import train_updates
from bp_mech.instruments.workload import build_model, make_batches, parse_workload

CFG = SimpleNamespace(lr=1e-3)


@pytest.fixture(scope="module")
def setup():
    w = parse_workload("tiny-b4s8")
    model = build_model(w)
    batches = make_batches(w, 2)
    for b in batches:
        b["labels"] = b["labels"].clone()
        b["labels"][0, 2:] = -100  # the first micro-batch holds fewer targets than the second
    return model, copy.deepcopy(model.state_dict()), batches


def _hand(model, batch, k, norm):
    """(loss, gradient) of the accumulated loss, from its definition: token-weighted, sum_j S_j / N; naive,
    the mean over micro-batches of each one's mean token loss."""
    parts = [{key: v.chunk(k)[i] for key, v in batch.items()} for i in range(k)]
    sums, counts = [], []
    for mb in parts:
        logits = model(input_ids=mb["input_ids"]).logits[:, :-1].flatten(0, 1)
        labels = mb["labels"][:, 1:].flatten()
        sums.append(torch.nn.functional.cross_entropy(logits, labels, reduction="sum", ignore_index=-100))
        counts.append((labels != -100).sum())
    loss = sum(sums) / sum(counts) if norm == "token" else sum(s / n for s, n in zip(sums, counts)) / k
    return loss.item(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("norm", ["token", "naive"])
def test_the_first_loss_and_gradient_are_the_normalisation_s_definition(setup, norm):
    model, init, batches = setup
    model.load_state_dict(init)
    loss, grads = _hand(model, batches[0], 2, norm)
    out = train_updates(model, init, batches, 2, norm, CFG, "cpu")
    assert out["losses"][0] == pytest.approx(loss, rel=1e-5) and len(out["losses"]) == 2 and out["finite"]
    for got, want in zip(out["grad"], grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_token_weighting_is_the_full_batch_and_the_naive_mean_is_not(setup):
    model, init, batches = setup
    one = train_updates(model, init, batches, 1, "token", CFG, "cpu")
    two = train_updates(model, init, batches, 2, "token", CFG, "cpu")
    naive = train_updates(model, init, batches, 2, "naive", CFG, "cpu")
    assert two["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)
    assert abs(naive["losses"][0] - one["losses"][0]) > 1e-3
    for a, b in zip(two["params_1"], one["params_1"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_unknown_normalisation_is_refused(setup):
    with pytest.raises(ValueError, match="unknown normalisation"):
        train_updates(*setup[:2], setup[2], 2, "mean", CFG, "cpu")
