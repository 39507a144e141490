"""``planner.depth`` in every mode (LoRA, bf16 weights, frozen embeddings, a foreach or for-loop AdamW, SGD, the
first step; accumulation) and under both shardings (FSDP2 on 2 and 4 fake ranks, DDP): the extrapolated ledger
is the full trace's to the byte; and a plan made so equals the plan traced at full depth
(``--full-depth``)."""

import dataclasses

import pytest

from bp_mech.bench.strategy import CANDIDATES, parse
from bp_mech.planner import plan
from bp_mech.planner.definitions import STEADY
from bp_mech.planner.finetune import FineTune
from tests.planner.test_depth import CUDA, compare, config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["lora", "bf16", "foreach", "for-loop", "sgd", "first", "freeze-embeddings"])
def test_every_mode_extrapolates_to_the_full_trace(mode):
    options, definition, finetune = CUDA, STEADY, None
    if mode in ("foreach", "for-loop"):
        options = dataclasses.replace(CUDA, adamw=mode)
    elif mode == "sgd":
        options = dataclasses.replace(CUDA, optimizer="sgd")
    elif mode == "bf16":
        definition = STEADY.replace(weights="bfloat16")
    elif mode == "first":
        definition = STEADY.replace(moments="first")
    elif mode == "lora":
        finetune = FineTune(lora_rank=4, lora_targets=("q_proj", "v_proj"))
    else:
        finetune = FineTune(freeze="embed")
    assert compare("qwen2", ("plain", "checkpoint-every2", "checkpoint-all+fp16+micro2+chunked-loss"), options=options,
                   definition=definition, finetune=finetune, layers=9) == []


@pytest.mark.parametrize("family,shard,gpus", [("qwen2", "fsdp2", 2), ("llama", "fsdp2", 4), ("mixtral", "fsdp2", 2),
                                               ("falcon", "ddp", 4)])
def test_both_shardings_extrapolate_to_the_full_trace(family, shard, gpus):
    names = ("plain", "checkpoint-every2", "checkpoint-all+offload+fp16+chunked-loss")
    assert compare(family, names, shard, gpus) == []


def test_the_plan_by_depth_is_the_full_depth_plan():
    cfg = config("llama", 7)
    # every candidate, something fits; nothing fits: what would fit instead, traced at other shapes
    for budget, few in ((2**30, CANDIDATES), (2**20, [parse("plain"), parse("checkpoint-every2+micro2")])):
        a, b = (plan.plan(cfg, 4, 32, budget, candidates=few, full_depth=f).to_dict() for f in (False, True))
        a.pop("elapsed_s"), b.pop("elapsed_s")
        assert a == b and (a["recommended"] is None) == (budget == 2**20)


def test_a_sharded_plan_by_depth_is_the_full_depth_plan():
    """Under FSDP2 too (the full-depth plan makes its optimizer before the FLOP count's forward, which leaves the
    root's parameters gathered: made after it, AdamW met plain tensors beside DTensors)."""
    cfg, few = config("qwen2", 7), [parse("plain"), parse("checkpoint-every2")]
    a, b = (plan.plan(cfg, 2, 32, 2**30, candidates=few, gpus=2, shard="fsdp2", full_depth=f).to_dict()
            for f in (False, True))
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b
