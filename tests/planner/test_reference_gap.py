"""``planner.reference_gap``: one reference's table is traced from the fake ledger under each definition asked
for, with its tolerance made of the allocator's and the tracer's terms; a definition it does not know, or one
that cannot hold together, is refused before anything is traced."""

import pytest

from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.planner.lifecycle import Session
from bp_mech.planner.reference_gap import Case, reference_gap
from bp_mech.bench.optimizer import StepOptions

TINY = Case("TRAIN-CHECKPOINT", "tiny-b2s64", ("checkpoint-all",))


def test_the_book_s_step_row_is_the_ledger_s_own_saving_and_the_tolerance_adds_both_terms():
    gap = reference_gap("TRAIN-CHECKPOINT", ["a"], workers=1, case=TINY)
    s = Session(parse_workload("tiny-b2s64"), fake=True, options=StepOptions().for_device("cuda"))
    want = 1 - s.step(parse("checkpoint-all")).peak / s.step(parse("plain")).peak
    (row,) = gap.rows
    assert row.saving == want and gap.tolerance_pp == gap.allocator_pp + gap.tracer.pp


@pytest.mark.parametrize("label", ["z", "c+e"])
def test_an_unknown_or_incompatible_definition_is_refused(label):
    with pytest.raises(ValueError, match="unknown or incompatible"):
        reference_gap("TRAIN-CHECKPOINT", [label], workers=1, case=TINY)
