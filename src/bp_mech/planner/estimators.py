"""The estimators people use beside ``bp-mech plan``, computed exactly as their authors do, offline.

* **Accelerate** (``accelerate estimate-memory``): the model built empty (``init_empty_weights``) from its
  config, ``calculate_maximum_sizes`` for its total size and largest layer, and the "Training using Adam"
  column, 4x the float32 size (weights, gradients, AdamW's two moments). ``estimate-memory`` fetches the
  config from the Hub; here it is built locally from the config itself (``accelerate_estimate``).
* **DeepSpeed** ZeRO-2 and ZeRO-3 without offload: the per-GPU model-state bytes of its published
  ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
  (``deepspeed_zero``), with the parameter counts its ``model_to_params`` takes (``zero_params``).
* **The plan**: the traced peak of the plain step (``planner.plan.plan``, fake tensors at full size);
  and, where the model is small enough for the CPU, **the measured step** (a real tracked CPU step,
  ``planner.lifecycle.Session``).

``estimator_table`` puts them side by side per config; ``what_each_leaves_out`` says, per estimator,
what its figure does not count. Validation: tests/planner/test_estimators.py (Accelerate's figure against
``calculate_maximum_sizes`` run independently, DeepSpeed's against hand-derived bytes, and at tiny size
each estimator against a real CPU step: the plan within 2 %, Accelerate's 4x exactly the model states
and below the measured peak by the activations and the update's temporaries).
"""

from __future__ import annotations

import torch

from bp_mech.planner.build import ConfigWorkload
from bp_mech.planner.lifecycle import Session
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN
from bp_mech.planner import plan as planner
from bp_mech.instruments.adamw import torch_default_adamw

# the dtypes of ``accelerate estimate-memory --dtypes``, and how its ``gather_data`` divides the float32
# total and largest layer for each (int8/int4: no training figure, "N/A")
ACCELERATE_DTYPES = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
MEASURED_MAX_PARAMS = 50_000_000  # estimator_table measures a real CPU step only below this many parameters
TABLE_BUDGET = 2**50  # the budget the table's plans are made for: any (only the peak is read)

_LEAVES_OUT = {
    "accelerate": "activations (saved for backward, the logits and the loss), the batch, the optimizer's "
                  "temporaries during the update, the CUDA context and the caching allocator's slack; it is "
                  "4x the float32 weights for any batch and sequence, on one device; and it counts a tied "
                  "output head twice (init_empty_weights unties it: huggingface/accelerate#3668) and the "
                  "gradients as alive beside everything, though at the step's peak (inside the loss's "
                  "backward) none may exist yet",
    "deepspeed-zero2": "activations, the batch, the optimizer's temporaries, the gradient buckets and "
                       "communication buffers, the CUDA context and the allocator's slack; it assumes "
                       "mixed precision (16-bit weights and gradients besides float32 master weights, "
                       "gradients and moments: 20 bytes per parameter unsharded)",
    "deepspeed-zero3": "activations, the batch, the optimizer's temporaries, parameters gathered beyond "
                       "one layer (prefetch, the live-parameter cache), communication buffers, the CUDA "
                       "context and the allocator's slack; the same mixed-precision assumption as ZeRO-2",
    "plan": "the CUDA context and the allocator's slack (the plan adds them as headroom when it decides "
            "what fits, not in its peak) and library workspaces (cuBLAS, cuDNN); it traces the step, "
            "so activations, the batch and the optimizer's temporaries are in it",
    "measured": "nothing the step allocates (every storage alive is tracked, on the CPU at small size); "
                "not the CUDA context, the allocator's slack or a GPU kernel's workspace",
}


def what_each_leaves_out() -> dict[str, str]:
    """Per estimator of ``estimator_table`` (``accelerate``, ``deepspeed-zero2``, ``deepspeed-zero3``,
    ``plan``, ``measured``): what its figure does not count, one sentence.

    Returns:
        A new dict, estimator name -> sentence.

    Example:
        >>> sorted(what_each_leaves_out())
        ['accelerate', 'deepspeed-zero2', 'deepspeed-zero3', 'measured', 'plan']
    """
    return dict(_LEAVES_OUT)


