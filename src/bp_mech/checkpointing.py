"""Part 02 · 19 — TRAIN-CHECKPOINT: activation (gradient) checkpointing.

Between forward and backward a training step keeps every tensor autograd saved for backward.
Checkpointing keeps only a block's inputs and runs the block's forward a second time in
backward to rebuild the rest (Griewank & Walther 2000; Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"): the saved activations of a block shrink to its input, the step
pays one extra forward of every checkpointed block.

* From scratch: ``CheckpointFunction`` / ``CheckpointedBlock`` (the reentrant design: forward
  under ``no_grad`` saving only the input, recompute and backpropagate inside ``backward``).
* With the framework: Transformers' ``gradient_checkpointing_enable`` (every layer, or every
  n-th layer), which calls ``torch.utils.checkpoint`` non-reentrant; ``checkpoint_mlp``, a
  selective variant that wraps only each layer's MLP in ``torch.utils.checkpoint``.
* One switch for all of them: ``configure(model, candidate)`` applies one of ``CONFIGURATIONS`` for
  the duration of a ``with`` block and undoes it after; ``"plain"`` is off, a
  ``contextlib.nullcontext`` that touches nothing.

The experiment of the chapter (candidates, measured steps, decision, records) lives in
``bp_mech.experiments.checkpointing``; the recompute and the saved bytes are counted by
``bp_mech.bench.counters``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# --- from scratch ---------------------------------------------------------------------


class CheckpointFunction(torch.autograd.Function):
    """``y = fn(x)`` keeping only ``x``; backward runs ``fn(x)`` again, with grad, and differentiates it.

    ``params`` (those ``fn`` uses) are passed as inputs so that autograd asks for their gradients
    even when ``x`` needs none; they are not activations, keeping a reference to them costs nothing.
    (No RNG stashing, unlike ``torch.utils.checkpoint``: Qwen2 has no dropout.)
    """

    @staticmethod
    def forward(ctx, fn, x, *params):  # x (..., C)
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)  # the only activation kept between forward and backward
        with torch.no_grad():  # no graph: fn's intermediates are freed as soon as they are used
            return fn(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)  # the recompute: a second forward of the block, now building a graph
        grads = torch.autograd.grad(y, [x, *ctx.params], dy, allow_unused=True)
        return None, *grads


class CheckpointedBlock(nn.Module):
    """A block whose forward keeps only its input; ``calls`` counts real executions of the block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.calls = 0  # forward executions, the recompute in backward included

    def _run(self, x):
        self.calls += 1  # counted where the block runs, so a recompute cannot be missed or faked
        return self.block(x)

    def forward(self, x):
        params = [p for p in self.block.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return self._run(x)  # nothing to differentiate: a plain forward
        return CheckpointFunction.apply(self._run, x, *params)


# --- with the framework ---------------------------------------------------------------


class _Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (non-reentrant) while training."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def checkpoint_mlp(model):
    """Selective checkpointing: only each decoder layer's MLP is recomputed in backward."""
    layers = model.model.layers
    for layer in layers:
        layer.mlp = _Checkpointed(layer.mlp)
    try:
        yield model
    finally:
        for layer in layers:
            layer.mlp = layer.mlp.inner


def enable_native(model, every_n_layers: int = 1) -> None:
    """Transformers' checkpointing: ``torch.utils.checkpoint`` (non-reentrant) on every n-th layer."""
    kwargs = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    has_every_n = "every_n_layers" in inspect.signature(model.gradient_checkpointing_enable).parameters
    if has_every_n:
        kwargs["every_n_layers"] = every_n_layers
    model.gradient_checkpointing_enable(**kwargs)
    if not has_every_n:  # older Transformers: the same per-layer flags, set by hand
        for i, layer in enumerate(model.model.layers):
            layer.gradient_checkpointing = i % every_n_layers == 0


@contextlib.contextmanager
def native_checkpointing(model, every_n_layers: int = 1):
    """``enable_native`` inside the block; Transformers' own switch turns it off after."""
    enable_native(model, every_n_layers)
    try:
        yield model
    finally:
        model.gradient_checkpointing_disable()
        model.disable_input_require_grads()  # enable added a hook on the embeddings


# --- one switch -----------------------------------------------------------------------

EVERY_N_LAYERS = {"checkpoint-all": 1, "checkpoint-every2": 2}  # native configurations: checkpoint every n-th layer
CONFIGURATIONS = ("plain", "checkpoint-all", "checkpoint-every2", "checkpoint-mlp")  # what ``configure`` accepts


def configure(model, candidate: str):
    """A context manager that applies checkpointing configuration ``candidate`` to ``model`` inside
    the ``with`` block and undoes it after (also when the block raises).

    ``"plain"`` is the off switch: ``contextlib.nullcontext(model)``, nothing is touched;
    ``"checkpoint-all"`` / ``"checkpoint-every2"``: Transformers' checkpointing on every (every
    second) decoder layer; ``"checkpoint-mlp"``: each layer's MLP only. ``with configure(...) as m``
    gives ``model`` back in every case.
    """
    if candidate == "plain":
        return contextlib.nullcontext(model)
    if candidate == "checkpoint-mlp":
        return checkpoint_mlp(model)
    if candidate in EVERY_N_LAYERS:
        return native_checkpointing(model, EVERY_N_LAYERS[candidate])
    raise ValueError(f"unknown checkpointing configuration {candidate!r}; one of {CONFIGURATIONS}")
