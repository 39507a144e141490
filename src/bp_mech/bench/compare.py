"""Numbers compared: finiteness (and, later, relative errors)."""

from __future__ import annotations

from typing import Iterable

import torch


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when every given tensor (None skipped) holds only finite values."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)

