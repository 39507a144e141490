"""``planner.shapes``: a public shape builds the published model, counted on the meta device against the
parameter count its model card states."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from bp_mech.planner.shapes import SHAPES, public_config


def test_qwen2_5_7b_has_its_published_parameter_count():
    config = public_config("qwen2.5-7b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512  # Qwen2.5-7B's model card: 7.61B


def test_llama_3_8b_has_its_published_parameter_count():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(public_config("llama-3-8b"))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Meta-Llama-3-8B: 8.03B


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_field_reaches_the_config(name):
    config = public_config(name)
    assert config.model_type == SHAPES[name]["model_type"]
    for k, v in SHAPES[name].items():
        if k not in ("model_type", "rope_theta"):  # (rope_theta moves into rope_parameters in Transformers 5)
            assert getattr(config, k) == v, k


def test_an_unknown_shape_is_refused():
    with pytest.raises(KeyError, match="unknown shape 'gpt-5'"):
        public_config("gpt-5")
