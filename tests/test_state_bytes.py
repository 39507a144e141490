"""``state_bytes``: the training state's byte counts against real Qwen2 modules: the storages of the
parameters, of the gradients after a backward and of AdamW's moments after a step (tied and untied
embeddings), and what one decoder layer saves for backward, counted by saved-tensor hooks."""

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from bp_mech import state_bytes as sb
from bp_mech.instruments.counters import SavedBytesCounter
from bp_mech.instruments.workload import build_model, make_batches, parse_workload, qwen2_config


def _storages(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_gradients_and_moments_are_the_storages_a_real_step_holds(tied):
    w = parse_workload("tiny-b1s8")
    model = build_model(w)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    cfg = model.config
    assert sb.param_bytes(cfg) == _storages(model.parameters())
    model(**make_batches(w, 1)[0]).loss.backward()
    assert sb.grad_bytes(cfg) == _storages(p.grad for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert sb.adam_state_bytes(cfg) == _storages(moments)
    assert sb.param_bytes(cfg, 2) * 2 == sb.param_bytes(cfg)


@pytest.mark.parametrize("batch, seq", [(2, 8), (1, 13)])
def test_one_decoder_layer_saves_the_block_formula_storage_by_storage(batch, seq):
    cfg = qwen2_config("tiny")
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(cfg, layer_idx=0).train()
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = Qwen2RotaryEmbedding(cfg)(x, pos)
    counter = SavedBytesCounter(params=[*layer.parameters(), cos, sin])  # weights and the shared RoPE tables apart
    with counter:
        layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)
    assert counter.bytes == sb.block_saved_bytes(cfg, batch, seq)
    assert sorted(counter.storages.values()) == sorted(sb.layer_saved_storages(cfg, batch, seq))


def test_the_sizes_of_a_config_by_hand():
    d = sb.dims(dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=200,
                     vocab_size=50, num_hidden_layers=3, tie_word_embeddings=False))
    assert d == dict(C=96, H=6, hd=16, Ckv=32, I=200, V=50, L=3, tied=False)
    # q (96·96 + 96), k and v (32·96 + 32 each), o (96·96), gate/up/down (3·96·200), two gains (2·96)
    assert sb.layer_params(d) == 9312 + 2 * 3104 + 9216 + 57600 + 192


def test_the_gpt_constant_and_the_score_matrix_by_hand():
    arch = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                vocab_size=32, num_hidden_layers=2, tie_word_embeddings=True)
    assert sb.gpt_activation_bytes(arch, 2, 16) == 16 * 2 * 64 * (34 + 5 * 4 * 16 / 64)
    assert sb.attention_probs_bytes(arch, 2, 16) == 2 * 4 * 16 * 16 * 4
