"""Composable memory strategies: one training step under any combination of the book's mechanisms.

Each mechanism is one context manager in its own module, with an off switch that returns
``contextlib.nullcontext``:

==============  =====================================================  =============================
field           mechanism (module)                                     entered
==============  =====================================================  =============================
checkpoint      ``checkpointing.configure`` (Part 02 · 19)             around the whole step
chunked_loss    ``chunked_head.chunked``                               around the whole step
micro_batches   ``accumulation.token_weighted`` (Part 02 · 11)         around the step's micro-batches
offload         ``offload.ActivationOffload`` (Part 02 · 42)           around each forward
amp             ``amp.autocast`` (+ a GradScaler for float16)          around each forward
==============  =====================================================  =============================

``Strategy`` names one combination (``Strategy().name == "plain"``,
``parse("checkpoint-all+offload+fp16+chunked-loss")``); ``enter(model, strategy, device)`` enters
the step-level switches and gives an ``Entered`` whose ``forward()`` enters the per-forward ones.
The one training step, ``bp_mech.bench.step.train_step``, runs under it: every experiment, Part 02 ·
43's ledger, ``bp-mech plan`` and the projects step through it, so a strategy's name means one
program everywhere, and these names are the only names of the strategies (records store them).

Numerics against the plain step (CPU, float32): checkpointing and offload change no operation, so
loss and gradients are bitwise equal; accumulation and the chunked loss reorder float32 sums
(relative differences ~1e-6); fp16 / bf16 autocast round the matmuls (loose).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from dataclasses import dataclass

import torch

from bp_mech import accumulation, amp, checkpointing, chunked_head, chunked_loss, offload
from bp_mech.instruments.tracking import host_side


class LowPrecision(enum.StrEnum):
    """The 16-bit float formats autocast runs in: the one vocabulary of a strategy's ``amp``, its word in a
    strategy name, its torch dtype, the label a record's ``dtype`` shows, and ``bp-mech plan --dtype``.

    A member is named by its word (``FP16`` spells ``fp16``) and valued by torch's dtype name, so it equals
    that string (``LowPrecision.FP16 == "float16"``) and a record stores the string.

    Example:
        >>> p = LowPrecision("bfloat16")
        >>> p.word, p.dtype, p.label, LowPrecision.of_word("fp16") is LowPrecision.FP16
        ('bf16', torch.bfloat16, 'bfloat16-autocast', True)
    """

    FP16 = "float16"  # IEEE half: 5 exponent bits, needs a GradScaler
    BF16 = "bfloat16"  # bfloat16: float32's exponent range, 8-bit significand

    @property
    def word(self) -> str:
        """Its word in a strategy name (``fp16``, ``bf16``)."""
        return self.name.lower()

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype autocast computes in."""
        return getattr(torch, self.value)

    @property
    def label(self) -> str:
        """What a record's ``dtype`` says of a run under it (``float16-autocast``)."""
        return f"{self.value}-autocast"

    @classmethod
    def of_word(cls, word: str) -> "LowPrecision":
        """The member a strategy name's word spells.

        Args:
            word: ``fp16`` or ``bf16``.

        Returns:
            The member.

        Raises:
            ValueError: for any other word.

        Example:
            >>> LowPrecision.of_word("bf16").value
            'bfloat16'
        """
        try:
            return cls[word.upper()]
        except KeyError:
            raise ValueError(f"unknown precision {word!r}; one of {', '.join(p.word for p in cls)}") from None

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """Every member's word, in order (``("fp16", "bf16")``)."""
        return tuple(p.word for p in cls)


FLOAT32 = "float32"  # a record's ``dtype`` for a strategy without autocast


