"""Answers for Part 02 · 19.

``CheckpointedBlock`` is the package's own (``src/bp_mech/checkpointing.py``, beside
``CheckpointFunction``); ``count_forward_calls`` is the general form of the package's
``ForwardCounter`` (``src/bp_mech/bench/counters.py``).
"""

from typing import Callable

from torch import nn

from bp_mech.checkpointing import CheckpointedBlock  # noqa: F401


def count_forward_calls(modules: list[nn.Module],
                        step: Callable[[], object]) -> list[int]:
    counts = [0] * len(modules)

    def make_hook(i):
        def hook(module, args):
            counts[i] += 1
        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(modules)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return counts
