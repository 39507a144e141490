"""Whether a model attends causally: ``bp-mech plan`` plans causal LMs only.

Transformers' causal-LM mapping lists encoders too: ``BertLMHeadModel`` (and RoBERTa, ELECTRA, XLM-R, ...)
run as a decoder only when the config says ``is_decoder=True``; with the default ``is_decoder=False`` their
attention looks both ways, and a step of it is not a causal LM's step. XLM is an encoder unless
``is_encoder=False``. What the built model states is read, not the config's name: the ``is_causal`` and
``is_decoder`` flags of the decoder blocks' modules and of the modules that hold the blocks (``XLMModel``'s
``is_decoder``; a vision tower beside the text blocks, with its own non-causal attention, does not count).
A True flag anywhere there: causal; flags that are all False: not causal (``PlanError``, exit 2); no flags
(GPT-2 before Transformers set them, state-space models): causal, as the mapping says.
"""

from __future__ import annotations

from bp_mech.instruments import anatomy

FLAGS = ("is_causal", "is_decoder")  # the attributes Transformers' modules state their masking with


def attends_causally(model) -> bool | None:
    """Whether ``model``'s decoder stack attends causally, from its modules' flags.

    Args:
        model: a Transformers model (a PEFT or DDP wrapper is read through).

    Returns:
        True: a module in or above the decoder blocks says ``is_causal`` or ``is_decoder``; False: such flags
        exist and all are False (an encoder: attention both ways); None: no flag at all (nothing says).

    Example:
        >>> from torch import nn
        >>> class Attn(nn.Linear):
        ...     is_causal = False
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attention, self.mlp = Attn(2, 2), nn.Linear(2, 2)
        >>> class Encoder(nn.Module):
        ...     _no_split_modules = ["Block"]
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList([Block(), Block()])
        >>> attends_causally(Encoder())
        False
        >>> Attn.is_causal = True
        >>> attends_causally(Encoder())
        True
    """
    m = anatomy.unwrapped(model)
    try:
        blocks = anatomy.decoder_blocks(m)
    except ValueError:
        return None
    inside = {id(mod) for b in blocks for mod in b.modules()}
    names = {id(mod): name for name, mod in m.named_modules()}
    stack = names.get(id(blocks), "")
    above = {id(mod) for name, mod in m.named_modules() if stack == name or stack.startswith(name + ".") or not name}
    flags = {v for mod in m.modules() if id(mod) in inside | above
             for a in FLAGS if isinstance(v := getattr(mod, a, None), bool)}
    return True if True in flags else False if flags else None


def refusal(model_type: str) -> str:
    """The one line ``bp-mech plan`` refuses a non-causal model with.

    Args:
        model_type: the config's ``model_type``.

    Returns:
        The line (a ``PlanError``'s message).

    Example:
        >>> refusal("bert")[:60]
        "'bert' does not attend causally (an encoder: is_decoder is f"
    """
    return (f"{model_type!r} does not attend causally (an encoder: is_decoder is false, attention looks both "
            "ways); bp-mech plan plans causal LMs only (a BERT-style model with is_decoder=true is one)")