def empty_model(config, head: bool = True):
    """``config``'s model on the meta device (``accelerate.init_empty_weights``), in float32 as
    ``estimate-memory``'s ``create_empty_model`` builds it (``torch_dtype=torch.float32``).

    Args:
        config: a Transformers config.
        head: ``AutoModelForCausalLM`` (with the output head: what is trained); False: ``AutoModel``,
            what ``estimate-memory`` builds for a repository without an ``auto_map`` (no head).

    Returns:
        The empty model (parameters on the meta device; buffers on the CPU, as ``init_empty_weights``
        leaves them by default).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    with init_empty_weights():
        return (AutoModelForCausalLM if head else AutoModel).from_config(config, dtype=torch.float32)


def _meta_model(config):
    """``config``'s causal LM on the meta device with its ties kept (``torch.device("meta")``, not
    ``init_empty_weights``): what DeepSpeed's ``model_to_params`` would see on the real model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def accelerate_estimate(config, dtype: str = "float32", head: bool = True) -> dict:
    """One row of ``accelerate estimate-memory``'s table for ``config``, computed by its own functions.

    ``accelerate/commands/estimate.py`` (Accelerate 1.15), ``gather_data``::

        total_size, largest_layer = calculate_maximum_sizes(model)
        for dtype in args.dtypes:
            dtype_total_size = total_size
            dtype_largest_layer = largest_layer[0]
            dtype_training_size = estimate_training_usage(dtype_total_size, dtype)
            if dtype == "float16":
                dtype_total_size /= 2
                dtype_largest_layer /= 2
            ...

    and ``estimate_command`` prints ``max(item.values())`` of the training dict as "Training using Adam",
    where ``estimate_training_usage`` has, for ``float32``::

        memory_sizes["model"] = fp32_size
        memory_sizes["gradients"] = fp32_size
        memory_sizes["optimizer"] = fp32_size * 2
        memory_sizes["step"] = fp32_size * 4

    so the column is 4x the float32 size (for ``float16``, 2x it: the optimizer's two float32 moments;
    ``int8``/``int4``: "N/A"). The size is of the float32 model whatever ``dtype`` (the dtype only divides
    the "Total Size" and "Largest Layer" columns), and counts the buffers (RoPE's ``inv_freq``) too. A
    tied output head is counted twice: ``init_empty_weights`` re-wraps every parameter registered under it,
    so ``lm_head.weight = embed_tokens.weight`` makes a second ``Parameter`` (huggingface/accelerate#3668,
    open), and ``calculate_maximum_sizes`` sizes both.

    Args:
        config: a Transformers config (nothing is fetched from the Hub).
        dtype: one of ``ACCELERATE_DTYPES`` (``estimate-memory --dtypes``).
        head: build with the output head (``AutoModelForCausalLM``, default); False: ``AutoModel`` as
            ``estimate-memory`` does for a repository without an ``auto_map`` (an untied head left out).

    Returns:
        ``dict(dtype, total_size, largest_layer, largest_layer_names, training, parameters)``: bytes in
        ``dtype`` (total and largest layer), ``training`` the "Training using Adam" bytes (None for
        N/A), ``parameters`` the model's parameter count.
    """
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    if dtype not in ACCELERATE_DTYPES:
        raise ValueError(f"estimate-memory's dtypes are {', '.join(ACCELERATE_DTYPES)}, got {dtype!r}")
    model = empty_model(config, head)
    total, (largest, names) = calculate_maximum_sizes(model)
    training = max(estimate_training_usage(total, dtype).values())
    div = ACCELERATE_DTYPES[dtype]
    return dict(dtype=dtype, total_size=total / div if div > 1 else total,
                largest_layer=largest / div if div > 1 else largest, largest_layer_names=list(names),
                training=None if training == -1 else training,
                parameters=sum(p.numel() for p in model.parameters()))


