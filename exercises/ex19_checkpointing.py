"""Exercises for Part 02 · 19 — activation checkpointing.

1. ``CheckpointedBlock``: checkpoint a block from scratch, with a counter of the block's real
   executions (the forward and the recompute in backward).
2. ``count_forward_calls``: measure, with module hooks, how often each module runs in one step.
3. ``choose_checkpoint_layers`` (variant): a selective policy, the fewest layers to checkpoint
   so that the saved bytes fit a budget.
4. ``predict_saved_bytes`` (predict, then measure): the saved bytes of checkpointing every
   ``every``-th layer of an MLP stack, by the chapter's per-layer formula.

Check your solutions with ``bp-mech check 19`` (or
``pytest tests/test_exercises.py -m ch19 --impl exercises``). The checks compare against plain
float64 autograd (gradients to 1e-12), against the bytes a plain block keeps alive after forward
(tracked CPU storages: the block's output and at most 1 KiB more), against counters that the
checks place inside the modules themselves, against a brute force over every set of layers, and
against saved bytes measured with counting-only ``saved_tensors_hooks``.
"""

from collections.abc import Callable

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

    Contract (checked): the input ``x`` is left as it was (values and
    ``requires_grad``); a non-contiguous ``x`` (a slice, a transpose) gives the same
    output and gradients; ``calls`` is a Python ``int``; two blocks share no counter
    (each counts its own executions); an exception raised by ``block`` propagates
    unchanged (same type), it is not swallowed.

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
    behind, no counter carried over). An exception raised by ``step`` propagates
    unchanged (same type, not swallowed), after the hooks are removed.

    Args:
        modules: the modules to count, a list or an ``nn.ModuleList`` (e.g. the decoder
            layers of a model, ``model.model.layers``). A module may run several times
            in one step.
        step: a function running one training step (forward and backward).

    Returns:
        A ``list`` of Python ``int`` (not tensors, not floats), one per module, in the
        order of ``modules``.
    """
    raise NotImplementedError("ex19: count_forward_calls")


def choose_checkpoint_layers(saved_bytes: list[int], input_bytes: list[int],
                             budget: int) -> list[int]:
    """The fewest layers to checkpoint so that the saved bytes fit in ``budget``.

    Math: layer l saves ``A_l = saved_bytes[l]`` bytes for backward when it runs
    plainly; checkpointed, it keeps only its input, ``H_l = input_bytes[l]`` bytes
    (``0 <= H_l <= A_l``), and runs once more in backward. For a set S of
    checkpointed layers the step keeps

        M(S) = sum over l not in S of A_l  +  sum over l in S of H_l.

    Return a set S with M(S) <= budget and as few layers as possible (fewest
    recomputes). Among sets of that size any one is accepted.

    Contract (checked, against a brute force over every set of layers and against
    saved bytes measured on a tiny model):
        * the layers come back as a ``list`` of distinct Python ``int`` in
          ``range(len(saved_bytes))``, ascending; ``[]`` when the plain step fits;
        * exact integer arithmetic: byte counts may be far above 2**53 (a float
          sum rounds them);
        * ``M(S) <= budget`` (a step exactly at the budget fits);
        * no set fits (``sum(input_bytes) > budget``): raise ``ValueError``;
        * ``saved_bytes`` and ``input_bytes`` are not modified (no in-place sort).

    Args:
        saved_bytes: ``A_l`` per layer, ints >= 0.
        input_bytes: ``H_l`` per layer, ints with ``0 <= H_l <= A_l``.
        budget: the bytes the saved activations may hold, an int >= 0.

    Returns:
        The indices of the layers to checkpoint, ascending.

    Raises:
        ValueError: even checkpointing every layer exceeds ``budget``.
    """
    raise NotImplementedError("ex19: choose_checkpoint_layers")


def predict_saved_bytes(batch: int, seq: int, width: int, expansion: int,
                        layers: int, every: int, element_bytes: int) -> int:
    """Predict the bytes saved for backward when every ``every``-th layer of an MLP
    stack is checkpointed (before any measurement).

    The workload (the check builds it and measures it): an input ``x`` of shape
    ``(batch, seq, width)``, then ``layers`` blocks, each
    ``Linear(width, expansion * width) -> SiLU -> Linear(expansion * width, width)``,
    all with ``element_bytes`` bytes per element (4: float32, 8: float64); the loss is
    ``out.sum()``. Layer ``i`` is checkpointed (``torch.utils.checkpoint``,
    non-reentrant) when ``every > 0`` and ``i % every == 0`` (``every=3``: layers 0,
    3, 6, ...); ``every=0`` checkpoints none.

    What counts (the measurement is a counting-only ``saved_tensors_hooks`` pass,
    ``instruments.counters.SavedBytesCounter.bytes``): the distinct non-parameter
    storages autograd saves for the backward outside the checkpointed regions, each
    once, in bytes; the parameters are not counted. Work out what each plain layer and
    each checkpointed layer leave saved from what each operation's backward needs
    (Part 02 · 09).

    Returns:
        The saved bytes, a Python ``int``; the check wants it exact (a tracker's
        byte count has no noise).
    """
    raise NotImplementedError("ex19: predict_saved_bytes")
