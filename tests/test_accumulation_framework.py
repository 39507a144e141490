"""``accumulation_framework``: Accelerate's ``accumulate`` with Transformers' ``num_items_in_batch`` gives
the full batch's gradient on padded data (token-weighted), and the hand-written loop's final weights."""

import pytest
import torch

from bp_mech import accumulation
from bp_mech.accumulation_framework import accelerate_updates
from bp_mech.bench.compare import relative_l2
from bp_mech.instruments.adamw import make_adamw
from bp_mech.instruments.workload import build_model, parse_workload

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread
W = parse_workload("tiny-b2s16")


@pytest.mark.parametrize("k", [2, 4])
def test_the_first_gradient_is_the_full_batch_one_and_the_updates_match_the_hand_written_loop(k):
    model = build_model(W)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    p0 = [p.detach().clone() for p in model.parameters()]
    batches = accumulation.padded_batches(W, 2, 4, max_pad=0.5)  # rows of different target counts
    out = model(input_ids=batches[0]["input_ids"], labels=batches[0]["labels"])
    full = torch.autograd.grad(out.loss, list(model.parameters()))
    first = accelerate_updates(model, init, batches, k, lr=1e-3)
    assert relative_l2(first, full) < 1e-5
    theirs = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(init)
    opt = make_adamw(model.parameters(), 1e-3, "cpu")
    for b in batches:
        accumulation.accumulated_backward(model, b, k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert relative_l2(list(model.parameters()), theirs, base=p0) < 1e-4  # relative to the updates
