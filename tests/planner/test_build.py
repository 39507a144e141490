"""``planner.build``: a config's model and batch, real and fake, against a model built by hand from the same
config and seed."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from transformers import AutoModelForCausalLM, LlamaConfig

from bp_mech.planner.build import ConfigWorkload, build
from bp_mech.instruments.workload import build_model, parse_workload

CONFIG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)


def test_a_config_workload_is_the_config_s_random_init_and_byte_range_ids():
    model, batch = build(ConfigWorkload(CONFIG, 3, 16, seed=7), "cpu", fake=False)
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(CONFIG)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    ids = batch["input_ids"]
    assert ids.shape == (3, 16) and 0 <= int(ids.min()) and int(ids.max()) < 256
    assert torch.equal(batch["labels"], ids) and model.training and model.config.use_cache is False


def test_the_weights_dtype_and_a_workload_s_own_model():
    model, _ = build(ConfigWorkload(CONFIG, 1, 8), "cpu", fake=False, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    w = parse_workload("tiny-b1s8")
    model, batch = build(w, "cpu", fake=False)
    assert torch.equal(model.model.embed_tokens.weight, build_model(w).model.embed_tokens.weight)
    assert batch["input_ids"].shape == (1, 8)


def test_a_fake_twin_has_the_real_shapes_and_no_memory():
    real, _ = build(ConfigWorkload(CONFIG, 2, 8), "cpu", fake=False)
    with FakeTensorMode():
        fake, batch = build(ConfigWorkload(CONFIG, 2, 8), "cpu", fake=True)
        assert all(isinstance(p, FakeTensor) for p in fake.parameters()) and isinstance(batch["input_ids"], FakeTensor)
    assert [(n, p.shape) for n, p in fake.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]


def test_the_caller_s_config_is_left_as_it_was():
    """Building sets the model's dtype and ``use_cache`` on the model's config, not on the one passed in:
    a config planned twice (or keyed by its contents, as the computed records are) stays the same."""
    config = LlamaConfig(**CONFIG.to_dict())
    before = config.to_dict()
    for fake in (False, True):
        with FakeTensorMode() if fake else torch.no_grad():
            model, _ = build(ConfigWorkload(config, 1, 8), "cpu", fake=fake, dtype="bfloat16")
        assert model.config.use_cache is False and model.config is not config
    assert config.to_dict() == before
