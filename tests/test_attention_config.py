"""``attention_config``: an architecture's attention shape against the transformers config that builds it."""

import dataclasses

import pytest

from bp_mech.attention_config import AttnConfig
from bp_mech.instruments.workload import qwen2_config


@pytest.mark.parametrize("arch", ["tiny", "qwen05"])
def test_from_arch_reads_the_model_s_own_config(arch):
    cfg, config = AttnConfig.from_arch(arch, batch=3, block=16), qwen2_config(arch)
    assert (cfg.batch, cfg.block) == (3, 16)
    assert (cfg.heads, cfg.kv_heads) == (config.num_attention_heads, config.num_key_value_heads)
    assert cfg.head_dim * cfg.heads == config.hidden_size
    assert cfg.rope_theta == config.rope_parameters["rope_theta"]


def test_a_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttnConfig(1, 2, 1, 4, 1e4).block = 8
