"""``bench.step``: the one training step against a hand-written step (autograd, then SGD by hand).

The strategies' equality with the plain step is ``tests/bench/test_strategy.py``; which loops must be this
step is ``tests/bench/test_step_users.py``. Here: what the plain step itself computes.
"""

import copy

import pytest
import torch

from bp_mech.bench.step import PHASES, apply_update, optimizer_state, probe, train_step
from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.instruments.workload import build_model, make_batches, parse_workload
from bp_mech.scheduler import UpdateClock, WSDConfig

LR = 0.5


@pytest.fixture(scope="module")
def setup():
    w = parse_workload("tiny-b2s8")
    return build_model(w), make_batches(w, 1)[0]


def _by_hand(model, batch):
    """(loss, gradients) of ``model(**batch).loss`` by autograd on a copy."""
    ref = copy.deepcopy(model)
    loss = ref(**batch).loss
    return loss.detach(), torch.autograd.grad(loss, list(ref.parameters()))


def test_a_plain_step_is_sgd_on_the_autograd_gradient(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    before = [p.detach().clone() for p in model.parameters()]
    loss, grads = _by_hand(model, batch)
    r = train_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch)
    assert r.applied and r.grad_norm is None and r.scale is None
    assert torch.equal(r.loss, loss) and not r.loss.requires_grad
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - LR * g, rtol=1e-5, atol=1e-7)
        assert p.grad is None  # zero_grad(set_to_none=True) ends the step


def test_max_norm_reports_the_float64_norm_and_scales_the_step(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    before = [p.detach().clone() for p in model.parameters()]
    _, grads = _by_hand(model, batch)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    max_norm = norm / 4  # clipping scales every gradient by max_norm / (norm + 1e-6)
    r = train_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, max_norm=max_norm)
    assert r.grad_norm.item() == pytest.approx(norm, rel=1e-5)
    coef = max_norm / (norm + 1e-6)
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - LR * coef * g, rtol=1e-5, atol=1e-7)


def test_no_update_leaves_the_weights_and_the_true_gradients(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    before = [p.detach().clone() for p in model.parameters()]
    _, grads = _by_hand(model, batch)
    r = train_step(model, None, batch, update=False)
    assert not r.applied
    for p, p0, g in zip(model.parameters(), before, grads):
        assert torch.equal(p.detach(), p0)
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_observers_see_the_phases_in_order_with_the_micro_batch_and_its_loss(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    seen = []

    class Watch:
        def __init__(self, phase, state):
            self.phase, self.state = phase, state

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append((self.phase, self.state.micro, self.state.loss is not None))

    train_step(model, torch.optim.SGD(model.parameters(), lr=LR), batch, parse("micro2"), observers=[Watch])
    # the loss exists from the end of a forward to the end of its backward
    assert seen == [("forward", 0, True), ("backward", 0, True), ("forward", 1, True), ("backward", 1, True),
                    ("optimizer", 1, False), ("zero_grad", 1, False)]
    assert [p for p, *_ in seen][-2:] == list(PHASES[2:])


def test_probe_matches_the_hand_gradient_and_counts_one_forward_per_layer(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    loss, grads = _by_hand(model, batch)
    pr = probe(model, batch)
    assert pr.loss == pytest.approx(loss.item(), rel=1e-6) and pr.finite
    assert pr.grad_norm == pytest.approx(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item(), rel=1e-6)
    for got, want in zip(pr.grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    layers = len(model.model.layers)
    assert pr.calls["layer"] == [1] * layers and pr.recomputes == 0
    assert all(p.grad is None for p in model.parameters())  # copied, then cleared
    assert pr.saved_bytes > 0 and pr.saved_tensors > 0


def test_optimizer_state_lists_adamw_s_three_tensors_per_parameter(setup):
    model, batch = copy.deepcopy(setup[0]), setup[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert optimizer_state(opt) == []  # AdamW makes its state at the first step
    train_step(model, opt, batch)
    n = sum(1 for _ in model.parameters())
    state = optimizer_state(opt)
    assert len(state) == 3 * n  # step, exp_avg, exp_avg_sq
    moments = sum(t.numel() for t in state if t.dim() > 0)
    assert moments == 2 * sum(p.numel() for p in model.parameters())


def test_apply_update_skips_an_inf_gradient_under_an_enabled_scaler_and_tells_the_clock():
    m = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    clock = UpdateClock(WSDConfig(base_lr=1.0, warmup=2), opt)
    w0 = m.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(m(torch.tensor([[float("inf"), 1.0]])).sum()).backward()  # dL/dW = the input: inf
    assert apply_update(m, opt, scaler, clock=clock) == (False, None)
    assert torch.equal(m.weight.detach(), w0) and (clock.updates, clock.skipped) == (0, 1)
    assert scaler.get_scale() == 2.0  # backoff_factor 0.5


def test_a_step_refuses_a_missing_optimizer_and_a_foreign_entered_strategy(setup):
    model, batch = setup
    with pytest.raises(ValueError, match="needs an optimizer"):
        train_step(model, None, batch)
    from bp_mech.bench.strategy import enter

    with enter(model, parse("micro2")) as e, pytest.raises(ValueError, match="'plain'"):
        train_step(model, None, batch, PLAIN, entered=e, update=False)
