"""``planner.reference_gap``: the verdict on rows made by hand (reproduced, the closest with ties, which side
the predictions lie on) and a row's gap. The traced table against the ledgers:
``tests/book/test_reconciliation.py``; its computed record: ``tests/records/test_computed.py``."""

import pytest

from bp_mech.planner.reference_gap import TOLERANCE_PP, GapRow, verdict

REF = 0.30


def row(label, saving, increment):
    tol = TOLERANCE_PP / 100
    return GapRow("X", label, label, "s", 100, 70, saving, increment, REF, abs(saving - REF) <= tol,
                  abs(increment - REF) <= tol, 0.0)


def test_every_row_within_the_tolerance_reproduces_the_reference():
    v = verdict([row("a", 0.295, 0.10), row("b", 0.40, 0.305), row("c", 0.2, 0.2)], REF)
    assert v.reproduced_by == ("a", "b (f)") and v.closest == "a" and v.closest_saving == 0.295
    assert v.text.startswith("reproduced within 1 point by a, b (f)")


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
