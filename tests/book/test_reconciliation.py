"""The reconciliation table: each row is the fake-tensor ledger's own saving under its definition; the
tolerance adds the tracer's own term (the book's tracker against PyTorch's MemTracker); the sentences a
chapter glues follow the traced values."""

import dataclasses

import pytest

from bp_mech.planner.definitions import StepDefinition
from bp_mech.planner.lifecycle import Session
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.book.reconciliation import adamw_effect, gap_rows, meaning, plausible_reading, tolerance_text
from bp_mech.planner.reference_gap import Case, reference_gap
from bp_mech.planner.reference_reading import ALLOCATOR_PP, verdict
from bp_mech.planner.tracer_term import memtracker_peak

TINY = Case("TRAIN-CHECKPOINT", "tiny-b2s64", ("checkpoint-all",))


@pytest.fixture(scope="module")
def gap():
    return reference_gap("TRAIN-CHECKPOINT", ["a", "c", "g"], workers=1, case=TINY)


def test_rows_are_the_ledgers_savings_and_flag_only_what_is_within_tolerance(gap):
    options = StepOptions().for_device("cuda")
    s = Session(parse_workload("tiny-b2s64"), fake=True, options=options)
    for label, d in (("a", StepDefinition()), ("c", StepDefinition("none"))):
        plain, ckpt = s.step(parse("plain"), d), s.step(parse("checkpoint-all"), d)
        row = next(r for r in gap.rows if r.definition == label)
        assert row.saving == 1 - ckpt.peak / plain.peak
        assert row.increment_saving == 1 - ckpt.increment / plain.increment
        assert row.within == (abs(row.saving - gap.reference_saving) <= gap.tolerance_pp / 100)
    shown = gap_rows(gap)
    assert [r["definition"] for r in shown] == ["a", "c", "g"]
    assert shown[1]["the step it measures"] == meaning("c")
    assert all(r["reference"] == f"{gap.reference_saving:.1%}" for r in shown)


def test_the_tracer_s_term_is_measured_with_memtracker_and_enters_the_tolerance(gap):
    t = gap.tracer
    a = next(r for r in gap.rows if r.definition == "a")
    s = Session(parse_workload("tiny-b2s64"), fake=True, options=StepOptions().for_device("cuda"))
    mt = 1 - memtracker_peak(s, "checkpoint-all") / memtracker_peak(s, "plain")
    assert t.measured and t.borrowed_from == () and t.strategy == "checkpoint-all"
    assert t.book_saving == a.saving and t.memtracker_saving == mt
    assert t.pp == 100 * abs(t.book_saving - t.memtracker_saving) >= 0
    assert gap.tolerance_pp == gap.allocator_pp + t.pp == ALLOCATOR_PP + t.pp
    assert "for the tracer itself" in tolerance_text(gap)



def test_a_case_memtracker_cannot_trace_borrows_the_largest_measured_term(gap):
    """Offload's host copies are fake CPU tensors like the device's: the term comes from the other cases."""
    offload = Case("TRAIN-OFFLOAD", "tiny-b2s64", ("offload",))
    g = reference_gap("TRAIN-OFFLOAD", ["a"], workers=1, case=offload, tracer_cases=[TINY, offload])
    assert g.tracer.memtracker_saving is None and g.tracer.borrowed_from == ("TRAIN-CHECKPOINT",)
    assert g.tracer.pp == gap.tracer.pp and g.tolerance_pp == ALLOCATOR_PP + gap.tracer.pp
    assert "cannot trace this strategy" in tolerance_text(g)


def _edited(gap, label, **values):
    """``gap`` with row ``label``'s savings edited, its flags and verdict recomputed as the trace would."""
    tol, ref = gap.tolerance_pp / 100, gap.reference_saving
    rows = []
    for r in gap.rows:
        if r.definition == label:
            r = dataclasses.replace(r, **values)
            r = dataclasses.replace(r, within=abs(r.saving - ref) <= tol,
                                    increment_within=abs(r.increment_saving - ref) <= tol)
        rows.append(r)
    return dataclasses.replace(gap, rows=rows, verdict=verdict(rows, ref, gap.tolerance_pp))


def test_editing_a_traced_value_changes_the_verdict_and_the_sentences(gap):
    moved = _edited(gap, "c", increment_saving=gap.reference_saving)
    assert moved.verdict.text != gap.verdict.text and moved.verdict.reproduced_by == ("c (f)",)
    assert moved.verdict.text.startswith("reproduced within")
    assert plausible_reading(moved).startswith("the most plausible reading is c (f)")
    assert "within the tolerance" in plausible_reading(moved)
    assert adamw_effect(_edited(gap, "g", saving=0.05)) != adamw_effect(_edited(gap, "g", saving=0.06))
    assert "from 5.0%" in adamw_effect(_edited(gap, "g", saving=0.05))
    same = _edited(gap, "g", saving=next(r.saving for r in gap.rows if r.definition == "a"))
    assert "does not move the prediction" in adamw_effect(same)


def test_a_chapter_shows_only_the_definitions_that_matter():
    """The book's step, those within the tolerance, the nearest: not every definition in every chapter."""
    from types import SimpleNamespace as NS

    from bp_mech.book.reconciliation import key_rows

    def row(d, saving, within=False):
        return NS(definition=d, saving=saving, increment_saving=saving, within=within, increment_within=False)

    rows = [row("a", 0.30), row("b", 0.10), row("c", 0.19, True), row("d", 0.50), row("b+g", 0.05)]
    gap = NS(rows=rows, reference_saving=0.20, tolerance_pp=2.0)
    assert [r.definition for r in key_rows(gap)] == ["a", "c"]
    gap.rows = [row("a", 0.30), row("b", 0.12), row("d", 0.50)]  # none within: the nearest stays
    assert [r.definition for r in key_rows(gap)] == ["a", "b"]
    gap.rows = [row("a", 0.30), row("b", 0.12), row("c+e", 0.20, True)]  # c+e cannot hold together
    assert [r.definition for r in key_rows(gap)] == ["a", "b"]