def zero_params(model) -> tuple[int, int]:
    """(total parameters, largest layer's parameters) as DeepSpeed's ``model_to_params`` counts them
    (``deepspeed/runtime/zero/stage3.py``): shared parameters once, and the largest module's own
    parameters (``m.parameters(recurse=False)``: the embedding or the head, usually). DeepSpeed tells
    shared ones apart by ``data_ptr()``, which is 0 for every parameter of an empty (meta) model; they are
    told apart by identity here, which is the same on a real model.

    Args:
        model: an ``nn.Module``, real or empty.

    Returns:
        (total_params, largest_layer_params).

    Example:
        >>> zero_params(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
        (26, 16)
    """
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def deepspeed_zero(params: int, largest_layer_params: int, gpus: int, stage: int) -> int:
    """Per-GPU bytes of the model states under DeepSpeed ZeRO ``stage`` without offload, on one node of
    ``gpus`` GPUs, exactly as DeepSpeed's published estimators compute them (``cpu_offload=False``,
    ``num_nodes=1``, ``num_gpus_per_node=gpus``):

    * stage 2, ``deepspeed/runtime/zero/stage_1_and_2.py``, ``estimate_zero2_model_states_mem_needs``:
      ``gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)`` (2: the 16-bit weights,
      replicated; 18: 16-bit and float32 gradients, float32 weights, two float32 moments, sharded);
    * stage 3, ``deepspeed/runtime/zero/stage3.py``, ``estimate_zero3_model_states_mem_needs``:
      ``gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)`` with
      ``largest_layer_memory = 4 * largest_layer_params`` (one layer's gathered weights).

    Both return ``int(gpu_mem)``. Their ``additional_buffer_factor`` (1.5 by default) multiplies only the
    CPU figure, never the GPU one, so it does not enter here. Read at DeepSpeed v0.19.5 (master edaa722,
    2026-08); the stage-2 formula is so since v0.14.3 (#5099; before it, ``4 * total_params +
    int(16 * total_params / total_gpus)``).

    Args:
        params: total parameters (``zero_params``).
        largest_layer_params: the largest module's own parameters (``zero_params``; stage 3 only).
        gpus: GPUs the states are sharded over (>= 1).
        stage: 2 or 3.

    Returns:
        Bytes per GPU.

    Example:
        >>> deepspeed_zero(1000, 100, 4, 2)  # 2*1000 + int(18*1000/4)
        6500
        >>> deepspeed_zero(1000, 100, 4, 3)  # 4*100 + int(18*1000/4)
        4900
    """
    if stage not in (2, 3) or gpus < 1:
        raise ValueError(f"ZeRO stage 2 or 3 on >= 1 GPUs, got stage {stage} on {gpus}")
    if stage == 2:
        return int(2 * params + int(18 * params / gpus))
    return int(4 * largest_layer_params + int(18 * params / gpus))


def measured_peak(config, batch: int, seq: int) -> int:
    """The peak of a real plain step of ``config`` at (batch, seq), tracked on the CPU (the steady state:
    AdamW's moments resident), with the CPU's step options (foreach AdamW).

    Args:
        config: a Transformers config small enough to train on the CPU.
        batch: sequences per step.
        seq: tokens per sequence.

    Returns:
        Bytes (memory source ``tracked-cpu``).
    """
    s = Session(ConfigWorkload(config, batch, seq), "cpu", options=StepOptions().for_device("cpu"))
    return s.ledger(PLAIN).peak


def _plan_peak(config, batch: int, seq: int, gpus: int, options: StepOptions) -> tuple[int, str]:
    """The plan's plain peak and its scope: rank 0's under FSDP2 for ``gpus`` > 1, else one device's."""
    shard = dict(gpus=gpus, shard="fsdp2") if gpus > 1 else {}
    p = planner.plan(config, batch, seq, TABLE_BUDGET, candidates=(PLAIN,), options=options, **shard)
    return p.rows[0].peak, (f"per GPU of {gpus}, fsdp2" if shard else "one device")


def estimator_table(rows, options: StepOptions | None = None, plan: bool = True) -> list[dict]:
    """Each estimator's bytes for each config, side by side (the book's comparison table).

    Args:
        rows: (label, config, batch, seq, gpus) tuples; ``batch`` is per device, as ``bp-mech plan --gpus``
            reads it.
        options: the plan's step options (None: ``bp-mech plan``'s default, PyTorch's default AdamW on
            CUDA, foreach, with CUDA's settings).
        plan: False leaves ``plan`` and ``plan_scope`` None (a caller that has its own plans of the rows).

    Returns:
        One dict per row: ``label``, ``batch``, ``seq``, ``gpus``, ``parameters``; ``accelerate`` (its
        "Training using Adam", float32); ``zero2`` and ``zero3`` (DeepSpeed's per-GPU model states; None
        for one GPU); ``plan`` (the traced plain peak: rank 0's under FSDP2 for more than one GPU) with
        ``plan_scope``; ``measured`` (a real one-device CPU step's peak, for one GPU and below
        ``MEASURED_MAX_PARAMS`` parameters; else None: a one-process step is not a rank's).
    """
    options = options or StepOptions(adamw=torch_default_adamw("cuda")).for_device("cuda")
    out = []
    for label, config, batch, seq, gpus in rows:
        acc = accelerate_estimate(config)
        params, largest = zero_params(_meta_model(config))
        peak, scope = _plan_peak(config, batch, seq, gpus, options) if plan else (None, None)
        out.append(dict(label=label, batch=batch, seq=seq, gpus=gpus, parameters=params, accelerate=acc["training"],
                        zero2=deepspeed_zero(params, largest, gpus, 2) if gpus > 1 else None,
                        zero3=deepspeed_zero(params, largest, gpus, 3) if gpus > 1 else None,
                        plan=peak, plan_scope=scope,
                        measured=measured_peak(config, batch, seq)
                        if gpus == 1 and params < MEASURED_MAX_PARAMS else None))
    return out