@dataclass(frozen=True)
class Strategy:
    checkpoint: str = "plain"  # checkpointing.CONFIGURATIONS: plain | checkpoint-all | checkpoint-every2 | checkpoint-mlp
    offload: bool = False  # chapter 42's ActivationOffload around the forward
    amp: LowPrecision | None = None  # None | "float16" | "bfloat16" (autocast; fp16 with a GradScaler)
    micro_batches: int = 1  # accumulation: k token-weighted micro-batches per update
    chunked_loss: int | None = None  # None: full fp32 logits; n: the loss over the vocabulary in chunks of n tokens

    def __post_init__(self):
        if self.checkpoint not in checkpointing.CONFIGURATIONS:
            raise ValueError(f"unknown checkpointing {self.checkpoint!r}; one of {checkpointing.CONFIGURATIONS}")
        if self.amp is not None:
            try:  # the string spellings a caller may pass ("float16") become the member
                object.__setattr__(self, "amp", LowPrecision(self.amp))
            except ValueError:
                raise ValueError(f"unknown amp dtype {self.amp!r}; one of None, "
                                 f"{', '.join(p.value for p in LowPrecision)}") from None
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.chunked_loss is not None and self.chunked_loss < 1:
            raise ValueError(f"chunked_loss must be None or a positive number of tokens, got {self.chunked_loss}")

    @property
    def name(self) -> str:
        """"plain", or the switched-on parts joined by "+" in a fixed order, e.g.
        "checkpoint-all+offload+fp16+micro2+chunked-loss" (``parse`` reads it back)."""
        parts = [self.checkpoint] if self.checkpoint != "plain" else []
        parts += ["offload"] if self.offload else []
        parts += [self.amp.word] if self.amp else []
        parts += [f"micro{self.micro_batches}"] if self.micro_batches > 1 else []
        if self.chunked_loss is not None:
            default = self.chunked_loss == chunked_loss.DEFAULT_CHUNK
            parts.append("chunked-loss" if default else f"chunked-loss-{self.chunked_loss}")
        return "+".join(parts) or "plain"

    @property
    def low(self) -> torch.dtype | None:
        """The autocast dtype (None: float32 throughout)."""
        return self.amp.dtype if self.amp else None

    @property
    def dtype_label(self) -> str:
        """What a record's ``dtype`` says of the strategy's steps: ``float32``, or ``float16-autocast`` /
        ``bfloat16-autocast`` (``LowPrecision.label``)."""
        return self.amp.label if self.amp else FLOAT32

    def fields(self) -> dict:
        """The strategy's fields as a dict (JSON-able: what a record's metrics keep)."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Strategy":
        return dataclasses.replace(self, **changes)


def parse(name: str) -> Strategy:
    """``"checkpoint-all+fp16+chunked-loss"`` -> Strategy; parts in any order; ``"plain"`` is all off.
    Parts: a checkpointing configuration, ``offload``, ``fp16`` | ``bf16``, ``micro<k>``,
    ``chunked-loss`` (``chunked_loss.DEFAULT_CHUNK`` tokens) | ``chunked-loss-<n>``. Raises ValueError."""
    fields: dict = {}

    def put(key, value, part):
        if key in fields:
            raise ValueError(f"strategy {name!r} sets {key} twice (at {part!r})")
        fields[key] = value

    for part in name.strip().split("+"):
        if part == "plain" and name.strip() == "plain":
            continue
        if part in checkpointing.CONFIGURATIONS[1:]:
            put("checkpoint", part, part)
        elif part == "offload":
            put("offload", True, part)
        elif part in LowPrecision.words():
            put("amp", LowPrecision.of_word(part), part)
        elif part.startswith("micro") and part[5:].isdigit() and int(part[5:]) > 1:
            put("micro_batches", int(part[5:]), part)
        elif part == "chunked-loss":
            put("chunked_loss", chunked_loss.DEFAULT_CHUNK, part)
        elif part.startswith("chunked-loss-") and part[13:].isdigit():
            put("chunked_loss", int(part[13:]), part)
        else:
            raise ValueError(f"unknown strategy part {part!r} in {name!r}; parts: "
                             f"{', '.join(checkpointing.CONFIGURATIONS[1:])}, offload, fp16, bf16, micro<k>, "
                             "chunked-loss[-<tokens>] joined by '+', or 'plain'")
    return Strategy(**fields)


def unsupported(model, s: Strategy) -> str | None:
    """Why strategy ``s`` does not apply to ``model`` (its checkpointing or its chunked loss cannot be
    applied: ``checkpointing.unsupported``, ``chunked_head.unsupported``), or None when it does."""
    why = checkpointing.unsupported(model, s.checkpoint) if s.checkpoint != "plain" else None
    return why or (chunked_head.unsupported(model) if s.chunked_loss is not None else None)


PLAIN = Strategy()
# One mechanism each (fp16 stands for 16-bit autocast: bf16 holds the same bytes; parse("bf16") has it).
SINGLES = tuple(parse(n) for n in ("checkpoint-all", "checkpoint-every2", "checkpoint-mlp", "offload", "fp16",
                                   "micro2", "chunked-loss"))
# The combinations worth planning: each pairs mechanisms that remove different lines of the ledger
# (layer activations, the fp32 logits, half-precision saved tensors, the per-micro-batch share).
COMBINATIONS = tuple(parse(n) for n in (
    "checkpoint-all+fp16", "checkpoint-all+chunked-loss", "fp16+chunked-loss", "checkpoint-all+fp16+chunked-loss",
    "checkpoint-mlp+fp16+chunked-loss", "checkpoint-all+offload", "offload+fp16+chunked-loss",
    "checkpoint-all+micro2+fp16+chunked-loss", "checkpoint-all+offload+fp16+chunked-loss"))
CANDIDATES = (PLAIN, *SINGLES, *COMBINATIONS)  # what ``bp-mech plan`` traces, plain first


class Entered:
    """A strategy entered on a model (what ``with enter(...)`` gives): the per-forward
    switches, the micro-batches, the GradScaler of fp16 and the transfer counters of the
    last step."""

    def __init__(self, model, strategy: Strategy, device,
                 offload_cfg: offload.OffloadConfig | None = None,
                 scaler: torch.amp.GradScaler | None = None, hooks=None):
        self.model, self.strategy = model, strategy
        self.device = torch.device(device)
        if hooks is not None and not strategy.offload:
            raise ValueError("saved-tensor hooks replace an offload, and "
                             f"{strategy.name!r} has none")
        cfg = offload_cfg
        if not cfg:
            cfg = offload.OffloadConfig(min_bytes=offload.min_bytes(self.device))
        # one ActivationOffload for every forward of the block: its host pool is reused
        # across steps
        if hooks is not None:
            self.offload = hooks
        elif strategy.offload:
            # its host copies are booked as host memory by any tracker watching
            self.offload = offload.ActivationOffload(
                model.parameters(), cfg, self.device, host_region=host_side)
        else:
            self.offload = None
        # fp16 only (bf16 has float32's exponent range); disabled, it passes every call
        # through
        fp16 = strategy.amp == "float16"
        if scaler is not None and scaler.is_enabled() and not fp16:
            raise ValueError(f"an enabled GradScaler for {strategy.name!r}: only fp16 "
                             "scales its loss")
        # (a disabled one under fp16 is allowed: a fake-tensor step cannot read the
        # values a scaler checks)
        if scaler is None:
            scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)
        self.scaler = scaler
        # bytes the offload copied in the last step (all micro-batches)
        self.d2h_bytes = self.h2d_bytes = 0

    def forward(self):
        """The switches around one forward: offload's saved-tensor hooks, then
        autocast."""
        stack = contextlib.ExitStack()
        hooks = self.offload if self.offload is not None else contextlib.nullcontext()
        stack.enter_context(hooks)
        stack.enter_context(amp.autocast(self.device.type, self.strategy.low))
        return stack

    def micro_batches(self, batch: dict):
        """``accumulation.token_weighted(batch, k)``: the step's micro-batches (the
        batch itself when k = 1)."""
        return accumulation.token_weighted(batch, self.strategy.micro_batches)

    def count_transfers(self) -> None:
        """Add what the offload's hooks copied in the last forward and its backward to
        this step's counts."""
        if self.offload is not None:
            self.d2h_bytes += self.offload.d2h_bytes
            self.h2d_bytes += self.offload.h2d_bytes

    def host_bytes(self) -> int:
        """Host bytes holding offloaded activations now (0 without offload, or with
        hooks that keep no pool)."""
        pool = getattr(self.offload, "pool", None)
        return pool.in_use if pool is not None else 0


@contextlib.contextmanager
def enter(model, strategy: Strategy, device="cpu",
            offload_cfg: offload.OffloadConfig | None = None,
            scaler: torch.amp.GradScaler | None = None, hooks=None):
    """Enter ``strategy`` on ``model``: checkpointing and the chunked loss for the whole
    block (undone after it), and an ``Entered`` for the per-forward switches.
    ``offload_cfg``: the offload's settings (default: ``offload.min_bytes(device)`` as
    threshold); ``scaler``: fp16's GradScaler (default: torch's defaults); ``hooks``:
    saved-tensor hooks that stand in for the offload (e.g. PyTorch's ``save_on_cpu``,
    which Part 02 · 42 compares with the book's offload)."""
    with configured(model, strategy):
        yield Entered(model, strategy, device, offload_cfg, scaler, hooks)


@contextlib.contextmanager
def configured(model, strategy: Strategy):
    """The step-level switches of ``strategy`` on ``model`` (checkpointing, the chunked loss), undone after
    the block: what a model shared by several strategies enters around each of its steps."""
    with checkpointing.configure(model, strategy.checkpoint), chunked_head.chunked(model, strategy.chunked_loss):
        yield
