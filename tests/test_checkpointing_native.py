"""``checkpointing_native``: the MLP-only wrapper and Transformers' own switch give the plain step's loss and
gradients bit for bit on the CPU (the same operations, recomputed), recompute what they say (counted), and
leave the model as it was, also after an error."""

import copy

import pytest
import torch

from bp_mech.checkpointing_native import checkpoint_mlp, enable_native, native_checkpointing
from bp_mech.instruments.counters import ForwardCounter
from bp_mech.instruments.workload import build_model, make_batches, parse_workload


@pytest.fixture(scope="module")
def plain():
    w = parse_workload("tiny-b2s8")
    model, batch = build_model(w), make_batches(w, 1)[0]
    model.train()
    loss = model(**batch).loss
    return model, batch, loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _step(model, batch):
    with ForwardCounter(model) as fc:
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads, fc.calls


@pytest.mark.parametrize("wrap, layers, mlp", [
    (lambda m: checkpoint_mlp(m), [1, 1], [2, 2]),  # only the MLPs run again
    (lambda m: native_checkpointing(m), [2, 2], [2, 2]),  # whole layers run again
    (lambda m: native_checkpointing(m, every_n_layers=2), [2, 1], [2, 1]),  # layers 0, 2, 4, ...
])
def test_the_same_loss_and_gradients_bit_for_bit_with_the_counted_recomputes(plain, wrap, layers, mlp):
    base, batch, loss, grads = plain
    model = copy.deepcopy(base)
    with wrap(model):
        got_loss, got_grads, calls = _step(model, batch)
    assert torch.equal(got_loss, loss) and all(torch.equal(a, b) for a, b in zip(got_grads, grads))
    assert calls["layer"] == layers and calls["mlp"] == mlp


def test_the_model_is_restored_after_an_error(plain):
    model = copy.deepcopy(plain[0])
    mlps = [layer.mlp for layer in model.model.layers]
    with pytest.raises(KeyError), checkpoint_mlp(model):
        raise KeyError("inside")
    assert [layer.mlp for layer in model.model.layers] == mlps
    with pytest.raises(KeyError), native_checkpointing(model):
        raise KeyError("inside")
    assert not model.is_gradient_checkpointing


def test_enable_native_stays_on_until_disabled(plain):
    model = copy.deepcopy(plain[0])
    enable_native(model, every_n_layers=1)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, True]
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_a_block_without_an_mlp_child_is_refused():
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=8, ffn_dim=16, num_attention_heads=2,
                                   vocab_size=20, max_position_embeddings=8, word_embed_proj_dim=8))
    with pytest.raises(ValueError, match="has no MLP child"), checkpoint_mlp(opt):
        pass
