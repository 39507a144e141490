"""``instruments.anatomy``: the parts of three Transformers layouts (Qwen2's ``model.layers``, GPT-2's
``transformer.h``, OPT's ``model.decoder.layers`` with its MLP on the block), named by hand."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from bp_mech.instruments import anatomy
from bp_mech.instruments.workload import build_model, parse_workload


def test_qwen2_blocks_attention_mlp_head_and_trunk():
    model = build_model(parse_workload("tiny-b1s8"))
    blocks = anatomy.decoder_blocks(model)
    assert blocks is model.model.layers and len(blocks) == model.config.num_hidden_layers
    assert anatomy.attention(blocks[0]) is blocks[0].self_attn and anatomy.mlp(blocks[0]) is blocks[0].mlp
    assert anatomy.mlp_name(blocks[0]) == "mlp"
    assert anatomy.output_head(model) is model.lm_head and anatomy.trunk(model) is model.model


def test_gpt2_layout():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    blocks = anatomy.decoder_blocks(model)
    assert blocks is model.transformer.h
    assert anatomy.attention(blocks[1]) is blocks[1].attn and anatomy.mlp_name(blocks[1]) == "mlp"
    assert anatomy.trunk(model) is model.transformer


def test_opt_has_its_mlp_on_the_block():
    model = OPTForCausalLM(OPTConfig(num_hidden_layers=2, hidden_size=16, ffn_dim=32, num_attention_heads=2,
                                     vocab_size=50, max_position_embeddings=16, word_embed_proj_dim=16))
    blocks = anatomy.decoder_blocks(model)
    assert blocks is model.model.decoder.layers
    assert anatomy.mlp_name(blocks[0]) is None and anatomy.mlp(blocks[0]) is None
    assert anatomy.attention(blocks[0]) is blocks[0].self_attn


def test_a_wrapper_is_read_through_and_a_model_without_blocks_or_head_is_refused():
    model = build_model(parse_workload("tiny-b1s8"))
    PeftModel = type("PeftModelForCausalLM", (torch.nn.Module,), {"get_base_model": lambda self: model})
    assert anatomy.unwrapped(PeftModel()) is model
    with pytest.raises(ValueError, match="no ModuleList of repeated blocks"):
        anatomy.decoder_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="no output head"):
        anatomy.output_head(model.model)
