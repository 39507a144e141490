"""The course's reference run: the figures the course measured on an RTX 5070 Ti with Qwen2.5-0.5B
(DESIGN.md's reference table), in one place.

A chapter may quote them as *the course's reference run (RTX 5070 Ti, Qwen2.5-0.5B)*, beside this book's
own runs, never as its own measurement: ``CourseReference.summary()`` and ``CourseReference.source`` say
so in their wording, and ``report.provenance_box`` shows the summary beside a cached GPU record of the same
experiment. ``REFERENCES`` holds them by experiment (``for_experiment``, ``for_strategy``); experiments the
reference run did not measure have no entry.
"""

from __future__ import annotations

from dataclasses import dataclass

PHRASE = "the course's reference run"  # what readers read: never "the seed's", which reads like a random seed


@dataclass(frozen=True)
class CourseReference:
    """One row of the course's reference table (one experiment of the reference run)."""

    semantic_id: str  # the experiment it is a reference for
    run_label: str  # the reference run's label
    compared: str  # what against what, in words
    peak_saving: float  # fraction by which the candidate lowered the peak (0.337 = 33.7 %)
    median_ratio: float  # candidate's median step / baseline's median step
    decision: str | None  # the reference run's decision (accept | tune | reject), None where it gives none
    strategy: str | None = None  # the book's strategy (bench.strategy name) it measured, None: not one strategy
    peak_is_upper_bound: bool = False  # the reference says "down up to" this much
    condition: str | None = None  # where the figures hold, e.g. "seq 256"
    note: str | None = None  # a further statement of the reference, e.g. about short sequences
    device: str = "RTX 5070 Ti"  # the reference run's GPU
    model: str = "Qwen2.5-0.5B"  # the reference run's model

    @property
    def source(self) -> str:
        """Where the figures come from, for a table's source column: "the course's reference run (RTX 5070 Ti,
        Qwen2.5-0.5B)"."""
        return f"{PHRASE} ({self.device}, {self.model})"

    def time_phrase(self) -> str:
        r = self.median_ratio
        if abs(r - 1) < 0.02:
            return "time about equal"
        if r >= 2:
            return f"median step {r:.3g}×"
        return f"median step {'up' if r > 1 else 'down'} about {abs(r - 1):.1%}"

    def summary(self) -> str:
        """One sentence, e.g. ``the course's reference run (RTX 5070 Ti, Qwen2.5-0.5B, run label
        b2s512_default2): gradient checkpointing vs plain saving: peak down about 33.7%, median step up about
        19.2%, decision accept``."""
        parts = [f"peak down {'up to ' if self.peak_is_upper_bound else ''}about {self.peak_saving:.1%}",
                 self.time_phrase()]
        if self.decision:
            parts.append(f"decision {self.decision}")
        head = f"{PHRASE} ({self.device}, {self.model}, run label {self.run_label}): {self.compared}"
        return (f"{head}{f' at {self.condition}' if self.condition else ''}: {', '.join(parts)}"
                + (f"; {self.note}" if self.note else ""))


REFERENCES: dict[str, CourseReference] = {r.semantic_id: r for r in [
    CourseReference("TRAIN-GRADIENT-ACCUMULATION", "seq 128 / 256", "micro-batch accumulation vs the full batch",
                    peak_saving=0.173, median_ratio=1.335, decision=None, peak_is_upper_bound=True,
                    condition="seq 256", note="short sequences: decision tune"),  # 2 and 4 micro-batches
    CourseReference("TRAIN-AMP-BACKWARD", "default14", "FP16 autocast vs FP32", peak_saving=0.107, median_ratio=1.0,
                    decision=None, strategy="fp16"),
    CourseReference("TRAIN-CHECKPOINT", "b2s512_default2", "gradient checkpointing vs plain saving",
                    peak_saving=0.337, median_ratio=1.192, decision="accept", strategy="checkpoint-all"),
    CourseReference("TRAIN-OFFLOAD", "b2s512_default1", "host offload vs GPU-resident", peak_saving=0.343,
                    median_ratio=5.87, decision="tune", strategy="offload"),
]}


def for_experiment(semantic_id: str) -> CourseReference | None:
    """The course's reference run's figures for an experiment, or None where it measured none."""
    return REFERENCES.get(semantic_id)


def for_strategy(name: str) -> CourseReference | None:
    """The course's reference figures that measured the strategy ``name``, or None."""
    return next((r for r in REFERENCES.values() if r.strategy == name), None)
