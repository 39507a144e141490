"""``chunked_head``: the chunked loss switched into a Transformers model's place and back, the same loss
and gradients as the model's own, and the models and chunks it refuses, with the reason."""

import pytest
import torch
from transformers import AutoConfig

from bp_mech import chunked_head
from bp_mech.instruments.workload import build_model, parse_workload


def test_inside_the_block_the_model_computes_its_own_loss_in_chunks_and_after_it_is_as_before():
    model, ids = build_model(parse_workload("tiny-b1s8")), torch.arange(16).reshape(2, 8)
    head, forward = model.lm_head, model.forward
    ref = model(input_ids=ids, labels=ids)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    with chunked_head.chunked(model, chunk=5) as m:
        assert m is model and isinstance(model.lm_head, chunked_head.ChunkedHead)
        assert model.lm_head.linear.weight is head.weight  # the same (tied) Parameter, not a copy
        out = m(input_ids=ids, labels=ids)
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        with pytest.raises(ValueError, match="pass labels"):
            m(input_ids=ids)
    assert out.logits is None and torch.allclose(out.loss, ref.loss, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, ref_grads))
    assert model.lm_head is head and model.forward == forward and model(input_ids=ids).logits is not None


def test_off_is_a_null_context_and_bad_chunks_and_heads_are_refused():
    model = build_model(parse_workload("tiny-b1s8"))
    with chunked_head.chunked(model, None) as m:
        assert m is model and not isinstance(model.lm_head, chunked_head.ChunkedHead)
    with pytest.raises(ValueError, match="positive"):
        chunked_head.chunked(model, 0)
    with pytest.raises(ValueError, match="without bias"):
        chunked_head.ChunkedHead(torch.nn.Linear(4, 5, bias=True), 4)


def test_a_model_whose_loss_is_not_its_heads_plain_cross_entropy_is_unsupported_with_the_reason():
    config = AutoConfig.for_model("gemma2", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    why = chunked_head.unsupported(model)
    assert "soft-caps its logits" in why
    with pytest.raises(ValueError, match="soft-caps"):
        chunked_head.chunked(model, 4)
