"""Words chosen from a run's values: change the value, and the words change."""

import pytest

from bp_mech.book.claims import comparison, order_heading, share_words


def test_the_heading_follows_the_peaks():
    """Part 02 · 42's heading: the combined strategy's peak against offload's, as traced."""
    assert order_heading("offload + checkpointing", 5.0, "offload alone", 4.0).endswith("peaks higher than offload alone")
    assert order_heading("offload + checkpointing", 3.0, "offload alone", 4.0).endswith("peaks lower than offload alone")
    assert order_heading("offload + checkpointing", 4.0, "offload alone", 4.0).endswith("peaks level with offload alone")


def test_the_comparison_follows_the_values():
    """The sentences of 12b (below FP16's smallest subnormal), 19 (the measured steps' peak) and 42.4."""
    sub = 2.0**-24
    assert comparison(6.4e-9, sub, "above", "below", "at", than="") == "below"
    assert comparison(6.4e-7, sub, "above", "below", "at", than="") == "above"
    assert comparison(3.27, 3.26, "peaked higher", "peaked lower") == "peaked higher than"
    assert comparison(3.25, 3.26, "peaked higher", "peaked lower") == "peaked lower than"


@pytest.mark.parametrize("x, words", [(0.74, "nearly three quarters"), (0.76, "just over three quarters"),
                                      (0.195, "about a fifth"), (0.17, "nearly a fifth"), (0.5, "about half")])
def test_a_share_is_named_by_its_nearest_fraction(x, words):
    assert share_words(x) == words


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError):
        share_words(1.2)
