"""The reconciliation table: each row is the fake-tensor ledger's own saving under its definition."""

from bp_mech.planner.definitions import StepDefinition
from bp_mech.planner.lifecycle import Session
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.book.reconciliation import gap_rows, meaning
from bp_mech.planner.reference_gap import Case, reference_gap

TINY = Case("TRAIN-CHECKPOINT", "tiny-b2s64", ("checkpoint-all",))


def test_rows_are_the_ledgers_savings_and_flag_only_what_is_within_tolerance():
    gap = reference_gap("TRAIN-CHECKPOINT", ["a", "c"], workers=1, case=TINY)
    options = StepOptions().for_device("cuda")
    s = Session(parse_workload("tiny-b2s64"), fake=True, options=options)
    for label, d in (("a", StepDefinition()), ("c", StepDefinition("none"))):
        plain, ckpt = s.step(parse("plain"), d), s.step(parse("checkpoint-all"), d)
        row = next(r for r in gap.rows if r.definition == label)
        assert row.saving == 1 - ckpt.peak / plain.peak
        assert row.increment_saving == 1 - ckpt.increment / plain.increment
        assert row.within == (abs(row.saving - gap.reference_saving) <= gap.tolerance_pp / 100)
    shown = gap_rows(gap)
    assert [r["definition"] for r in shown] == ["a", "c"]
    assert shown[1]["the step it measures"] == meaning("c")
    assert all(r["reference"] == f"{gap.reference_saving:.1%}" for r in shown)


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
