"""What "one training step" means when its peak is measured: the step's definition, and its ledger.

The book's ledger (Part 02 · 43) measures the *steady-state full step*: AdamW's moments exist when the
step starts, the step runs forward, backward, the fused AdamW update and ``zero_grad``, and the model's
outputs are dropped as soon as the loss is taken. A peak measured elsewhere may have been measured on
another step. ``StepDefinition`` names the choices a measurement makes, each an option of the one
training step (``bench.step.train_step``) as ``planner.lifecycle.Session`` runs it:

============================  ===================================================================
field                         the step it defines
============================  ===================================================================
``moments="resident"``        (a) the steady state: the moments exist when the step starts
``moments="first"``           (b) the first step: AdamW allocates its moments inside its update
``moments="none"``            (c) forward and backward only: no optimizer, no moments
``keep_outputs=True``         (d) the outputs (the logits) stay alive, as the loop variable of
                              ``out = model(**batch); out.loss.backward()`` keeps them: through
                              backward and the update, and into the next step's forward
``weights="float16"``         (e) the model and AdamW's state in half precision, no float32 master
``adamw="foreach"``           (g) PyTorch's default AdamW on CUDA (one temporary per tensor, all at
                              once, during the update) instead of the fused one the book uses
============================  ===================================================================

(f), the saving of the peak's *increment* above what is resident when the step starts, is a metric of
any of them: ``StepLedger.increment`` (the peak minus ``StepLedger.start``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bp_mech.instruments.adamw import ADAMW_IMPLS
from bp_mech.bench.strategy import LowPrecision
from bp_mech.ledger_table import Ledger

MOMENTS = ("resident", "first", "none")  # the steady state, the first step, forward + backward only
HALF_WEIGHTS = tuple(p.value for p in LowPrecision)  # half-precision weights, no float32 master copy
_MOMENT_NAMES = dict(resident="steady", first="first-step", none="forward-backward")


@dataclass(frozen=True)
class StepDefinition:
    """Which step a peak is the peak of (the default: the book's steady-state full step).

    Args:
        moments: "resident" (steady state), "first" (the update allocates the moments) or "none" (no
            optimizer: forward and backward only).
        keep_outputs: keep the model's outputs alive as a training loop's ``out`` variable does.
        weights: None (the workload's float32 weights) or "float16" / "bfloat16": model and AdamW state in
            that dtype, no float32 master copy.
        adamw: None (the session's ``StepOptions.adamw``), "fused", "foreach" or "for-loop".

    Example:
        >>> StepDefinition().name, StepDefinition("first", keep_outputs=True, adamw="foreach").name
        ('steady', 'first-step+outputs-kept+foreach-adamw')
        >>> StepDefinition(weights="bfloat16").replace(moments="none").name
        'forward-backward+bfloat16-weights'
    """

    moments: str = "resident"  # resident (a) | first (b) | none (c)
    keep_outputs: bool = False  # (d) the outputs live on as a loop's ``out`` variable
    weights: str | None = None  # (e) float16 | bfloat16: the model and AdamW in it; None: the workload's
    adamw: str | None = None  # (g) fused | foreach | for-loop; None: the session's options

    def __post_init__(self):
        if self.moments not in MOMENTS:
            raise ValueError(f"unknown moments {self.moments!r}; one of {', '.join(MOMENTS)}")
        if self.weights not in (None, *HALF_WEIGHTS):
            raise ValueError(f"unknown weights {self.weights!r}; None or one of {', '.join(HALF_WEIGHTS)}")
        if self.adamw not in (None, *ADAMW_IMPLS):
            raise ValueError(f"unknown AdamW implementation {self.adamw!r}; known: {', '.join(ADAMW_IMPLS)}")
        if self.moments == "none" and self.adamw is not None:
            raise ValueError("a step without an optimizer has no AdamW implementation")

    @property
    def name(self) -> str:
        """``steady``, ``first-step`` or ``forward-backward``, then what else is set, joined by "+"."""
        parts = [_MOMENT_NAMES[self.moments]] + (["outputs-kept"] if self.keep_outputs else [])
        parts += [f"{self.weights}-weights"] if self.weights else []
        return "+".join(parts + ([f"{self.adamw}-adamw"] if self.adamw else []))

    def replace(self, **changes) -> "StepDefinition":
        return dataclasses.replace(self, **changes)


STEADY = StepDefinition()  # (a): the book's definition


@dataclass(frozen=True)
class StepLedger:
    """The ledger of one step under a definition, with what was resident when it started.

    Args:
        ledger: the step's ``Ledger`` (bytes per stage and class, the peak).
        definition: the ``StepDefinition`` it was measured under.
        start: device bytes alive when the step started (parameters and buffers, the batch, and what the
            definition keeps resident: AdamW's moments, the last step's outputs).
        timeline: (phase, live device bytes) after each operator of the step (the storage tracker's
            ``timeline``): memory over one step.

    Example:
        >>> from bp_mech.ledger_table import CLASSES, STAGES
        >>> stages = {s: dict.fromkeys(CLASSES, 0) for s in STAGES}
        >>> stages["backward_peak"]["parameters"] = 300
        >>> led = StepLedger(Ledger("formula", "plain", stages), STEADY, start=100)
        >>> led.peak, led.increment
        (300, 200)
    """

    ledger: Ledger
    definition: StepDefinition
    start: int  # device bytes alive when the step started
    timeline: tuple = ()  # (phase, live device bytes) after each operator of the step

    @property
    def peak(self) -> int:
        """The step's peak (``Ledger.peak``), bytes."""
        return self.ledger.peak

    @property
    def increment(self) -> int:
        """(f): the peak above what was resident at the step's start, bytes."""
        return self.ledger.peak - self.start
