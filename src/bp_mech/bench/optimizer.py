"""The optimizer of a step: which one, which implementation, made by one factory.

``StepOptions`` says how a step is run besides its memory strategy (the optimizer and its implementation,
the learning rate, the offload's threshold, whose autocast lists); ``make_optimizer`` builds the optimizer
it names over the parameters that train. AdamW itself always comes from ``instruments.adamw.make_adamw``
(the package's one AdamW factory: fused on CUDA, foreach on the CPU unless told otherwise).

Besides AdamW: SGD with momentum, ``Adafactor`` (``torch.optim.Adafactor``, whose step also runs on fake
tensors) and ``adamw8bit`` (bitsandbytes' blockwise 8-bit AdamW, imported only when asked for).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from unittest import mock

import torch

from bp_mech.instruments.adamw import ADAMW_FLAGS, ADAMW_IMPLS, adamw_impl, make_adamw

AUTOCAST_POLICIES = ("cpu", "cuda")  # whose autocast op lists a step follows (``StepOptions.autocast``)
# the optimizers a step can take (``StepOptions.optimizer``) -> the implementations each one offers
OPTIMIZERS = {"adamw": ADAMW_IMPLS,  # torch.optim.AdamW
              "sgd": ADAMW_IMPLS,  # torch.optim.SGD, momentum 0.9 (one buffer per parameter)
              "adafactor": ("foreach", "for-loop"),  # torch.optim.Adafactor (factored second moments; no fused)
              "adamw8bit": ()}  # bitsandbytes.optim.AdamW8bit: its own blockwise 8-bit kernels, no choice


@dataclass(frozen=True)
class StepOptions:
    """How a step is run besides its memory strategy: the optimizer and the offload's threshold."""

    adamw: str | None = None  # "fused" | "foreach" | "for-loop"; None: make_adamw's for the device
    # (fused on CUDA)
    offload_min_bytes: int | None = None  # offload: smaller storages stay; None: offload.min_bytes(device)
    lr: float = 1e-4  # the optimizer's learning rate (memory does not depend on it)
    autocast: str | None = None  # whose autocast policy fp16/bf16 follow: "cpu" | "cuda"; None: the device's
    optimizer: str = "adamw"  # "adamw" | "sgd" | "adafactor" | "adamw8bit" (``OPTIMIZERS``); ``adamw``: its implementation

    def __post_init__(self):
        if self.adamw not in (None, *ADAMW_IMPLS):
            raise ValueError(f"unknown AdamW implementation {self.adamw!r}; known: {', '.join(ADAMW_IMPLS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        if self.autocast not in (None, *AUTOCAST_POLICIES):
            raise ValueError(f"unknown autocast policy {self.autocast!r}; known: {', '.join(AUTOCAST_POLICIES)}")

    def for_device(self, device) -> "StepOptions":
        """These options with their defaults resolved for ``device``: ``make_adamw``'s AdamW (fused on
        CUDA, foreach on the CPU), Part 02 · 42's ``offload.min_bytes`` and the device's autocast policy
        (a fake CPU step of a CUDA run follows CUDA's: ``planner.cuda_autocast``)."""
        from bp_mech.offload import min_bytes

        cuda = torch.device(device).type == "cuda"
        impl = adamw_impl(device)
        impl = impl if impl in OPTIMIZERS[self.optimizer] else "foreach"  # (Adafactor has no fused: foreach)
        return dataclasses.replace(
            self, adamw=self.adamw or impl,
            offload_min_bytes=min_bytes(device) if self.offload_min_bytes is None else self.offload_min_bytes,
            autocast=self.autocast or ("cuda" if cuda else "cpu"))


def make_optimizer(params, options: StepOptions, device, adamw: str | None = None) -> torch.optim.Optimizer:
    """``options.optimizer`` over the parameters that require grad (frozen ones get no state) at ``options.lr``,
    in implementation ``adamw`` (None: ``options.for_device(device).adamw``). AdamW and SGD: "fused" (one
    kernel per parameter group), "foreach" (PyTorch's default on CUDA: each operation over all tensors at
    once) or "for-loop" (``foreach=False, fused=False``); Adafactor: foreach or for-loop; the 8-bit AdamW
    (``bitsandbytes``, imported only then) has one and ignores ``adamw``. Raises ValueError for another."""
    params = [p for p in params if p.requires_grad]
    kind, impl = options.optimizer, adamw or options.for_device(device).adamw
    if kind == "adamw8bit":
        return adamw8bit(params, options.lr)
    if impl not in OPTIMIZERS[kind]:
        raise ValueError(f"unknown AdamW implementation {impl!r}; known: {', '.join(ADAMW_IMPLS)}" if kind == "adamw"
                         else f"{kind} has no implementation {impl!r}; it has: {', '.join(OPTIMIZERS[kind])}")
    flags = ADAMW_FLAGS[impl]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=options.lr, momentum=0.9, **flags)
    if kind == "adafactor":
        return Adafactor(params, lr=options.lr, foreach=flags["foreach"])
    return make_adamw(params, options.lr, device, impl)


@contextlib.contextmanager
def quiet_bitsandbytes():
    """bitsandbytes' import-time warnings off (``peft`` imports it where it is installed; on a CPU without the
    ``kernels`` package it warns about a 4-bit kernel no step here uses): one line of output per error."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def adamw8bit(params, lr: float):
    """bitsandbytes' ``AdamW8bit`` over ``params``. Under ``FakeTensorMode`` its quantization maps, which it
    computes from values (``create_dynamic_map``), are made with real tensors and then made fake; its update
    kernels have fake implementations of their own."""
    with quiet_bitsandbytes():
        from bitsandbytes.optim import AdamW8bit
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    params = list(params)
    mode = detect_fake_mode(params)
    if mode is None:
        return AdamW8bit(params, lr=lr)
    with unset_fake_temporarily():
        opt = AdamW8bit(params, lr=lr)
    opt.name2qmap = {k: mode.from_tensor(v) for k, v in opt.name2qmap.items()}
    return opt


def _one(t):
    return 1.0 if type(t).__name__ == "FakeTensor" else _ITEM(t)


_ITEM = torch.Tensor.item


class Adafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor``, whose step also runs on fake tensors: it reads scalars (the step count, the
    parameters' and updates' norms) into Python arithmetic with ``.item()``, which a fake tensor cannot
    answer; under fake tensors each reads 1.0 (what it allocates does not depend on them)."""

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if not any(type(p).__name__ == "FakeTensor" for p in params):
            return super().step(closure)
        with mock.patch.object(torch.Tensor, "item", _one):
            return super().step(closure)
