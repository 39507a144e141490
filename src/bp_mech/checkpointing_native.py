"""Part 02 · 19, with the framework: ``torch.utils.checkpoint`` as Transformers and the
package call it, always non-reentrant (``use_reentrant=False``: saved-tensor hooks, the
recompute on the first unpack; ``tests/test_checkpointing_design.py`` checks the real
call).

* ``enable_native`` / ``native_checkpointing``: Transformers'
  ``gradient_checkpointing_enable`` on every layer or every n-th layer.
* ``checkpoint_mlp``: a selective variant that wraps only each layer's MLP.

``bp_mech.checkpointing.configure`` is the one switch over these and the plain step.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.instruments import anatomy


class _Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (non-reentrant) in training."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def checkpoint_mlp(model):
    """Selective checkpointing: only each decoder layer's MLP is recomputed in backward.

    Each decoder block's MLP (``instruments.anatomy``; ``model.model.layers[i].mlp`` in
    Qwen2) is wrapped in ``torch.utils.checkpoint``
    (non-reentrant, while the model trains) inside the ``with`` block, unwrapped after.

    Args:
        model: a ``transformers`` Qwen2 causal LM (``model.model.layers``, each with an
            ``mlp``).

    Yields:
        ``model`` itself, its MLPs checkpointed.

    Raises:
        ValueError: the first decoder block has no child of a known MLP name.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> with checkpoint_mlp(model) as m:
        ...     type(m.model.layers[0].mlp).__name__
        '_Checkpointed'
        >>> type(model.model.layers[0].mlp).__name__
        'Qwen2MLP'
    """
    layers = anatomy.decoder_blocks(model)
    name = anatomy.mlp_name(layers[0])
    if name is None:
        raise ValueError(f"{type(layers[0]).__name__} has no MLP child "
                         f"({', '.join(anatomy.MLP_NAMES)}) to checkpoint")
    for layer in layers:
        setattr(layer, name, _Checkpointed(getattr(layer, name)))
    try:
        yield model
    finally:
        for layer in layers:
            setattr(layer, name, getattr(layer, name).inner)


def enable_native(model, every_n_layers: int = 1) -> None:
    """Transformers' checkpointing: ``torch.utils.checkpoint`` (non-reentrant) on every
    n-th layer.

    Calls ``model.gradient_checkpointing_enable``; where that lacks ``every_n_layers``
    (older Transformers), sets the same per-layer ``gradient_checkpointing`` flags by
    hand. It stays on until ``model.gradient_checkpointing_disable()``
    (``native_checkpointing`` does both).

    Args:
        model: a ``transformers`` Qwen2 causal LM.
        every_n_layers: checkpoint decoder layers 0, n, 2n, ... (1: every layer).

    Returns:
        None; ``model`` is changed in place.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))  # 2 decoder layers
        >>> enable_native(model, every_n_layers=2)
        >>> [layer.gradient_checkpointing for layer in model.model.layers]
        [True, False]
    """
    kwargs = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = inspect.signature(model.gradient_checkpointing_enable).parameters
    if "every_n_layers" in params:
        kwargs["every_n_layers"] = every_n_layers
    model.gradient_checkpointing_enable(**kwargs)
    if "every_n_layers" not in params:  # older Transformers: the same flags, by hand
        for i, layer in enumerate(anatomy.decoder_blocks(model)):
            layer.gradient_checkpointing = i % every_n_layers == 0


@contextlib.contextmanager
def native_checkpointing(model, every_n_layers: int = 1):
    """``enable_native`` inside the block; Transformers' own switch turns it off after.

    Args:
        model: a ``transformers`` Qwen2 causal LM.
        every_n_layers: checkpoint every n-th decoder layer (1: every layer).

    Yields:
        ``model`` itself, checkpointed; after the block (also when it raises)
        checkpointing is off and the input-grad hook that enabling added to the
        embeddings is removed.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> with native_checkpointing(model) as m:
        ...     m.is_gradient_checkpointing
        True
        >>> model.is_gradient_checkpointing
        False
    """
    enable_native(model, every_n_layers)
    try:
        yield model
    finally:
        model.gradient_checkpointing_disable()
        model.disable_input_require_grads()  # enable added a hook on the embeddings
