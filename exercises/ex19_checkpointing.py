"""Exercises for Part 02 · 19 — activation checkpointing.

1. ``CheckpointedBlock``: checkpoint a block from scratch, with a counter of the block's real
   executions (the forward and the recompute in backward).
2. ``count_forward_calls``: measure, with module hooks, how often each module runs in one step.

Check your solutions with ``bp-mech check 19`` (or
``pytest tests/test_exercises.py -m ch19 --impl exercises``). The checks compare against plain
float64 autograd (gradients to 1e-12), against the bytes a plain block keeps alive after forward
(tracked CPU storages: the block's output and at most 1 KiB more), and against counters that the
checks place inside the modules themselves.
"""

from typing import Callable

import torch
from torch import nn


class CheckpointedBlock(nn.Module):
    """Run ``block`` keeping only its input; rebuild its activations in backward by
    running it again.

    Math: for ``y = f(x; W)`` the backward needs the intermediate activations of ``f``.
    A plain forward keeps them all until backward. A checkpointed forward runs ``f``
    without recording a graph (``torch.no_grad()``), keeps only ``x`` (and the
    parameters, which exist anyway), and in backward runs ``f`` again with grad enabled
    on ``x.detach().requires_grad_()``, then differentiates that recomputed graph with
    the incoming ``dy``:
        dx, dW = torch.autograd.grad(f(x), [x, *W], dy).
    Memory held between forward and backward: the block's input (which exists anyway;
    keep no copy of it) and its output only. Cost: one extra forward of the block.

    Hint: a ``torch.autograd.Function`` whose ``forward(ctx, fn, x, *params)`` saves
    ``x`` and returns ``fn(x)`` under ``no_grad``, and whose ``backward`` recomputes and
    returns ``(None, dx, *dparams)``. Pass the parameters as inputs so that autograd
    asks for their gradients; leave out parameters that do not require grad (a frozen
    part of the block gets no gradient). An input that needs no gradient
    (``x.requires_grad`` False) must still be checkpointed: the parameters need their
    gradients, and the activations are as large. (``torch.utils.checkpoint`` also works,
    but then you learn less.)

    ``self.calls`` must count the real executions of ``self.block``: 1 after a forward,
    2 after that forward's backward, and it must be counted where the block runs, not
    assumed. Under ``torch.no_grad()`` there is nothing to recompute: just run the
    block.

    Args (constructor):
        block: a module mapping ``x`` (..., C) to ``y`` (..., C'), with parameters.

    Forward args:
        x: input, shape (..., C).

    Returns:
        y = block(x), shape (..., C'), connected to autograd so that ``backward``
        reaches ``x`` and the block's parameters.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.calls = 0  # executions of self.block, the recompute included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ex19: CheckpointedBlock.forward")


def count_forward_calls(modules: list[nn.Module],
                        step: Callable[[], object]) -> list[int]:
    """How many times each module's forward runs during ``step()`` (forward and
    backward).

    Register a forward pre-hook on each module (``module.register_forward_pre_hook``),
    call ``step()`` once, remove every hook (also when ``step`` raises), and return the
    counts. Hooks fire on every ``module(...)`` call, including the recompute
    ``torch.utils.checkpoint`` runs during backward, so a checkpointed module counts 2
    and a plain one 1. Calling this twice must give the same counts (no hook left
    behind, no counter carried over).

    Args:
        modules: the modules to count, a list or an ``nn.ModuleList`` (e.g. the decoder
            layers of a model, ``model.model.layers``). A module may run several times
            in one step.
        step: a function running one training step (forward and backward).

    Returns:
        A list of ints, one per module, in the order of ``modules``.
    """
    raise NotImplementedError("ex19: count_forward_calls")
