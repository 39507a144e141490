"""Composable memory strategies: one training step under any combination of the book's mechanisms.

Each mechanism is one context manager in its own module, with an off switch that returns
``contextlib.nullcontext``:

==============  =====================================================  =============================
field           mechanism (module)                                     entered
==============  =====================================================  =============================
checkpoint      ``checkpointing.configure`` (Part 02 · 19)             around the whole step
chunked_loss    ``chunked_loss.chunked``                               around the whole step
micro_batches   ``accumulation.token_weighted`` (Part 02 · 11)         around the step's micro-batches
offload         ``offload.ActivationOffload`` (Part 02 · 42)           around each forward
amp             ``amp.autocast`` (+ a GradScaler for float16)          around each forward
==============  =====================================================  =============================

``Strategy`` names one combination (``Strategy().name == "plain"``,
``parse("checkpoint-all+offload+fp16+chunked-loss")``); ``applied(model, strategy, device)`` enters
the step-level switches and gives an ``Applied`` whose ``forward()`` enters the per-forward ones;
``train_step`` is one full update (zero_grad, forward, backward, optimizer step) under it. Part 02 ·
43's ledger (``ledger_measure.track``), ``bp-mech plan`` and the projects 74 and 76 all step through
``train_step``, so a strategy's name means one program everywhere.

Numerics against the plain step (CPU, float32): checkpointing and offload change no operation, so
loss and gradients are bitwise equal; accumulation and the chunked loss reorder float32 sums
(relative differences ~1e-6); fp16 / bf16 autocast round the matmuls (loose).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from bp_mech import accumulation, amp, checkpointing, chunked_loss, offload

AMP_NAMES = {"float16": "fp16", "bfloat16": "bf16"}  # Strategy.amp -> its word in a name
_AMP_DTYPES = {v: k for k, v in AMP_NAMES.items()}


@dataclass(frozen=True)
class Strategy:
    checkpoint: str = "plain"  # checkpointing.CONFIGURATIONS: plain | checkpoint-all | checkpoint-every2 | checkpoint-mlp
    offload: bool = False  # chapter 42's ActivationOffload around the forward
    amp: str | None = None  # None | "float16" | "bfloat16" (autocast; fp16 with a GradScaler)
    micro_batches: int = 1  # accumulation: k token-weighted micro-batches per update
    chunked_loss: int | None = None  # None: full fp32 logits; n: the loss over the vocabulary in chunks of n tokens

    def __post_init__(self):
        if self.checkpoint not in checkpointing.CONFIGURATIONS:
            raise ValueError(f"unknown checkpointing {self.checkpoint!r}; one of {checkpointing.CONFIGURATIONS}")
        if self.amp not in (None, *AMP_NAMES):
            raise ValueError(f"unknown amp dtype {self.amp!r}; one of None, {', '.join(AMP_NAMES)}")
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
        parts += [AMP_NAMES[self.amp]] if self.amp else []
        parts += [f"micro{self.micro_batches}"] if self.micro_batches > 1 else []
        if self.chunked_loss is not None:
            default = self.chunked_loss == chunked_loss.DEFAULT_CHUNK
            parts.append("chunked-loss" if default else f"chunked-loss-{self.chunked_loss}")
        return "+".join(parts) or "plain"

    @property
    def low(self) -> torch.dtype | None:
        """The autocast dtype (None: float32 throughout)."""
        return getattr(torch, self.amp) if self.amp else None

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
        elif part in _AMP_DTYPES:
            put("amp", _AMP_DTYPES[part], part)
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


class Applied:
    """A strategy entered on a model (what ``with applied(...)`` gives): the per-forward switches, the
    micro-batches, the GradScaler of fp16 and the transfer counters of the last step."""

    def __init__(self, model, strategy: Strategy, device, offload_cfg: offload.OffloadConfig | None = None):
        self.model, self.strategy, self.device = model, strategy, torch.device(device)
        cfg = offload_cfg or offload.OffloadConfig(min_bytes=offload.min_bytes(self.device))
        # one ActivationOffload for every forward of the block: its host pool is reused across steps
        self.offload = offload.ActivationOffload(model.parameters(), cfg, self.device) if strategy.offload else None
        # fp16 only (bf16 has float32's exponent range); disabled, it passes every call through
        fp16 = strategy.amp == "float16"
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else torch.amp.GradScaler(self.device.type,
                                                                                               enabled=False)
        self.d2h_bytes = self.h2d_bytes = 0  # bytes the offload copied in the last step (all micro-batches)

    def forward(self):
        """The switches around one forward: offload's saved-tensor hooks, then autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.offload if self.offload is not None else contextlib.nullcontext())
        stack.enter_context(amp.autocast(self.device.type, self.strategy.low))
        return stack

    def micro_batches(self, batch: dict):
        """``accumulation.token_weighted(batch, k)``: the step's micro-batches (the batch itself when k = 1)."""
        return accumulation.token_weighted(batch, self.strategy.micro_batches)

    def host_bytes(self) -> int:
        """Host bytes holding offloaded activations now (0 without offload)."""
        return self.offload.pool.in_use if self.offload is not None else 0


