"""``ledger_table``: a ledger's totals, peak and peak stage on a table filled by hand (a stage missing a
class, a tie, a forward peak above every stage)."""

import pytest

from bp_mech.ledger_table import CLASS_LABELS, CLASSES, STAGE_LABELS, STAGES, Ledger


def _ledger(forward_peak=0, **per_stage):
    stages = {s: {c: 0 for c in CLASSES} for s in STAGES}
    for stage, classes in per_stage.items():
        stages[stage].update(classes)
    return Ledger("formula", "plain", stages, forward_peak=forward_peak)


def test_totals_add_every_class_of_every_stage():
    led = _ledger(load=dict(parameters=100), forward=dict(parameters=100, saved_activations=300, other=7),
                  backward=dict(parameters=100, gradients=100))
    assert led.total("forward") == 407
    assert led.totals() == dict(load=100, forward=407, backward_peak=0, backward=200, optimizer_peak=0, zero_grad=0)
    assert list(led.totals()) == list(STAGES)


def test_the_peak_is_the_largest_stage_or_the_forward_peak_inside_the_forward():
    led = _ledger(forward=dict(saved_activations=400), backward_peak=dict(gradients=500))
    assert (led.peak, led.peak_stage) == (500, "backward_peak")
    inside = _ledger(forward_peak=501, forward=dict(saved_activations=400), backward_peak=dict(gradients=500))
    assert (inside.peak, inside.peak_stage) == (501, "forward_peak")


def test_a_tie_goes_to_the_earlier_stage_and_a_forward_peak_must_exceed_it():
    led = _ledger(forward_peak=300, forward=dict(other=300), optimizer_peak=dict(optimizer_states=300))
    assert (led.peak, led.peak_stage) == (300, "forward")


def test_a_stage_without_its_row_is_a_key_error_not_zero():
    led = Ledger("formula", "plain", {"load": {"parameters": 1}})
    assert led.total("load") == 1
    with pytest.raises(KeyError):
        led.totals()


def test_every_stage_and_class_has_a_label():
    assert list(STAGE_LABELS) == list(STAGES) and list(CLASS_LABELS) == list(CLASSES)
