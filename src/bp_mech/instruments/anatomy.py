"""Where a causal LM keeps its parts, found from the model itself rather than from attribute names.

Transformers builds some 180 causal LMs with as many layouts: ``model.layers`` (Llama, Qwen2),
``transformer.h`` (GPT-2, Bloom, Falcon), ``gpt_neox.layers``, ``model.decoder.layers`` (OPT), a language
model inside a multimodal one. What every one of them states is

* its repeated blocks: the classes named in ``_no_split_modules`` (what Accelerate keeps on one device;
  where a model names none, a ``ModuleList`` of one class holding several layers with weights);
  the decoder stack is the ``nn.ModuleList`` of such blocks with the text config's number of layers (the
  longest one where none matches: a vision tower's layers are listed there too);
* its output head: ``get_output_embeddings()``;
* its trunk, which turns ids into the last hidden states: ``base_model`` (the ``base_model_prefix``).

Inside a block, attention and MLP are found by their usual child names (``ATTENTION_NAMES``,
``MLP_NAMES``); a block without one (OPT's ``fc1``/``fc2`` sit on the block itself) has None there.
A PEFT-wrapped model is read through its base model.
"""

from __future__ import annotations

from torch import nn

ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")  # a block's attention child
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mixer_mlp")  # a block's MLP child


def unwrapped(model) -> nn.Module:
    """The Transformers model itself: a PEFT model's base model, DDP's ``module``, else ``model``."""
    if isinstance(getattr(model, "module", None), nn.Module) and type(model).__name__ == "DistributedDataParallel":
        model = model.module
    # a PEFT model by any class of its MRO: FSDP2's fully_shard makes it an FSDPPeft<name> subclass
    get = getattr(model, "get_base_model", None)
    peft = any(c.__name__.startswith("Peft") for c in type(model).__mro__)
    return get() if callable(get) and peft else model


def decoder_blocks(model) -> nn.ModuleList:
    """The decoder stack: the ``nn.ModuleList`` of the model's ``_no_split_modules`` blocks (where it names
    none: of one class, each holding several layers with weights) with the text config's ``num_hidden_layers`` entries (the
    longest such list when none has that length).

    Raises:
        ValueError: no ``ModuleList`` of repeated blocks.
    """
    m = unwrapped(model)
    names = set(getattr(m, "_no_split_modules", None) or ())
    # (by any class of a block's MRO: FSDP2's fully_shard makes each block an FSDP<name> subclass)
    stacks = [mod for mod in m.modules() if isinstance(mod, nn.ModuleList) and len(mod)
              and all(names & {c.__name__ for c in type(b).__mro__} for b in mod)]
    if not stacks:  # no block class named (BERT-style decoders, GPT-1, XLNet): lists of one class with parameters
        stacks = [mod for mod in m.modules() if isinstance(mod, nn.ModuleList) and len(mod)
                  and len({type(b) for b in mod}) == 1
                  and sum(1 for c in mod[0].modules() if next(c.parameters(recurse=False), None) is not None) >= 2]
    if not stacks:
        raise ValueError(f"{type(m).__name__}: no ModuleList of repeated blocks"
                         + (f" ({', '.join(sorted(names))})" if names else ""))
    cfg = getattr(m, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    want = getattr(text, "num_hidden_layers", None)
    same = [s for s in stacks if len(s) == want]
    return (same or sorted(stacks, key=len))[-1]


def _child(block: nn.Module, names) -> nn.Module | None:
    return next((getattr(block, n) for n in names if isinstance(getattr(block, n, None), nn.Module)), None)


def attention(block: nn.Module) -> nn.Module | None:
    """The block's attention (its first child named in ``ATTENTION_NAMES``), None where it has none."""
    return _child(block, ATTENTION_NAMES)


def mlp_name(block: nn.Module) -> str | None:
    """The attribute name of the block's MLP (``MLP_NAMES``), None where the MLP is not one child."""
    return next((n for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)


def mlp(block: nn.Module) -> nn.Module | None:
    """The block's MLP (its child named in ``MLP_NAMES``), None where it has none."""
    return _child(block, MLP_NAMES)


def output_head(model) -> nn.Module:
    """The output head, ``get_output_embeddings()``.

    Raises:
        ValueError: the model has none (not a language-model head).
    """
    head = unwrapped(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(unwrapped(model)).__name__} has no output head (get_output_embeddings() is None)")
    return head


def trunk(model) -> nn.Module:
    """The module that turns ids into the last hidden states: ``base_model``."""
    return unwrapped(model).base_model
