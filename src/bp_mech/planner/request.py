"""What ``bp-mech plan`` is asked: the command line parsed into one typed, validated ``PlanRequest``.

The command line (``bp_mech.cli``) turns its flags into a ``PlanRequest`` (``PlanRequest.from_flags``: the
flags' text, read and checked); everything below it (``planner.report.run``) takes the request, never the
parser's namespace. Bad input is a ``PlanError`` (one line, exit 2), raised when the request is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bp_mech.bench.optimizer import OPTIMIZERS, StepOptions
from bp_mech.bench.strategy import CANDIDATES, FLOAT32, PLAIN, LowPrecision, Strategy
from bp_mech.instruments.adamw import torch_default_adamw
from bp_mech.planner.finetune import FineTune, FineTuneError
from bp_mech.planner.inputs import PlanError, parse_size

Shape = int | Literal["max"] | None  # --batch / --seq: a number, "max" (the largest that fits), or not given
NAMES = tuple(s.name for s in CANDIDATES)  # --strategies: the plan's candidates (bench.strategy.CANDIDATES)
DTYPES = (FLOAT32, *LowPrecision.words())  # --dtype: float32, or a strategy name's word for a 16-bit format
SHARDS = ("fsdp2", "ddp")  # --shard: planner.shard's ways of spreading the step over --gpus devices


def shape_arg(text: str | None, flag: str) -> Shape:
    """``--batch`` / ``--seq``: a positive number, ``max``, or None (not given).

    Args:
        text: the flag's text (None: not given).
        flag: its name, for the error.

    Returns:
        The number, ``"max"`` or None.

    Raises:
        PlanError: for anything else.

    Example:
        >>> shape_arg("8", "--batch"), shape_arg("MAX", "--seq"), shape_arg(None, "--seq")
        (8, 'max', None)
    """
    if text is None or str(text).strip().lower() == "max":
        return text and "max"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:  # (0 would read as not given: the workload's own size, planned without a word)
        raise PlanError(f"{flag} takes a positive number or max, got {text!r}")
    return n


@dataclass(frozen=True)
class PlanRequest:
    """One ``bp-mech plan`` command, checked: what to plan, at which size, for which budget, trained how.

    Example:
        >>> r = PlanRequest.from_flags(workload="tiny-b2s32", budget="1GiB", dtype="bf16", seq="max")
        >>> r.budget, r.weights, r.seq, r.options.adamw, r.finetune
        (1073741824, <LowPrecision.BF16: 'bfloat16'>, 'max', 'foreach', None)
        >>> PlanRequest(budget=2**30)
        Traceback (most recent call last):
        ...
        bp_mech.planner.inputs.PlanError: plan needs exactly one of --config PATH/config.json and --workload ID
    """

    budget: int  # --budget: device memory, bytes
    config: str | None = None  # --config: a config.json, or the directory that holds one
    workload: str | None = None  # --workload: a workload ID instead (its model; its batch and seq unless given)
    batch: Shape = None  # --batch: sequences per step (per device with --gpus), "max", or the workload's
    seq: Shape = None  # --seq: tokens per sequence, "max", or the workload's
    device_name: str | None = None  # --device-name: use cached GPU records of this device only
    json: bool = False  # --json: print the plan as JSON
    workers: int | None = None  # --workers: processes tracing the strategies (None: planner.pool.default_workers)
    keep_outputs: bool = False  # --keep-outputs: plan the loop whose outputs stay alive through backward
    weights: LowPrecision | None = None  # --dtype: half-precision weights without a master copy; None: float32
    optimizer: str = "adamw"  # --optimizer: bench.optimizer.OPTIMIZERS
    optimizer_impl: str = "default"  # --optimizer-impl: default (PyTorch's pick on CUDA) or one of the kind's
    freeze: str | None = None  # --freeze: a regular expression on the parameter names
    lora_rank: int | None = None  # --lora-rank: LoRA adapters of this rank through peft
    lora_targets: tuple[str, ...] | None = None  # --lora-targets: the modules LoRA adapts (None: peft's)
    gpus: int = 1  # --gpus: devices the step is spread over
    shard: str | None = None  # --shard: fsdp2 or ddp, with --gpus N > 1
    strategies: tuple[str, ...] | None = None  # --strategies: the candidates to plan (plain always); None: all
    full_depth: bool = False  # --full-depth: trace every block of every step (no extrapolation in depth)

    def __post_init__(self):
        if bool(self.config) == bool(self.workload):
            raise PlanError("plan needs exactly one of --config PATH/config.json and --workload ID")
        if self.batch == self.seq == "max":
            raise PlanError("--batch max and --seq max together: give one of them a number")
        if self.config and (self.batch is None or self.seq is None):
            raise PlanError("plan --config needs --batch and --seq")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; one of {', '.join(OPTIMIZERS)}")
        if self.optimizer == "adamw8bit" and self.optimizer_impl != "default":
            raise PlanError("--optimizer adamw8bit has one implementation (bitsandbytes' kernels): "
                            "drop --optimizer-impl")
        if OPTIMIZERS[self.optimizer] and self.impl not in OPTIMIZERS[self.optimizer]:
            raise PlanError(f"--optimizer {self.optimizer} has no {self.impl} implementation; it has "
                            f"{', '.join(OPTIMIZERS[self.optimizer])}")
        if self.gpus < 1:
            raise PlanError(f"--gpus must be >= 1, got {self.gpus}")
        if self.shard not in (None, *SHARDS):
            raise PlanError(f"unknown --shard {self.shard!r}; one of {', '.join(SHARDS)}")
        if (self.gpus > 1) != (self.shard is not None):
            raise PlanError("--gpus N (N > 1) and --shard fsdp2|ddp go together")
        if self.workers is not None and self.workers < 1:
            raise PlanError(f"--workers must be >= 1, got {self.workers}")
        if self.strategies == ():  # (--strategies '': not every candidate, 17 times the work asked for)
            raise PlanError(f"--strategies names no candidate; name one or more of {', '.join(NAMES)}, "
                            "or leave it out for every one")
        if unknown := [n for n in self.strategies or () if n not in NAMES]:
            raise PlanError(f"unknown --strategies {', '.join(map(repr, unknown))}; valid: {', '.join(NAMES)}")
        self.finetune  # noqa: B018 (a --freeze or LoRA setting that cannot be: PlanError now)

    @classmethod
    def from_flags(cls, budget: str, batch: str | None = None, seq: str | None = None, dtype: str | None = None,
                   lora_targets: str | None = None, strategies: str | None = None, **fields) -> "PlanRequest":
        """The request from the command line's flags, as text where the flag is text.

        Args:
            budget: ``--budget``, e.g. ``8GiB`` (``planner.inputs.parse_size``).
            batch: ``--batch``: a number or ``max`` (``shape_arg``).
            seq: ``--seq``: likewise.
            dtype: ``--dtype``: one of ``DTYPES`` (None: float32).
            lora_targets: ``--lora-targets``: module names joined by commas.
            strategies: ``--strategies``: candidate names joined by commas (None: every candidate).
            **fields: the other fields, already typed (``config``, ``workers``, ``json``, ...).

        Returns:
            The checked ``PlanRequest``.

        Raises:
            PlanError: bad input, in one line.

        Example:
            >>> PlanRequest.from_flags(budget="8GB", workload="qwen05-b2s512", lora_targets="q_proj, v_proj",
            ...                        lora_rank=8).lora_targets
            ('q_proj', 'v_proj')
        """
        if dtype not in (None, *DTYPES):
            raise PlanError(f"unknown --dtype {dtype!r}; one of {', '.join(DTYPES)}")
        weights = LowPrecision.of_word(dtype) if dtype not in (None, FLOAT32) else None
        targets = tuple(t.strip() for t in lora_targets.split(",")) if lora_targets is not None else None
        names = tuple(n.strip() for n in strategies.split(",") if n.strip()) if strategies is not None else None
        return cls(budget=parse_size(budget), batch=shape_arg(batch, "--batch"), seq=shape_arg(seq, "--seq"),
                   weights=weights, lora_targets=targets, strategies=names, **fields)

    @property
    def impl(self) -> str:
        """The optimizer's implementation: ``optimizer_impl``, PyTorch's pick on CUDA for ``default``."""
        return torch_default_adamw("cuda") if self.optimizer_impl == "default" else self.optimizer_impl

    @property
    def options(self) -> StepOptions:
        """The step's optimizer and its implementation, with CUDA's settings (what the plan traces)."""
        impl = self.impl if OPTIMIZERS[self.optimizer] else None
        return StepOptions(adamw=impl, optimizer=self.optimizer).for_device("cuda")

    @property
    def candidates(self) -> tuple[Strategy, ...]:
        """The strategies to plan: plain and those ``--strategies`` names, in ``CANDIDATES``' order (all of them
        when it names none)."""
        named = set(self.strategies or NAMES) | {PLAIN.name}
        return tuple(s for s in CANDIDATES if s.name in named)

    @property
    def finetune(self) -> FineTune | None:
        """The frozen parameters or LoRA asked for (None: full training); a bad setting raises ``PlanError``."""
        try:
            ft = FineTune(freeze=self.freeze, lora_rank=self.lora_rank, lora_targets=self.lora_targets)
        except FineTuneError as e:
            raise PlanError(str(e)) from None
        return ft if ft.name != "full" else None
