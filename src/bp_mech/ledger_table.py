"""Part 02 · 43 — the ledger table: lifecycle stages, object classes, and ``Ledger``.

A ledger splits the memory of one training step by **lifecycle stage** (``STAGES``) and by
**object class** (``CLASSES``). ``bp_mech.ledger`` fills it from theory (``theoretical``);
``bp_mech.planner.lifecycle`` fills it from a real or a
fake-tensor step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STAGES", "CLASSES", "STAGE_LABELS", "CLASS_LABELS", "Counts", "Ledger"]

STAGES = ("load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")
STAGE_LABELS = dict(load="after model load", forward="after forward", backward_peak="peak in backward",
                    backward="after backward", optimizer_peak="in the optimizer step", zero_grad="after zero_grad")
CLASS_LABELS = dict(parameters="parameters", gradients="gradients", optimizer_states="optimizer states",
                    saved_activations="saved activations", logits_loss="logits & loss", other="other temporaries")


@dataclass(frozen=True)
class Counts:
    """What a measured step did, counted: sublayer forwards (recomputes included) and offload copies.

    Args:
        recomputes: attention and MLP forwards beyond one per micro-batch.
        attn_calls: attention forwards over all layers.
        mlp_calls: MLP forwards over all layers.
        d2h_bytes: bytes the offload copied to the host.
        h2d_bytes: bytes it copied back.

    Example:
        >>> c = Counts(recomputes=4, attn_calls=4, mlp_calls=4, d2h_bytes=0, h2d_bytes=0)  # 2 layers, each run twice
        >>> c.attn_calls + c.mlp_calls - c.recomputes  # sublayer forwards without the recomputes
        4
    """

    recomputes: int  # attention and MLP forwards beyond one per micro-batch
    attn_calls: int  # attention forwards over all layers
    mlp_calls: int  # MLP forwards over all layers
    d2h_bytes: int  # bytes the offload copied to the host
    h2d_bytes: int  # bytes it copied back


@dataclass
class Ledger:
    """Device bytes per stage and class (+ host bytes of offloaded activations).

    Args:
        source: formula | fake-tensor | tracked-cpu | cuda-allocator.
        strategy: the strategy's name (``bench.strategy``), e.g. "plain" or "checkpoint-all".
        stages: stage (``STAGES``) -> class (``CLASSES``) -> bytes.
        host: stage -> host bytes in use (the offload pool's).
        forward_peak: peak inside the forward (not a ledger stage, counts for the peak).
        allocator: CUDA only: stage -> allocator bytes.
        rounded: stage -> bytes in 512-byte allocator blocks.
        finite: the step's loss was finite (None: fake tensors have no values).
        moment: formula only: which candidate moment is the backward peak.
        updates: optimizer steps run, warm-up included (0: formula).
        skipped: amp: of those, the ones the GradScaler skipped (inf/NaN).
        counts: measured: sublayer forwards and recomputes, offload copies (None: formula).

    Example:
        >>> stages = {s: {c: 0 for c in CLASSES} for s in STAGES}
        >>> stages["forward"]["saved_activations"] = 100
        >>> led = Ledger("formula", "plain", stages, forward_peak=150)
        >>> led.total("forward"), led.peak, led.peak_stage
        (100, 150, 'forward_peak')
    """

    source: str  # formula | fake-tensor | tracked-cpu | cuda-allocator
    strategy: str
    stages: dict[str, dict[str, int]]  # stage -> class -> bytes
    host: dict[str, int] = field(default_factory=dict)  # stage -> host bytes in use (the offload pool's)
    forward_peak: int = 0  # peak inside the forward (not a ledger stage, counts for the peak)
    allocator: dict[str, int] = field(default_factory=dict)  # CUDA only: stage -> allocator bytes
    rounded: dict[str, int] = field(default_factory=dict)  # stage -> bytes in 512-byte allocator blocks
    finite: bool | None = None  # the step's loss was finite (None: fake tensors have no values)
    moment: str | None = None  # formula only: which candidate moment is the backward peak
    updates: int = 0  # optimizer steps run, warm-up included (0: formula)
    skipped: int | None = None  # amp: of those, the ones the GradScaler skipped (inf/NaN)
    counts: Counts | None = None  # measured: sublayer forwards and recomputes, offload copies (None: formula)

    def total(self, stage: str) -> int:
        """Device bytes of one stage, all classes together.

        Args:
            stage: one of ``STAGES``.

        Returns:
            The sum of ``stages[stage]``, in bytes.

        Example:
            >>> led = Ledger("formula", "plain", {"load": {"parameters": 64, "other": 8}})
            >>> led.total("load")
            72
        """
        return sum(self.stages[stage].values())

    def totals(self) -> dict[str, int]:
        """Device bytes per stage.

        Returns:
            Stage -> ``total(stage)``, for every stage of ``STAGES``, in that order.

        Example:
            >>> led = Ledger("formula", "plain", {s: {"parameters": 64} for s in STAGES})
            >>> list(led.totals().values()) == [64] * len(STAGES)
            True
        """
        return {s: self.total(s) for s in STAGES}

    @property
    def peak(self) -> int:
        """The step's peak in bytes: the largest stage total, or ``forward_peak`` if larger."""
        return max(self.forward_peak, *self.totals().values())

    @property
    def peak_stage(self) -> str:
        """The stage holding the peak ("forward_peak" if it lies inside the forward)."""
        best = max(STAGES, key=self.total)
        return "forward_peak" if self.forward_peak > self.total(best) else best
