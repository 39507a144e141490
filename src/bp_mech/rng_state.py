"""The global RNG states of a training run, captured and set again (Part 02 · 56).

A resumed run draws what the uninterrupted one drew only if the global generators are where
they were: torch's CPU generator (and every CUDA device's on CUDA), Python's ``random`` and
NumPy's. Nothing in the book's loop draws from them, but dropout or a shuffling sampler
would. ``bp_mech.training_state`` saves these states in ``rng.pt``.
"""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["rng_states", "set_rng_states"]


def rng_states(device) -> dict:
    """The global RNG states: torch's CPU (and, on CUDA, every device's) generator,
    Python's and NumPy's.

    Args:
        device: the trainer's device; when its type is ``cuda``, every CUDA device's
            state is added.

    Returns:
        ``{"torch": torch.get_rng_state(), "python": random.getstate(),
        "numpy": [name, keys, pos, has_gauss, cached_gaussian]}`` (and ``"cuda"``: one
        state per device),
        as tensors and lists, which ``torch.load(weights_only=True)`` reads back from
        ``rng.pt``.

    Example:
        >>> sorted(rng_states("cpu"))
        ['numpy', 'python', 'torch']
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = dict(torch=torch.get_rng_state(), python=random.getstate(),
               numpy=[name, keys.tolist(), pos, has_gauss, gauss])
    if torch.device(device).type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    """Set the global RNGs to an ``rng_states`` dict: the draws that followed it are
    drawn again.

    Args:
        states: what ``rng_states`` returned (or rng.pt holds); not changed. ``cuda`` is
            used only with CUDA.

    Returns:
        None.

    Example:
        >>> states = rng_states("cpu")
        >>> draws = (torch.rand(2).tolist(), random.random(), np.random.rand())
        >>> set_rng_states(states)
        >>> (torch.rand(2).tolist(), random.random(), np.random.rand()) == draws
        True
    """
    torch.set_rng_state(states["torch"].clone())
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, g = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
