"""``planner.reference_reading``: the verdict on rows made by hand (reproduced, the closest with ties, which side
the predictions lie on, the case's tolerance) and a row's gap; which definitions hold together. The traced
table against the ledgers and the tracer's term: ``tests/book/test_reconciliation.py``; its computed record:
``tests/records/test_computed.py``."""

import pytest

from bp_mech.planner.reference_reading import (ALLOCATOR_PP, DEFINITIONS, SINGLE, GapRow, combine, holds_together,
                                               verdict)

REF = 0.30


def row(label, saving, increment, tolerance_pp=ALLOCATOR_PP):
    tol = tolerance_pp / 100
    return GapRow("X", label, label, "s", 100, 70, saving, increment, REF, abs(saving - REF) <= tol,
                  abs(increment - REF) <= tol, 0.0)


def test_every_row_within_the_tolerance_reproduces_the_reference():
    v = verdict([row("a", 0.295, 0.10), row("b", 0.40, 0.305), row("c", 0.2, 0.2)], REF)
    assert v.reproduced_by == ("a", "b (f)") and v.closest == "a" and v.closest_saving == 0.295
    assert v.text.startswith("reproduced within 1 point by a, b (f)")


def test_the_case_s_tolerance_decides_and_is_stated():
    """A tracer's term widens the tolerance: a prediction 1.5 points off is a match at 2.5 points, not at 1."""
    assert verdict([row("a", 0.315, 0.1)], REF).reproduced_by == ()
    v = verdict([row("a", 0.315, 0.1, tolerance_pp=2.5)], REF, tolerance_pp=2.5)
    assert v.reproduced_by == ("a",) and v.text.startswith("reproduced within 2.5 points by a")


def test_the_closest_tie_goes_to_the_earlier_row_and_a_saving_before_an_increment():
    v = verdict([row("a", 0.25, 0.35), row("b", 0.35, 0.25)], REF)
    assert v.reproduced_by == () and (v.closest, v.closest_saving) == ("a", 0.25)
    assert "it lies between a (25.0%) and b (35.0%)" in v.text  # the nearest below and the nearest above


@pytest.mark.parametrize("savings, closest, side", [((0.1, 0.2), "a (f) at 20.0%", "every definition predicts less"),
                                                    ((0.4, 0.5), "a at 40.0%", "every definition predicts more")])
def test_which_side_the_predictions_lie_on(savings, closest, side):
    v = verdict([row("a", *savings)], REF)
    assert f"(closest: {closest}): {side};" in v.text


def test_a_row_s_gap_is_in_percentage_points():
    assert row("a", 0.25, 0.0).gap_pp == pytest.approx(-5.0)


@pytest.mark.parametrize("label", ["c+e", "c+g", "c+e-bf16", "b+c", "e+e-bf16"])
def test_definitions_that_cannot_hold_together_are_not_traced(label):
    """No optimizer (c) with AdamW's state (e) or implementation (g); one choice of moments; one dtype."""
    assert not holds_together(label) and label not in DEFINITIONS
    with pytest.raises(ValueError, match="does not hold together"):
        combine(label)


def test_every_traced_definition_holds_together_and_is_its_parts():
    assert all(holds_together(label) for label in DEFINITIONS) and set(SINGLE) <= set(DEFINITIONS)
    assert DEFINITIONS["b+d"] == SINGLE["b"].replace(keep_outputs=True)
    assert DEFINITIONS["e+g"] == SINGLE["e"].replace(adamw="foreach")
    assert all(label in DEFINITIONS for label in ("b+d", "b+e", "b+g", "c+d", "d+e", "d+g", "e+g"))


def test_a_pair_that_cannot_hold_together_is_never_the_nearest_reading():
    """Even a row that hits the reference exactly (as "c+e" once did) is neither a match nor the closest."""
    v = verdict([row("a", 0.10, 0.27), row("c+e", 0.30, 0.30), row("c+d", 0.2, 0.25)], REF)
    assert v.reproduced_by == () and v.closest == "a (f)" and "c+e" not in v.text
