"""``bp_mech.planner.estimators``: Accelerate's ``estimate-memory`` figure against ``calculate_maximum_sizes``
run independently, DeepSpeed's ZeRO formulas against bytes derived by hand, and, at tiny size, every
estimator against a real tracked CPU step (the plan within 2 %; Accelerate's 4x is the model states, so it
sits below the measured peak by the activations)."""

import pytest
import torch

from bp_mech.planner import build, estimators as E, lifecycle, plan
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=384, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=None,
            tie_word_embeddings=True)
H, I, V, L, KV = 64, 176, 384, 2, 2 * 16  # hidden, intermediate, vocab, layers, kv width (2 heads x 16)
# Qwen2's parameters by hand: q (H*H + H bias), k and v (H*KV + KV bias each), o (H*H), gate/up/down (3*H*I),
# two RMSNorms (2*H) per layer; the embedding V*H (the head tied to it); the final norm H
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * I + 2 * H  # = 46336
PARAMS = V * H + L * LAYER + H  # = 117312
BUFFERS = 2 * 8 * 4  # RoPE's inv_freq and original_inv_freq: head_dim / 2 = 8 float32 each
PEAK_TOL = 0.02  # the bound (the fake step is the real program: in fact equal)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread


@pytest.fixture(scope="module")
def config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", **TINY)


def _independent(config, head=True):
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel, AutoModelForCausalLM

    with init_empty_weights():
        model = (AutoModelForCausalLM if head else AutoModel).from_config(config, dtype=torch.float32)
    return calculate_maximum_sizes(model)


@pytest.mark.parametrize("dtype,div,times", [("float32", 1, 4), ("float16", 2, 2), ("int8", 4, None)])
def test_accelerate_is_calculate_maximum_sizes_as_estimate_memory_reads_it(config, dtype, div, times):
    assert LAYER == 46336 and PARAMS == 117312
    total, (largest, names) = _independent(config)
    # init_empty_weights unties the head (accelerate#3668): the tied V*H weights are counted twice
    assert total == 4 * (PARAMS + V * H) + BUFFERS == 567616
    a = E.accelerate_estimate(config, dtype)
    assert a["total_size"] == total / div and a["largest_layer"] == largest / div
    assert a["largest_layer_names"] == names == ["model.layers.0", "model.layers.1"] and largest == 4 * LAYER
    # "Training using Adam": the float32 size x4 (weights, gradients, two moments); float16: x2; int8: N/A
    assert a["training"] == (None if times is None else times * total)
    assert a["parameters"] == PARAMS + V * H


def test_accelerate_without_the_head_is_the_tied_model_once(config):
    """``AutoModel`` (what estimate-memory builds without an ``auto_map``) has no head to count twice."""
    a = E.accelerate_estimate(config, head=False)
    assert a["total_size"] == _independent(config, head=False)[0] == 4 * PARAMS + BUFFERS == 469312
    assert a["training"] == 4 * a["total_size"]
    with pytest.raises(ValueError, match="dtypes"):
        E.accelerate_estimate(config, "bfloat16")  # not one of estimate-memory's --dtypes


def test_deepspeed_zero_formulas_by_hand():
    p, big = 1_000_000, 100_000
    # ZeRO-2: 2 bytes of 16-bit weights per parameter on every GPU, 18 sharded: 2e6 + 18e6/8
    assert E.deepspeed_zero(p, big, 8, 2) == 2_000_000 + 2_250_000 == 4_250_000
    # ZeRO-3: one layer's gathered weights, 4 bytes each (400_000), and the same 18 sharded
    assert E.deepspeed_zero(p, big, 8, 3) == 400_000 + 2_250_000 == 2_650_000
    # on one GPU ZeRO-2 is 20 bytes per parameter; a shard that does not divide is truncated (int)
    assert E.deepspeed_zero(p, big, 1, 2) == 20 * p
    assert E.deepspeed_zero(1000, 0, 7, 2) == 2000 + 2571  # int(18000 / 7) = int(2571.43)
    assert E.deepspeed_zero(1000, 10, 7, 3) == 40 + 2571
    for stage, gpus in ((1, 8), (2, 0)):
        with pytest.raises(ValueError):
            E.deepspeed_zero(p, big, gpus, stage)


def test_zero_params_counts_a_tied_weight_once_and_the_largest_module():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: 40 parameters, once
    model = torch.nn.ModuleDict(dict(emb=emb, mid=torch.nn.Linear(4, 4), head=head))
    assert E.zero_params(model) == (40 + 20, 40)  # mid: 16 + 4 bias; the largest module's own: 40


def test_tiny_step_against_each_estimator(config):
    cpu = StepOptions().for_device("cpu")
    led = lifecycle.Session(build.ConfigWorkload(config, 2, 32), "cpu", options=cpu).ledger(PLAIN)
    assert led.source == "tracked-cpu" and led.finite
    fake = plan.plan(config, 2, 32, 2**40, candidates=(PLAIN,), options=cpu).rows[0].peak
    assert abs(fake / led.peak - 1) <= PEAK_TOL, (fake, led.peak)

    acc = E.accelerate_estimate(config)
    weights = acc["total_size"] - 4 * V * H  # Accelerate's float32 model with the tied head once
    at = led.stages[led.peak_stage]
    # the model states Accelerate counts are the step's: the same weights and buffers, moments twice the
    # weights (less the buffers, plus AdamW's 4-byte step counter per parameter tensor)
    assert at["parameters"] == weights == 4 * PARAMS + BUFFERS
    n_tensors = 1 + L * 12 + 1  # embedding; q/k/v weights and biases, o, gate/up/down, two norms; final norm
    assert at["optimizer_states"] == 2 * (weights - BUFFERS) + 4 * n_tensors
    # the peak is inside the loss's backward: no parameter gradient exists yet (zero_grad set them to None)
    assert led.peak_stage == "backward_peak" and at["gradients"] == 0
    left_out = at["saved_activations"] + at["logits_loss"] + at["other"]  # what Accelerate leaves out
    assert at["logits_loss"] >= 2 * 32 * V * 4  # at least the fp32 logits, B*T*V*4
    # Accelerate's x4 is below the measured peak: what it leaves out (activations, logits) outweighs what
    # it counts that is not alive at the peak (the gradients, 4*PARAMS, and the head's second copy)
    assert acc["training"] < led.peak
    assert left_out > acc["training"] - (at["parameters"] + at["optimizer_states"]) > 0


def test_estimator_table_row(config):
    row, one = E.estimator_table([("tiny", config, 2, 32, 4), ("tiny", config, 2, 32, 1)])
    assert row["parameters"] == PARAMS  # the real (tied) model's count, as DeepSpeed's model_to_params takes
    assert row["zero2"] == 2 * PARAMS + int(18 * PARAMS / 4) == 762528
    assert row["zero3"] == 4 * V * H + int(18 * PARAMS / 4) == 626208  # largest module: the embedding
    assert row["accelerate"] == E.accelerate_estimate(config)["training"]
    assert one["measured"] is not None and abs(one["plan"] / one["measured"] - 1) <= PEAK_TOL
    # 4 GPUs: rank 0's plan under FSDP2, below one device's (a quarter of the model states); no one-process step
    assert row["plan_scope"] == "per GPU of 4, fsdp2" and row["plan"] < one["plan"] and row["measured"] is None
    assert set(E.what_each_leaves_out()) == {"accelerate", "deepspeed-zero2", "deepspeed-zero3", "plan", "measured"}
    assert one["zero2"] is None and one["zero3"] is None and one["plan_scope"] == "one device"