@contextlib.contextmanager
def applied(model, strategy: Strategy, device="cpu", offload_cfg: offload.OffloadConfig | None = None):
    """Enter ``strategy`` on ``model``: checkpointing and the chunked loss for the whole block (undone
    after it), and an ``Applied`` for the per-forward switches. ``offload_cfg``: the offload's settings
    (default: ``offload.min_bytes(device)`` as threshold)."""
    with checkpointing.configure(model, strategy.checkpoint), chunked_loss.chunked(model, strategy.chunked_loss):
        yield Applied(model, strategy, device, offload_cfg)


def _no_events(name: str, *args) -> None:
    return None


def train_step(model, opt, batch: dict, strategy: Strategy, scaler=None, *, ctx: Applied | None = None,
               events=_no_events) -> torch.Tensor:
    """One update under ``strategy``: zero_grad, then per micro-batch a forward (under ``ctx.forward()``)
    and a backward (scaled under fp16), then the optimizer step (through the scaler under fp16).

    ``ctx``: an ``Applied`` already entered on ``model`` (reuse it across steps: the offload's host pool,
    the scaler's state); None enters ``applied(model, strategy, device)`` for this one step. ``scaler``:
    a GradScaler to use instead of ``ctx.scaler``. ``events(name, *args)`` is called at the lifecycle
    points (``forward``, ``forward_end`` with the loss, ``backward``, ``backward_end``, ``optimizer``,
    ``optimizer_end``): the ledger marks its stages there. Returns the update's loss (detached; with
    micro-batches the sum of their token-weighted shares, i.e. the batch's mean token loss).
    """
    if ctx is None:
        device = next(model.parameters()).device
        with applied(model, strategy, device) as entered:
            return train_step(model, opt, batch, strategy, scaler, ctx=entered, events=events)
    if ctx.strategy != strategy or ctx.model is not model:
        raise ValueError(f"ctx is {ctx.strategy.name!r} on another model; train_step was asked for {strategy.name!r}")
    scaler = scaler if scaler is not None else ctx.scaler
    k, rows = strategy.micro_batches, batch["input_ids"].shape[0]
    if rows % k:
        raise ValueError(f"accumulation needs micro_batches ({k}) to divide the batch ({rows})")
    opt.zero_grad(set_to_none=True)
    ctx.d2h_bytes = ctx.h2d_bytes = 0
    losses = []
    with ctx.micro_batches(batch) as micro:
        for mb in micro:
            events("forward")
            with ctx.forward():
                loss = model(**mb).loss  # logits (when they exist) are dropped here
            events("forward_end", loss)
            events("backward")
            scaler.scale(loss).backward()
            if ctx.offload is not None:  # the hooks' counters cover the last forward and its backward
                ctx.d2h_bytes += ctx.offload.d2h_bytes
                ctx.h2d_bytes += ctx.offload.h2d_bytes
            events("backward_end")
            losses.append(loss.detach())
    events("optimizer")
    scaler.step(opt)  # (disabled: opt.step())
    scaler.update()
    events("optimizer_end")
    return torch.stack(losses).sum() if len(losses) > 1 else losses[0]
