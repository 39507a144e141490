"""The course seed's reference figures (DESIGN.md's reference table), in one place.

The seed measured these on an RTX 5070 Ti with Qwen2.5-0.5B. A chapter may quote them *as the
course's reference*, beside this book's own runs, never as its own measurement: ``SeedReference.
summary()`` says so in its wording, and ``report.provenance_box`` shows it beside a cached GPU
record of the same experiment. Pages without a seed figure have no entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedReference:
    """One row of the seed's reference table."""

    semantic_id: str  # the experiment it is a reference for
    run_label: str  # the seed's run label
    compared: str  # what against what, in words
    peak_saving: float  # fraction by which the candidate lowered the peak (0.337 = 33.7 %)
    median_ratio: float  # candidate's median step / baseline's median step
    decision: str | None  # the seed's decision (accept | tune | reject), None where it gives none
    strategy: str | None = None  # the book's strategy (bench.strategy name) it measured, None: not one strategy
    peak_is_upper_bound: bool = False  # the seed says "down up to" this much
    condition: str | None = None  # where the figures hold, e.g. "seq 256"
    note: str | None = None  # a further statement of the seed, e.g. about short sequences
    device: str = "RTX 5070 Ti"  # the seed's GPU
    model: str = "Qwen2.5-0.5B"  # the seed's model

    def time_phrase(self) -> str:
        r = self.median_ratio
        if abs(r - 1) < 0.02:
            return "time about equal"
        if r >= 2:
            return f"median step {r:.3g}×"
        return f"median step {'up' if r > 1 else 'down'} about {abs(r - 1):.1%}"

    def summary(self) -> str:
        """One sentence, e.g. ``the seed's reference (RTX 5070 Ti, Qwen2.5-0.5B, run label b2s512_default2):
        checkpointing every layer vs plain: allocated peak down about 33.7 %, median step up about 19.2 %,
        decision accept``."""
        parts = [f"peak down {'up to ' if self.peak_is_upper_bound else ''}about {self.peak_saving:.1%}",
                 self.time_phrase()]
        if self.decision:
            parts.append(f"decision {self.decision}")
        head = f"the seed's reference ({self.device}, {self.model}, run label {self.run_label}): {self.compared}"
        return (f"{head}{f' at {self.condition}' if self.condition else ''}: {', '.join(parts)}"
                + (f"; {self.note}" if self.note else ""))


SEED: dict[str, SeedReference] = {r.semantic_id: r for r in [
    SeedReference("TRAIN-GRADIENT-ACCUMULATION", "seq 128 / 256", "micro-batch accumulation vs the full batch",
                  peak_saving=0.173, median_ratio=1.335, decision=None, peak_is_upper_bound=True,
                  condition="seq 256", note="short sequences: decision tune"),  # 2 and 4 micro-batches
    SeedReference("TRAIN-AMP-BACKWARD", "default14", "FP16 autocast vs FP32", peak_saving=0.107, median_ratio=1.0,
                  decision=None, strategy="fp16"),
    SeedReference("TRAIN-CHECKPOINT", "b2s512_default2", "gradient checkpointing vs plain saving",
                  peak_saving=0.337, median_ratio=1.192, decision="accept", strategy="checkpoint-all"),
    SeedReference("TRAIN-OFFLOAD", "b2s512_default1", "host offload vs GPU-resident", peak_saving=0.343,
                  median_ratio=5.87, decision="tune", strategy="offload"),
]}


def seed_reference(semantic_id: str) -> SeedReference | None:
    """The seed's reference for an experiment, or None where the seed gives none."""
    return SEED.get(semantic_id)


def for_strategy(name: str) -> SeedReference | None:
    """The seed's reference that measured the strategy ``name``, or None."""
    return next((r for r in SEED.values() if r.strategy == name), None)
