"""The package's one AdamW factory: which implementation on which device, and the optimizer itself.

Every AdamW of the package (the experiments' arms, the one training step's ``bench.optimizer``, the
mechanisms' demonstrations, ``bp-mech plan``'s traced step) comes from ``make_adamw``, so the choice of
implementation (``adamw_impl``: fused on CUDA, foreach on the CPU) is made in one place. What PyTorch itself
would pick is ``torch_default_adamw``.
"""

from __future__ import annotations

import torch

ADAMW_IMPLS = ("fused", "foreach", "for-loop")  # AdamW implementations (torch.optim.AdamW's flags)
ADAMW_FLAGS = {"fused": dict(fused=True), "foreach": dict(foreach=True),
               "for-loop": dict(foreach=False, fused=False)}


def adamw_impl(device) -> str:
    """The AdamW implementation the package uses on ``device`` unless told otherwise: "fused" on CUDA (one
    kernel per parameter group), "foreach" elsewhere (each operation over all tensors at once)."""
    return "fused" if torch.device(device).type == "cuda" else "foreach"


def torch_default_adamw(device="cuda") -> str:
    """The AdamW implementation PyTorch itself picks on ``device`` when neither ``foreach`` nor ``fused`` is
    given (``torch.optim.optimizer._default_to_fused_or_foreach``): foreach on the devices with foreach
    kernels (CUDA), else the for-loop one (the CPU). ``bp-mech plan --optimizer-impl default`` plans it."""
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices

    return "foreach" if torch.device(device).type in _get_foreach_kernels_supported_devices() else "for-loop"


def make_adamw(params, lr: float, device, impl: str | None = None, **kw) -> torch.optim.AdamW:
    """The package's one AdamW factory.

    Args:
        params: parameters or parameter groups, as ``torch.optim.AdamW`` takes them.
        lr: the learning rate.
        device: where the parameters live: picks the implementation when ``impl`` is None.
        impl: "fused" | "foreach" | "for-loop" (``ADAMW_IMPLS``); None: ``adamw_impl(device)``.
        **kw: AdamW's other arguments (``weight_decay``, ``eps``, ``betas``).

    Returns:
        The ``torch.optim.AdamW``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = make_adamw([p], 1e-3, "cpu")
        >>> opt.defaults["foreach"], make_adamw([p], 1e-3, "cpu", "for-loop").defaults["foreach"]
        (True, False)
    """
    impl = impl or adamw_impl(device)
    if impl not in ADAMW_FLAGS:
        raise ValueError(f"unknown AdamW implementation {impl!r}; known: {', '.join(ADAMW_IMPLS)}")
    return torch.optim.AdamW(params, lr=lr, **ADAMW_FLAGS[impl], **kw)
