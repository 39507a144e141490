"""Checks of exercises/ex19_checkpointing.py, the variant and the prediction: ``choose_checkpoint_layers``
against a brute force over every set of layers (byte counts drawn up to 2**60) and on an MLP stack whose saved
bytes are measured with counting-only ``saved_tensors_hooks`` (``SavedBytesCounter``); ``predict_saved_bytes``
against that measurement, exactly. The declarations are ``ex19``'s (``CHECKS``).
"""

import itertools

import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.checks.common import CheckFailed, describe
from bp_mech.checks.engine import Contract, Raises
from bp_mech.instruments.counters import SavedBytesCounter


def seeded(net, seed):
    """``net`` with weights drawn from a generator seeded by ``seed`` (scaled by 1/sqrt(fan-in)).

    Args:
        net: a module.
        seed: the generator's seed.

    Returns:
        ``net``, its parameters overwritten in place.

    Example:
        >>> torch.equal(seeded(nn.Linear(2, 2), 0).weight, seeded(nn.Linear(2, 2), 0).weight)
        True
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return net


def kept_bytes(A, H, S) -> int:
    """The saved bytes of a step that checkpoints the layers ``S``: ``M(S)`` of the exercise.

    Args:
        A, H: saved and input bytes per layer.
        S: the checkpointed layers.

    Returns:
        sum of ``H[l]`` over ``S`` and of ``A[l]`` over the rest, an int.

    Example:
        >>> kept_bytes([10, 20], [1, 2], {1})
        12
    """
    return sum(H[i] if i in S else a for i, a in enumerate(A))


def fewest(A, H, budget):
    """Brute force: the size of the smallest set of layers whose ``kept_bytes`` fit ``budget``, or None.

    Args:
        A, H: saved and input bytes per layer.
        budget: the bytes allowed.

    Returns:
        an int, or None when no set fits.

    Example:
        >>> fewest([10, 20], [1, 2], 12), fewest([10, 20], [1, 2], 2)
        (1, None)
    """
    for k in range(len(A) + 1):
        if any(kept_bytes(A, H, set(S)) <= budget for S in itertools.combinations(range(len(A)), k)):
            return k
    return None


def _measure(layers, x, chosen):
    """Saved bytes outside the checkpointed regions of one forward (counting-only hooks)."""
    counter = SavedBytesCounter([p for layer in layers for p in layer.parameters()])
    with counter:
        h = x
        for i, layer in enumerate(layers):
            h = checkpoint(layer, h, use_reentrant=False) if i in chosen else layer(h)
    return counter.bytes


def _stack(expansions, c=4, seed=0):
    return seeded(nn.ModuleList(nn.Sequential(nn.Linear(c, e * c), nn.SiLU(), nn.Linear(e * c, c))
                                 for e in expansions), seed)



def _drive_choose(f):
    """The result's kind, its order, the bytes it keeps over the budget (measured on ``stack`` when given), its size;
    the lists it was given left as they were."""
    def run(saved_bytes, input_bytes, budget, stack=None):
        A, H = list(saved_bytes), list(input_bytes)
        got = f(saved_bytes, input_bytes, budget)
        if sum(H) > budget:
            return got  # refused: the check names what came back instead of ValueError
        for name, now, was in (("saved_bytes", saved_bytes, A), ("input_bytes", input_bytes, H)):
            if now != was:
                raise CheckFailed(f"choose_checkpoint_layers: {name} was modified in place (now {now}, was {was}) at "
                                  f"budget {budget}")
        if type(got) is not list or any(type(i) is not int for i in got):
            inner = next((describe(i) for i in got if type(i) is not int), "") if type(got) is list else ""
            return (f"{describe(got)} holding {inner}" if inner else describe(got)), None, None, None
        if got != sorted(set(got)) or not all(0 <= i < len(A) for i in got):
            return "a list of int", repr(got), None, None
        kept = _measure(*stack, set(got)) if stack else kept_bytes(A, H, set(got))
        return "a list of int", f"ascending, distinct, in range({len(A)})", max(0, kept - budget), len(got)
    return run


def _choose_ref(saved_bytes, input_bytes, budget, stack=None):
    best = fewest(saved_bytes, input_bytes, budget)
    if best is None:
        return Raises(ValueError, f"a budget no set fits (every layer checkpointed keeps {sum(input_bytes)} B)")
    return "a list of int", f"ascending, distinct, in range({len(saved_bytes)})", 0, best


def _choose(c):
    if "expansions" not in c:
        return {"saved_bytes": list(c["A"]), "input_bytes": list(c["H"]), "budget": c["budget"]}
    layers = _stack(c["expansions"])
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    A = [_measure(layers[i:i + 1], x, set()) for i in range(len(layers))]  # each layer alone, measured
    H = [x.numel() * x.element_size()] * len(layers)
    plain = _measure(layers, x, set())
    budget = {"plain": plain, "plain - 1": plain - 1, "plain // 2": plain // 2, "sum(H)": sum(H)}[c["budget"]]
    return {"saved_bytes": A, "input_bytes": H, "budget": budget, "stack": (layers, x)}


@st.composite
def _instance(draw):
    L, scale = draw(st.integers(1, 7)), draw(st.sampled_from([1, 2**20, 2**60]))
    A = [draw(st.integers(0, 1000)) * scale + draw(st.integers(0, 3)) for _ in range(L)]
    H = [draw(st.integers(0, a)) for a in A]
    lo, hi = sum(H) - 2, sum(A) + 1
    return {"A": A, "H": H, "budget": max(0, draw(st.integers(lo, max(lo, hi))))}


def _fixed(A, H, budget, what):
    return {"A": A, "H": H, "budget": budget, "what": what}


CHOOSE = Contract(
    "choose_checkpoint_layers", _choose, _choose_ref,
    ("the result", "the layers' order", "bytes over the budget", "layers checkpointed"), use=_drive_choose,
    strides=False,
    ref_name="brute force over every set of layers", draw=_instance(),
    note=lambda c: c.get("what") or ("an MLP stack of expansions (1, 8, 2, 6, 3): A measured with saved-tensor hooks, "
                                     "and the bytes kept" if "expansions" in c else ""),
    examples={"": [_fixed([100, 100, 100], [10, 10, 10], 300, "the plain step fits"),
                   _fixed([100, 60, 90], [10, 50, 10], 200, "two layers could do, one is enough"),
                   _fixed([100, 90, 50], [95, 10, 5], 120, "A - H decides, not A"),
                   _fixed([2**60 + 3, 5], [0, 0], 2**60 + 7, "byte counts above 2**53"),
                   _fixed([100, 100], [50, 50], 100, "exactly at the budget, every layer"),
                   _fixed([100, 100], [50, 51], 100, "one byte over with every layer checkpointed"),
                   _fixed([7], [7], 6, "one layer whose checkpoint saves nothing, over budget"),
                   _fixed([5, 5], [3, 3], 6, "each saves 2 B: both needed"),
                   _fixed([0, 0, 0], [0, 0, 0], 0, "nothing saved, budget 0"),
                   _fixed([40, 30, 20, 10], [0, 0, 0, 0], 59, "three layers needed, the largest three"),
                   _fixed([2**60, 2**60, 2**60], [1, 2**59, 3], 2**61 + 5, "large counts: A - H decides")],
              "measured": [{"expansions": (1, 8, 2, 6, 3), "budget": b} for b in ("plain", "plain - 1", "plain // 2",
                                                                                   "sum(H)")]})


def measured_saved_bytes(batch, seq, width, expansion, layers, every, element_bytes) -> int:
    """The saved bytes of the exercise's MLP stack, every ``every``-th layer checkpointed, measured.

    Args:
        batch, seq, width, expansion, layers, every: the workload of ``predict_saved_bytes``.
        element_bytes: 4 (float32) or 8 (float64).

    Returns:
        the bytes counting-only saved-tensor hooks see outside the checkpointed regions, an int.

    Example:
        >>> measured_saved_bytes(1, 1, 2, 1, 1, 0, 4) > 0
        True
    """
    dtype = {4: torch.float32, 8: torch.float64}[element_bytes]
    stack = _stack([expansion] * layers, width).to(dtype)
    x = torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(1), dtype=dtype, requires_grad=True)
    return _measure(stack, x, {i for i in range(layers) if every > 0 and i % every == 0})


PREDICT = Contract(
    "predict_saved_bytes", lambda c: dict(zip(("batch", "seq", "width", "expansion", "layers", "every",
                                               "element_bytes"), c["args"])),
    lambda **a: (measured_saved_bytes(**a),), ("the prediction",), returns=int,
    ref_name="counting-only saved_tensors_hooks", note=lambda c: "exact: a tracker's byte count has no noise",
    examples={"": [{"args": a} for a in ((2, 3, 4, 4, 7, 3, 4), (1, 5, 4, 3, 5, 3, 8), (3, 2, 8, 2, 4, 3, 4),
                                         (2, 2, 4, 4, 6, 1, 4), (1, 3, 4, 2, 5, 2, 8), (2, 1, 4, 3, 3, 0, 4),
                                         (1, 2, 4, 2, 3, -1, 4))]})  # every <= 0: none (the rule: every > 0 and ...)
