"""The model and batch of a ledger session (``planner.lifecycle.Session``), real or fake.

A ``Workload`` (``instruments.workload``) gives its own model and text; a ``ConfigWorkload`` (what ``bp-mech
plan`` traces) any causal LM that Transformers builds from its config (``AutoModelForCausalLM.
from_config``), with random byte-range token ids. Under ``FakeTensorMode`` either is built at full
size without memory (the full qwen05 in seconds on any CPU).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from bp_mech.planner.finetune import FineTune, apply as apply_finetune


@dataclass(frozen=True)
class ConfigWorkload:
    """A model given by its Transformers config, at one batch shape (what ``bp-mech plan`` traces)."""

    config: object  # a transformers PretrainedConfig of a causal LM (AutoModelForCausalLM.from_config builds it)
    batch: int  # sequences per batch (B)
    seq: int  # tokens per sequence (T)
    dtype: str = "float32"  # master weights
    seed: int = 0  # random init and token ids (real runs)
    finetune: FineTune | None = None  # frozen parameters or LoRA (``planner.finetune``); None: every parameter trains


def build(w, device, fake: bool, dtype: str | None = None):
    """(model, batch) on ``device``: the real workload (a ``Workload``'s own model and text; a
    ``ConfigWorkload``'s random init from ``w.seed`` and random byte-range token ids), or a fake twin.
    ``dtype``: the weights' dtype instead of ``w.dtype`` (None: ``w.dtype``)."""
    from transformers import AutoModelForCausalLM

    from bp_mech.instruments.workload import build_model, make_batches, qwen2_config

    w = dataclasses.replace(w, dtype=dtype or w.dtype)
    if not fake and not isinstance(w, ConfigWorkload):
        return build_model(w, device), make_batches(w, 1, device=device)[0]
    # a copy: building sets the model's dtype and use_cache on its config, and the caller's stays as it was
    config = copy.deepcopy(w.config) if isinstance(w, ConfigWorkload) else qwen2_config(w.arch)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, w.dtype))  # (.to() cannot swap fake parameters)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(w.seed)
            # SDPA where the model supports it, else Transformers' fallback, eager (T x T scores)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, w.dtype)).train()
            vocab = config.get_text_config().vocab_size
            ids = torch.randint(0, min(256, vocab), (w.batch, w.seq), device=device)
    finally:
        torch.set_default_dtype(prev)
    with torch.random.fork_rng(devices=[]):  # (the adapters' init, from the workload's seed too)
        torch.manual_seed(w.seed)
        model = apply_finetune(model, getattr(w, "finetune", None))
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    return (model if fake else model.to(device)), {"input_ids": ids, "labels": ids.clone()}
