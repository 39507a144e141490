"""Part 02 · 19 — TRAIN-CHECKPOINT: activation (gradient) checkpointing.

Between forward and backward a training step keeps every tensor autograd saved for
backward. Checkpointing keeps only a block's inputs and runs the block's forward a
second time in backward to rebuild the rest (Griewank & Walther 2000; Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"): the saved activations of a block
shrink to its input, the step pays one extra forward of every checkpointed block.

* From scratch: ``CheckpointFunction`` / ``CheckpointedBlock`` (the older, reentrant
  design: forward under ``no_grad`` saving only the input, recompute and backpropagate
  inside ``backward``).
* With the framework (``bp_mech.checkpointing_native``): Transformers'
  ``gradient_checkpointing_enable`` (every layer, or every n-th layer) and
  ``checkpoint_mlp`` (each layer's MLP only), both ``torch.utils.checkpoint``
  non-reentrant: saved-tensor hooks, the recompute on the first unpack in backward.
* One switch for all of them: ``configure(model, candidate)`` applies one of
  ``CONFIGURATIONS`` for the duration of a ``with`` block and undoes it after;
  ``"plain"`` is off, a ``contextlib.nullcontext`` that touches nothing.

The experiment of the chapter (candidates, measured steps, decision, records) lives in
``bp_mech.experiments.checkpointing``; the recompute and the saved bytes are counted by
``bp_mech.instruments.counters``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bp_mech.instruments import anatomy
from bp_mech.checkpointing_native import checkpoint_mlp, native_checkpointing

# --- from scratch ---------------------------------------------------------------------


class CheckpointFunction(torch.autograd.Function):
    """``y = fn(x)`` keeping only ``x``; backward runs ``fn(x)`` again, with grad, and
    differentiates it.

    ``params`` (those ``fn`` uses) are passed as inputs so that autograd asks for
    their gradients even when ``x`` needs none; they are not activations, keeping a
    reference to them costs nothing. (No RNG stashing, unlike
    ``torch.utils.checkpoint``: Qwen2 has no dropout.) Called as
    ``CheckpointFunction.apply(fn, x, *params)``; the arguments are those of
    ``forward``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> lin = nn.Linear(4, 4).double()
        >>> x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
        >>> y = CheckpointFunction.apply(lambda t: lin(t).tanh(), x, *lin.parameters())
        >>> torch.allclose(y, lin(x).tanh()), y.grad_fn.name()
        (True, 'CheckpointFunctionBackward')
    """

    @staticmethod
    def forward(ctx, fn, x, *params):  # x (..., C)
        """Run ``fn(x)`` under ``no_grad`` and save only ``x`` for the backward.

        Args:
            ctx: the autograd context (``apply`` supplies it); keeps ``fn``, ``params``
                and ``x``.
            fn: the block, a callable ``(..., C) -> (..., C')``; it must be
                deterministic (it runs twice).
            x: the block's input (..., C), the only activation kept between forward and
                backward.
            *params: the parameters ``fn`` uses, so that autograd returns their
                gradients.

        Returns:
            ``fn(x)`` (..., C'), computed without a graph: none of ``fn``'s
            intermediates is kept.

        Example:
            >>> x = torch.ones(3, 2, requires_grad=True)
            >>> y = CheckpointFunction.apply(lambda t: (2 * t).exp(), x)
            >>> tuple(y.shape), y.requires_grad
            ((3, 2), True)
        """
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)  # the only activation kept until backward
        with torch.no_grad():  # no graph: fn's intermediates are freed once used
            return fn(x)

    @staticmethod
    def backward(ctx, dy):
        """Recompute ``fn(x)`` with grad (the block's second forward), then
        differentiate it.

        Args:
            ctx: the context ``forward`` filled: ``fn``, ``params`` and the saved ``x``.
            dy: dL/dy (..., C'), the upstream gradient of the block's output.

        Returns:
            ``(None, dx, *dparams)``: nothing for ``fn``, dL/dx (..., C) (None if ``x``
            is unused) and one gradient per parameter, each of its parameter's shape
            (None if unused).

        Example:
            >>> x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
            >>> y = CheckpointFunction.apply(torch.sin, x)
            >>> torch.allclose(torch.autograd.grad(y.sum(), x)[0], x.cos())
            True
        """
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)  # the recompute: a second forward, now building a graph
        grads = torch.autograd.grad(y, [x, *ctx.params], dy, allow_unused=True)
        return None, *grads


class CheckpointedBlock(nn.Module):
    """A block whose forward keeps only its input; ``calls`` counts real executions of
    the block.

    Args:
        block: the module to checkpoint, ``(..., C) -> (..., C')`` of one tensor input.

    Attributes:
        block: the wrapped module.
        calls: how often ``block`` ran, the recompute in backward included.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> cb = CheckpointedBlock(mlp)
        >>> cb(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> cb.calls  # the forward, then the recompute in backward
        2
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.calls = 0  # forward executions, the recompute in backward included

    def _run(self, x):
        self.calls += 1  # counted where the block runs: a recompute cannot be missed
        return self.block(x)

    def forward(self, x):
        """``block(x)``, through ``CheckpointFunction`` whenever there is something to
        differentiate.

        Args:
            x: the block's input (..., C).

        Returns:
            ``block(x)`` (..., C'). Under ``no_grad``, or with neither ``x`` nor a
            parameter requiring grad, a plain forward (nothing is saved, nothing is
            recomputed).

        Example:
            >>> cb = CheckpointedBlock(nn.Linear(4, 4))
            >>> with torch.no_grad():
            ...     y = cb(torch.ones(3, 4))
            >>> tuple(y.shape), y.grad_fn is None, cb.calls
            ((3, 4), True, 1)
        """
        params = [p for p in self.block.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return self._run(x)  # nothing to differentiate: a plain forward
        return CheckpointFunction.apply(self._run, x, *params)


# --- one switch -----------------------------------------------------------------------

# the native configurations: checkpoint every n-th layer
EVERY_N_LAYERS = {"checkpoint-all": 1, "checkpoint-every2": 2}
# what ``configure`` accepts
CONFIGURATIONS = ("plain", "checkpoint-all", "checkpoint-every2", "checkpoint-mlp")


def unsupported(model, candidate: str) -> str | None:
    """Why configuration ``candidate`` cannot be applied to ``model``, or None when it can.

    Transformers' checkpointing needs a model that supports it (``supports_gradient_checkpointing``);
    ``checkpoint-mlp`` needs an MLP child in each decoder block (``instruments.anatomy.mlp_name``: OPT's
    ``fc1``/``fc2`` sit on the block itself).

    Args:
        model: a Transformers causal LM.
        candidate: one of ``CONFIGURATIONS``.

    Returns:
        The reason, one line, or None.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> unsupported(build_model(parse_workload("tiny-b1s8")), "checkpoint-mlp") is None
        True
    """
    if candidate in EVERY_N_LAYERS and not getattr(model, "supports_gradient_checkpointing", False):
        return f"{type(model).__name__} does not support gradient checkpointing in Transformers"
    if candidate == "checkpoint-mlp":
        try:
            blocks = anatomy.decoder_blocks(model)
        except ValueError as e:
            return str(e)
        if anatomy.mlp_name(blocks[0]) is None:
            return f"{type(blocks[0]).__name__} has no MLP child to checkpoint"
    return None


def configure(model, candidate: str):
    """A context manager that applies checkpointing configuration ``candidate`` to
    ``model`` inside the ``with`` block and undoes it after (also when the block
    raises).

    ``"plain"`` is the off switch: ``contextlib.nullcontext(model)``, nothing is
    touched;
    ``"checkpoint-all"`` / ``"checkpoint-every2"``: Transformers' checkpointing on every
    (every second) decoder layer; ``"checkpoint-mlp"``: each layer's MLP only.
    ``with configure(...) as m`` gives ``model`` back in every case.

    Args:
        model: a ``transformers`` Qwen2 causal LM.
        candidate: one of ``CONFIGURATIONS``.

    Returns:
        A context manager yielding ``model``.

    Raises:
        ValueError: ``candidate`` is not in ``CONFIGURATIONS``.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model = build_model(parse_workload("tiny-b1s8"))
        >>> with configure(model, "checkpoint-all") as m:
        ...     m is model and m.is_gradient_checkpointing
        True
        >>> with configure(model, "plain") as m:
        ...     m.is_gradient_checkpointing
        False
    """
    if candidate == "plain":
        return contextlib.nullcontext(model)
    if candidate == "checkpoint-mlp":
        return checkpoint_mlp(model)
    if candidate in EVERY_N_LAYERS:
        return native_checkpointing(model, EVERY_N_LAYERS[candidate])
    raise ValueError(f"unknown checkpointing configuration {candidate!r}; "
                     f"one of {CONFIGURATIONS}")
