"""Answers for Part 02 · 19.

``CheckpointedBlock`` is the package's own (``src/bp_mech/checkpointing.py``, beside
``CheckpointFunction``); ``count_forward_calls`` is the general form of the package's
``ForwardCounter`` (``src/bp_mech/instruments/counters.py``).
"""

from collections.abc import Callable

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


def choose_checkpoint_layers(saved_bytes: list[int], input_bytes: list[int],
                             budget: int) -> list[int]:
    # checkpointing layer l saves A_l - H_l bytes, whichever other layers are chosen:
    # the k largest savings are the most k layers can save, so take them in that order
    need = sum(saved_bytes) - budget  # bytes that must go
    if sum(input_bytes) > budget:
        raise ValueError(f"even checkpointing every layer keeps {sum(input_bytes)} B "
                         f"> budget {budget} B")
    order = sorted(range(len(saved_bytes)),
                   key=lambda i: saved_bytes[i] - input_bytes[i], reverse=True)
    chosen = []
    for i in order:
        if need <= 0:
            break
        chosen.append(i)
        need -= saved_bytes[i] - input_bytes[i]
    return sorted(chosen)


def predict_saved_bytes(batch: int, seq: int, width: int, expansion: int,
                        layers: int, every: int, element_bytes: int) -> int:
    """Walk one block and ask what each backward reads: the first Linear its input
    (H bytes), SiLU its input (e H), the second Linear its input, SiLU's output (e H).
    A plain block saves A = (1 + 2e) H; a checkpointed one only its input, H. Count
    the checkpointed layers and add."""
    H = batch * seq * width * element_bytes  # one (batch, seq, width) tensor
    A = H + 2 * expansion * H  # the first Linear's input, SiLU's input, the second's
    checkpointed = sum(1 for i in range(layers) if every > 0 and i % every == 0)
    return checkpointed * H + (layers - checkpointed) * A
