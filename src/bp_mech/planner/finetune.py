"""How a model is fine-tuned rather than trained in full: frozen parameters, or LoRA adapters through ``peft``.

``FineTune`` names the choice; ``apply(model, ft)`` turns a freshly built causal LM into the model that
trains that way (``planner.build.build`` does it right after building, real or under ``FakeTensorMode``, so
``bp-mech plan`` traces the same program a real step runs):

* ``freeze``: a regular expression on the parameter names (``model.named_parameters()``); every match gets
  ``requires_grad=False``: it has no gradient and no optimizer state, but still sits in memory;
* ``lora_rank``: ``peft.get_peft_model(model, LoraConfig(r=..., target_modules=...))``, which freezes the
  whole base model and adds two small matrices (A: r x in, B: out x r, float32 even beside half-precision
  weights: peft's ``autocast_adapter_dtype``) to each targeted linear layer; only those train.

The optimizers a fine-tuning run takes besides AdamW (the 8-bit AdamW, Adafactor) are
``bench.optimizer``'s.

``peft`` and ``bitsandbytes`` are imported only when asked for: the plan and the command run without them.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from bp_mech.bench.optimizer import quiet_bitsandbytes


class FineTuneError(ValueError):
    """A fine-tuning that cannot be applied: a pattern or target that matches nothing, or everything."""


@dataclass(frozen=True)
class FineTune:
    """Which parameters train (the default: all of them).

    Example:
        >>> FineTune(freeze="embed").name, FineTune(lora_rank=8, lora_targets=("q_proj",)).name
        ('freeze=embed', 'lora-r8[q_proj]')
    """

    freeze: str | None = None  # regex (re.search) on parameter names: the matches are frozen; None: none
    lora_rank: int | None = None  # LoRA adapters of this rank through peft (the base model frozen); None: no LoRA
    lora_targets: tuple[str, ...] | None = None  # module names LoRA adapts; None: peft's defaults for the model type
    lora_alpha: int | None = None  # LoRA's scale numerator (memory does not depend on it); None: peft's default

    def __post_init__(self):
        if self.freeze is not None:
            try:
                re.compile(self.freeze)
            except re.error as e:
                raise FineTuneError(f"--freeze {self.freeze!r} is not a regular expression: {e}") from None
        if self.lora_rank is not None and self.lora_rank < 1:
            raise FineTuneError(f"the LoRA rank must be >= 1, got {self.lora_rank}")
        if self.lora_rank is None and (self.lora_targets is not None or self.lora_alpha is not None):
            raise FineTuneError("LoRA targets or alpha without a LoRA rank (--lora-rank R)")
        if self.lora_rank is not None and self.freeze is not None:
            raise FineTuneError("LoRA freezes every base parameter already; --freeze is for fine-tuning without it")
        if self.lora_targets is not None and not all(self.lora_targets):
            raise FineTuneError(f"empty LoRA target in {','.join(self.lora_targets)!r}")

    @property
    def name(self) -> str:
        """``full``, ``freeze=<pattern>`` or ``lora-r<rank>`` (with ``[targets]`` when they are given)."""
        if self.lora_rank is not None:
            return f"lora-r{self.lora_rank}" + (f"[{','.join(self.lora_targets)}]" if self.lora_targets else "")
        return f"freeze={self.freeze}" if self.freeze is not None else "full"


def _apply_without_swap(self, fn, recurse=True):
    """``nn.Module._apply`` for fake parameters: ``Module.to`` swaps a fake parameter in place, which fails
    (the fake mode holds a weak reference to it); a converted one is put in its place instead."""
    if recurse:
        for child in self.children():
            child._apply(fn)
    for key, p in self._parameters.items():
        if p is not None:
            with torch.no_grad():
                new = fn(p)
            if new is not p:
                self._parameters[key] = nn.Parameter(new, requires_grad=p.requires_grad)
    for key, b in self._buffers.items():
        if b is not None:
            self._buffers[key] = fn(b)
    return self


def _module_names(model) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def apply(model, ft: FineTune | None):
    """``model`` fine-tuned as ``ft`` says (None, or nothing set: ``model`` itself, every parameter trains).

    Args:
        model: a causal LM just built (real, or fake under the active ``FakeTensorMode``).
        ft: the ``FineTune``.

    Returns:
        ``model`` with the ``freeze`` matches frozen, or the ``peft`` model wrapping it (LoRA).

    Raises:
        FineTuneError: a ``freeze`` pattern that matches no parameter or every one; a LoRA target that
            matches no module; a model type without peft default targets when none are given.

    Example:
        >>> lm = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
        >>> [p.requires_grad for p in apply(lm, FineTune(freeze="^0\\\\.")).parameters()]
        [False, True, True]
    """
    if ft is None or (ft.freeze is None and ft.lora_rank is None):
        return model
    if ft.freeze is not None:
        names = [n for n, _ in model.named_parameters()]
        hit = [n for n in names if re.search(ft.freeze, n)]
        if not hit:
            raise FineTuneError(f"--freeze {ft.freeze!r} matches no parameter (e.g. {', '.join(names[:3])})")
        if len(hit) == len(names):
            raise FineTuneError(f"--freeze {ft.freeze!r} matches every parameter: nothing would train")
        for n, p in model.named_parameters():
            if n in hit:
                p.requires_grad_(False)
        return model
    with quiet_bitsandbytes():
        from peft import LoraConfig, get_peft_model

    modules = _module_names(model)
    for t in ft.lora_targets or ():
        if not any(n == t or n.endswith("." + t) for n in modules):
            raise FineTuneError(f"LoRA target {t!r} matches no module of {type(model).__name__}")
    extra = {} if ft.lora_alpha is None else dict(lora_alpha=ft.lora_alpha)
    try:
        config = LoraConfig(r=ft.lora_rank, target_modules=list(ft.lora_targets) if ft.lora_targets else None,
                            task_type="CAUSAL_LM", **extra)
        fake = any(type(p).__name__ == "FakeTensor" for p in model.parameters())
        with mock.patch.object(nn.Module, "_apply", _apply_without_swap) if fake else contextlib.nullcontext():
            return get_peft_model(model, config)
    except ValueError as e:  # e.g. no default targets for this model type
        raise FineTuneError(f"LoRA on {model.config.model_type!r}: {str(e).splitlines()[0][:160]}") from None


def missing_package(optimizer: str, ft: FineTune | None) -> str | None:
    """The package a run of ``optimizer`` with ``ft`` needs and this environment lacks (None: nothing):
    ``peft`` for LoRA, ``bitsandbytes`` for the 8-bit AdamW."""
    import importlib.util

    wants = (["peft"] if ft is not None and ft.lora_rank is not None else []) + \
        (["bitsandbytes"] if optimizer == "adamw8bit" else [])
    return next((name for name in wants if importlib.util.find_spec(name) is None), None)
