"""The course's reference figure beside the book's ledger (Part 02 · 11, 19, 42, mixed precision): the
table of ``planner.reference_gap``, read from its computed record, as a chapter shows it."""

from __future__ import annotations

from bp_mech.book.report import markdown_table
from bp_mech.book.computations import reference_gap_of
from bp_mech.planner.reference_gap import Gap

# what each single definition of ``planner.definitions`` means, in a reader's words
MEANING = {
    "a": "steady state, moments resident (the book's step)",
    "b": "first step: the update allocates AdamW's moments",
    "c": "forward + backward only, no optimizer",
    "d": "outputs (logits) kept alive through backward",
    "e": "fp16 weights and AdamW state, no fp32 master",
    "e-bf16": "bf16 weights and AdamW state, no fp32 master",
    "g": "PyTorch's default AdamW on CUDA (foreach)",
}


def meaning(label: str) -> str:
    """A definition's label ("a", "b+d", ...) in words: its parts' meanings joined by "and".

    >>> meaning("b+g")
    "first step: the update allocates AdamW's moments and PyTorch's default AdamW on CUDA (foreach)"
    """
    return " and ".join(MEANING[part] for part in label.split("+"))


def pct(x: float) -> str:
    """A saving as a percentage to one decimal; a saving that rounds to zero is "0.0%", never "-0.0%".

    >>> pct(0.1394), pct(-0.00002), pct(-0.02)
    ('13.9%', '0.0%', '-2.0%')
    """
    return f"{x if round(x, 3) else 0.0:.1%}"


def key_rows(gap: Gap) -> list:
    """The definitions that matter to a chapter, in ``gap.rows``' order: the book's own step ("a"), every
    one whose peak or increment saving lies within the tolerance of the reference, and the one nearest to
    the reference (so that a chapter without a match still shows how near it came)."""
    def miss(r) -> float:
        return min(abs(r.saving - gap.reference_saving), abs(r.increment_saving - gap.reference_saving))

    nearest = min(gap.rows, key=miss)
    return [r for r in gap.rows if r.definition == "a" or r.within or r.increment_within or r is nearest]


def gap_rows(gap: Gap, rows: list | None = None) -> list[dict]:
    """One row per definition (``rows``, default every one of ``gap.rows``): its meaning, the predicted
    saving of the peak and of the peak's increment (f), and whether either lies within the tolerance of
    the reference."""
    tol = gap.tolerance_pp
    shown = []
    for r in gap.rows if rows is None else rows:
        hit = [x for x, ok in (("peak", r.within), ("increment (f)", r.increment_within)) if ok]
        shown.append({"definition": r.definition, "the step it measures": meaning(r.definition),
                     "predicted saving": pct(r.saving), "(f) increment saving": pct(r.increment_saving),
                     "reference": pct(gap.reference_saving),
                     f"within ±{tol:g} point{'' if tol == 1 else 's'}": ", ".join(hit) or "no"})
    return shown


def gap_table(gap: Gap):
    """``gap_rows`` of the definitions that matter (``key_rows``) as a Markdown table (renders in the book):
    a chapter shows its own few, not every definition."""
    return markdown_table(gap_rows(gap, key_rows(gap)))


def reconcile(semantic_id: str) -> Gap:
    """``reference_gap`` of one course reference at its workload under every definition, as its computed
    record holds it (``book.computations``: traced by ``make records``, refused when stale)."""
    return reference_gap_of(semantic_id)
