"""Which reading of a course reference holds: the definitions of "the step" that can hold together, one table
row per definition, and the verdict (``planner.reference_gap`` traces the rows).

Definitions that cannot hold together (``holds_together``) are never traced: two choices of the moments
((b) and (c)), two weight dtypes, or a step without an optimizer, (c), with anything about the optimizer's
state or implementation ((e): half-precision weights *and AdamW state*; (g): foreach AdamW).

The allocator's term of the tolerance (``ALLOCATOR_PP``) is derived in ``planner.reference_gap``'s docstring.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from bp_mech.planner.definitions import STEADY, StepDefinition

ALLOCATOR_PP = 1.0  # the allocator's term of every case's tolerance, percentage points (derived above)
_D = StepDefinition
SINGLE: dict[str, StepDefinition] = {  # label -> definition: (a) to (g) of ``planner.definitions``
    "a": STEADY, "b": _D("first"), "c": _D("none"), "d": _D(keep_outputs=True), "e": _D(weights="float16"),
    "e-bf16": _D(weights="bfloat16"), "g": _D(adamw="foreach"),
}
MOMENT_PARTS = ("b", "c")  # the moments: the first step, no optimizer (the default: resident)
WEIGHT_PARTS = ("e", "e-bf16")  # half-precision weights
OPTIMIZER_PARTS = ("e", "e-bf16", "g")  # say something about AdamW's state or its implementation
PAIRED = ("b", "c", "d", "e", "g")  # the pairs are of these (bf16 weights trace as fp16 do: "e" stands for both)


def holds_together(label: str) -> bool:
    """Whether a definition's parts ("b+d": (b) and (d)) describe one step a program could run.

    Not: two choices of the moments, two weight dtypes, or no optimizer (c) with anything about the
    optimizer's state or implementation (e: half-precision weights *and AdamW state*; g: foreach AdamW).

    Example:
        >>> [holds_together(x) for x in ("a", "b+d", "c+d", "c+e", "c+g", "b+c", "e+e-bf16")]
        [True, True, True, False, False, False, False]
    """
    parts = set(label.split("+"))
    return (len(parts & set(MOMENT_PARTS)) <= 1 and len(parts & set(WEIGHT_PARTS)) <= 1
            and not ("c" in parts and parts & set(OPTIMIZER_PARTS)))


def combine(label: str) -> StepDefinition:
    """The definition of a label of single parts joined by "+": each part's choices on the book's step.

    Example:
        >>> combine("b+d") == StepDefinition("first", keep_outputs=True)
        True
    """
    if not holds_together(label):
        raise ValueError(f"{label!r} does not hold together (holds_together)")
    changes = {}
    for part in label.split("+"):
        d = SINGLE[part]
        changes.update({f.name: getattr(d, f.name) for f in dataclasses.fields(d)
                        if getattr(d, f.name) != getattr(STEADY, f.name)})
    return STEADY.replace(**changes)


DEFINITIONS: dict[str, StepDefinition] = {  # the single ones, then the pairs that can hold together
    **SINGLE, **{f"{x}+{y}": combine(f"{x}+{y}") for x, y in itertools.combinations(PAIRED, 2)
                 if holds_together(f"{x}+{y}")}}


@dataclass(frozen=True)
class GapRow:
    """One definition's prediction for one reference."""

    reference: str  # the experiment
    definition: str  # its label in ``DEFINITIONS`` ("a", "b+d", ...)
    name: str  # the definition's name (``StepDefinition.name``)
    strategy: str  # the candidate arm that gave the saving (the best one under "up to")
    plain_peak: int  # bytes
    strategy_peak: int  # bytes
    saving: float  # 1 - strategy_peak / plain_peak
    increment_saving: float  # (f): the same for the peaks above what was resident at each step's start
    reference_saving: float  # the reference's figure
    within: bool  # |saving - reference| <= the case's tolerance (``Gap.tolerance_pp``)
    increment_within: bool  # the same for the increment saving
    rounding_pp: float  # how far 512-byte blocks move ``saving``, percentage points

    @property
    def gap_pp(self) -> float:
        """Predicted minus reference saving, percentage points."""
        return 100 * (self.saving - self.reference_saving)


@dataclass(frozen=True)
class Verdict:
    """Which definitions reproduce the reference, or the closest one and what that implies. Only definitions
    that hold together (``holds_together``) are ranked."""

    reproduced_by: tuple[str, ...]  # labels; "x (f)": by the increment saving of definition x
    closest: str  # the label (with " (f)" for an increment) nearest to the reference: the most plausible reading
    closest_saving: float
    text: str  # one sentence


def points(n: float) -> str:
    """A tolerance in words, to a tenth of a point.

    >>> points(1.0), points(1.2649)
    ('1 point', '1.3 points')
    """
    n = round(n, 1)
    return f"{n:g} point" + ("" if n == 1 else "s")


def verdict(rows: list[GapRow], ref: float, tolerance_pp: float = ALLOCATOR_PP) -> Verdict:
    """Which rows reproduce ``ref`` within ``tolerance_pp``, or the closest one and which side the rest lie on;
    rows whose definition does not hold together (``holds_together``) are neither ranked nor offered.

    Args:
        rows: the table's rows (their savings and increment savings are the predictions).
        ref: the reference saving, a fraction.
        tolerance_pp: the case's tolerance (``Gap.tolerance_pp``), percentage points; the rows' ``within``
            flags were set with it.

    Returns:
        a ``Verdict``; ties for the closest go to the earlier row, an absolute saving before an increment.

    Example:
        >>> row = lambda label, s, f: GapRow("X", label, label, "s", 100, 90, s, f, 0.3, abs(s - 0.3) <= 0.01,
        ...                                  abs(f - 0.3) <= 0.01, 0.0)
        >>> verdict([row("a", 0.10, 0.25), row("c", 0.2, 0.295)], 0.3).reproduced_by
        ('c (f)',)
        >>> v = verdict([row("a", 0.10, 0.25), row("c+e", 0.3, 0.3)], 0.3)  # c+e: no optimizer, AdamW state
        >>> v.reproduced_by, v.closest, v.closest_saving
        ((), 'a (f)', 0.25)
    """
    rows = [r for r in rows if holds_together(r.definition)]
    tol = points(tolerance_pp)
    found = tuple([r.definition for r in rows if r.within] + [f"{r.definition} (f)" for r in rows if r.increment_within])
    preds = [(r.definition, r.saving) for r in rows] + [(f"{r.definition} (f)", r.increment_saving) for r in rows]
    i = min(range(len(preds)), key=lambda j: (round(abs(preds[j][1] - ref), 4), j))
    label, value = preds[i]
    if found:
        text = (f"reproduced within {tol} by {', '.join(found)}: the reference is consistent "
                "with the book's ledger under that definition of the step")
        return Verdict(found, label, value, text)
    low = [p for p in preds if p[1] < ref]
    high = [p for p in preds if p[1] > ref]
    if not high:
        side = "every definition predicts less"
    elif not low:
        side = "every definition predicts more"
    else:
        a, b = max(low, key=lambda p: p[1]), min(high, key=lambda p: p[1])
        side = f"it lies between {a[0]} ({a[1]:.1%}) and {b[0]} ({b[1]:.1%})"
    text = (f"no definition reproduces {ref:.1%} within {tol} (closest: {label} at {value:.1%}): "
            f"{side}; the reference's peak is not that of a step traced here at this workload (another program "
            "or workload, or CUDA kernels' own temporaries the CPU trace does not see)")
    return Verdict(found, label, value, text)
