"""``projects.data_parallel_state``: the formulas of DDP and ZeRO's stages agree with a brute force over ranks,
and with the ledger a real FSDP2-style sharding would give at the step's boundaries (16 Ψ / N)."""

import pytest

from bp_mech.projects.data_parallel_state import STAGES, model_state_per_gpu


def _brute(params, gpus, stage):  # the bytes rank 0 holds: each class either whole or one of gpus equal shards
    sharded = {"DDP": set(), "ZeRO-1": {"o"}, "ZeRO-2": {"o", "g"}, "ZeRO-3": {"o", "g", "w"}}[stage]
    size = {"w": 4, "g": 4, "o": 8}
    return sum(size[c] * params / (gpus if c in sharded else 1) for c in size)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_each_stage_is_the_brute_force_over_ranks(stage, gpus):
    assert model_state_per_gpu(7_615_616_512, gpus, stage) == pytest.approx(_brute(7_615_616_512, gpus, stage))


def test_one_gpu_holds_everything_whatever_the_stage_and_more_gpus_never_hold_more():
    assert {model_state_per_gpu(10, 1, s) for s in STAGES} == {160.0}
    for s in STAGES:
        assert model_state_per_gpu(10, 8, s) <= model_state_per_gpu(10, 2, s)


@pytest.mark.parametrize("params, gpus, stage", [(-1, 2, "DDP"), (1, 0, "ZeRO-1"), (1, 2, "ZeRO-4")])
def test_bad_input_is_refused(params, gpus, stage):
    with pytest.raises(ValueError):
        model_state_per_gpu(params, gpus, stage)
