"""``instruments.counters``: forward calls and saved bytes counted on steps whose counts are known by hand.

``torch.mul(a, b)`` saves both inputs for its backward (d(ab)/da = b); ``torch.sin(x)`` saves x; a
parameter that is saved counts as a parameter save, not as a stored activation."""

import pytest
import torch

from bp_mech.instruments.counters import ForwardCounter, SavedBytesCounter
from bp_mech.instruments.workload import build_model, make_batches, parse_workload


@pytest.fixture(scope="module")
def tiny():
    w = parse_workload("tiny-b1s8")
    return build_model(w), make_batches(w, 1)[0]


def test_one_forward_calls_every_part_once(tiny):
    model, batch = tiny
    with ForwardCounter(model) as fc:
        model(**batch)
    n = model.config.num_hidden_layers
    assert fc.calls == {"layer": [1] * n, "attn": [1] * n, "mlp": [1] * n} and fc.recomputes == 0
    model(**batch)  # the hooks are gone after the block
    assert fc.calls["layer"] == [1] * n


def test_a_checkpointed_mlp_is_counted_again_in_backward(tiny):
    from bp_mech.checkpointing_native import checkpoint_mlp

    model, batch = tiny
    model.train()
    with checkpoint_mlp(model), ForwardCounter(model) as fc:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    n = model.config.num_hidden_layers
    assert fc.calls["mlp"] == [2] * n and fc.calls["attn"] == [1] * n  # the MLP's recompute in backward
    assert fc.recomputes == n


def test_saved_bytes_of_a_product_and_a_sine_by_hand():
    a = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    c = SavedBytesCounter()
    with c:
        y = torch.sin(a * b)  # mul saves a and b (2 x 128 B), sin saves its input (128 B)
    assert (c.tensors, c.tensor_bytes, c.bytes) == (3, 3 * 4 * 32, 3 * 4 * 32)
    assert c.bytes_at_least(129) == 0 and c.bytes_at_least(128) == 384
    del y


def test_views_of_one_storage_count_once_and_parameters_apart():
    w = torch.nn.Parameter(torch.randn(6))
    x = torch.randn(2, 6, requires_grad=True)
    c = SavedBytesCounter(params=[w])
    with c:
        y = x[0] * x[1] * w  # saves the views x[0] and x[1] (one storage, 48 B), then x[0]*x[1] and w
    assert c.tensors == 4 and c.tensor_bytes == 4 * 6 * 4
    assert c.param_saves == 1
    assert c.bytes == 48 + 24  # x's storage once, the product x[0]*x[1]; w not at all
    del y
