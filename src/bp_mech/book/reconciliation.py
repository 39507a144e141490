"""The course's reference figure beside the book's ledger (Part 02 · 11, 19, 42, mixed precision): the
table of ``planner.reference_gap``, read from its computed record, as a chapter shows it."""

from __future__ import annotations

from bp_mech.book.report import markdown_table
from bp_mech.book.computations import reference_gap_of
from bp_mech.planner.reference_gap import Gap
from bp_mech.planner.reference_reading import holds_together, points

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
    the reference (so that a chapter without a match still shows how near it came). Only definitions that
    hold together (``planner.reference_reading.holds_together``) are offered as the nearest or as a match."""
    def miss(r) -> float:
        return min(abs(r.saving - gap.reference_saving), abs(r.increment_saving - gap.reference_saving))

    ranked = [r for r in gap.rows if holds_together(r.definition)]
    nearest = min(ranked, key=lambda r: round(miss(r), 4))  # ties to the earlier row, as ``verdict`` breaks them
    return [r for r in gap.rows if r.definition == "a" or r is nearest
            or (r in ranked and (r.within or r.increment_within))]


def gap_rows(gap: Gap, rows: list | None = None) -> list[dict]:
    """One row per definition (``rows``, default every one of ``gap.rows``): its meaning, the predicted
    saving of the peak and of the peak's increment (f), and whether either lies within the tolerance of
    the reference."""
    shown = []
    for r in gap.rows if rows is None else rows:
        hit = [x for x, ok in (("peak", r.within), ("increment (f)", r.increment_within)) if ok]
        shown.append({"definition": r.definition, "the step it measures": meaning(r.definition),
                     "predicted saving": pct(r.saving), "(f) increment saving": pct(r.increment_saving),
                     "reference": pct(gap.reference_saving),
                     f"within ±{points(gap.tolerance_pp)}": ", ".join(hit) or "no"})
    return shown


def gap_table(gap: Gap):
    """``gap_rows`` of the definitions that matter (``key_rows``) as a Markdown table (renders in the book):
    a chapter shows its own few, not every definition."""
    return markdown_table(gap_rows(gap, key_rows(gap)))


def tolerance_text(gap: Gap) -> str:
    """The case's tolerance and its two terms, in words: the allocator's and the tracer's (the book's tracker
    against PyTorch's MemTracker on definition (a), or, where MemTracker cannot trace the strategy, the
    largest difference measured on the other references).

    >>> from types import SimpleNamespace as NS
    >>> t = NS(pp=0.42, book_saving=0.14, memtracker_saving=0.1358, borrowed_from=(), measured=True)
    >>> tolerance_text(NS(tolerance_pp=1.42, allocator_pp=1.0, tracer=t))  # doctest: +NORMALIZE_WHITESPACE
    "1.4 points in all: 1 point for what the allocator adds to the live bytes, plus 0.4 points for the tracer itself
    (definition (a)'s saving is 14.0% by the book's tracker and 13.6% by PyTorch's MemTracker, tracing the
    same fake step)"
    """
    t = gap.tracer
    head = f"{points(gap.tolerance_pp)} in all: {points(gap.allocator_pp)} for what the allocator adds to the live bytes"
    if t is None:
        return head + " (the tracer's own term was not measured)"
    if t.measured:
        return (f"{head}, plus {points(t.pp)} for the tracer itself (definition (a)'s saving is "
                f"{pct(t.book_saving)} by the book's tracker and {pct(t.memtracker_saving)} by PyTorch's "
                "MemTracker, tracing the same fake step)")
    return (f"{head}, plus {points(t.pp)} for the tracer itself, the largest difference between the book's "
            f"tracker and PyTorch's MemTracker measured on the other references ({', '.join(t.borrowed_from)}): "
            "MemTracker counts bytes per device, and under fake tensors the offload's host copies are on the "
            "same device as everything else, so it cannot trace this strategy")


def plausible_reading(gap: Gap) -> str:
    """The most plausible reading of the reference: the definition that holds together whose prediction
    (peak or increment, f) lies nearest to it (``Verdict.closest``), in words, and whether it lies within
    the tolerance."""
    v = gap.verdict
    label = v.closest.removesuffix(" (f)")
    what = meaning(label) + (", the saving of the peak's increment" if v.closest.endswith("(f)") else "")
    where = "within" if v.closest in v.reproduced_by else "outside"
    return (f"the most plausible reading is {v.closest} — {what} — which predicts {pct(v.closest_saving)} "
            f"against the reference's {pct(gap.reference_saving)}, {where} the tolerance of "
            f"{points(gap.tolerance_pp)}")


def adamw_effect(gap: Gap) -> str | None:
    """What the AdamW implementation alone does to the prediction: the book's step with the fused AdamW (a)
    against the same step with PyTorch's default on CUDA, foreach (g); None where either was not traced."""
    row = {r.definition: r for r in gap.rows}
    if "a" not in row or "g" not in row:
        return None
    fused, foreach = pct(row["a"].saving), pct(row["g"].saving)
    if fused == foreach:
        return (f"the AdamW implementation alone does not move the prediction here: the fused AdamW (a) and "
                f"PyTorch's default on CUDA, foreach (g), both predict {fused}")
    return (f"the AdamW implementation alone moves the predicted saving from {foreach} (PyTorch's default AdamW "
            f"on CUDA, foreach: g) to {fused} (the fused AdamW the book runs: a)")


def reconcile(semantic_id: str) -> Gap:
    """``reference_gap`` of one course reference at its workload under every definition, as its computed
    record holds it (``book.computations``: traced by ``make records``, refused when stale)."""
    return reference_gap_of(semantic_id)
