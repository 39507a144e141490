"""Words whose truth depends on a run, chosen from the run's values: a chapter glues them instead of
typing "higher", "lower" or "nearly three quarters" (tests/book/test_claims.py changes a value and sees
the words change)."""

from __future__ import annotations

from fractions import Fraction

# the simple fractions a share is named by, and their words
FRACTIONS = {Fraction(1, 10): "a tenth", Fraction(1, 5): "a fifth", Fraction(1, 4): "a quarter",
             Fraction(1, 3): "a third", Fraction(2, 5): "two fifths", Fraction(1, 2): "half",
             Fraction(3, 5): "three fifths", Fraction(2, 3): "two thirds", Fraction(3, 4): "three quarters",
             Fraction(4, 5): "four fifths", Fraction(9, 10): "nine tenths"}
ABOUT = 0.01  # within this (absolute) of a fraction: "about"; else "nearly" below it, "just over" above


def share_words(x: float) -> str:
    """A share in [0, 1] in words, by the nearest simple fraction: "about a third", "nearly three
    quarters", "just over a fifth".

    >>> share_words(0.74), share_words(0.205), share_words(0.334)
    ('nearly three quarters', 'about a fifth', 'about a third')
    """
    if not 0 <= x <= 1:
        raise ValueError(f"a share lies in [0, 1], not {x}")
    f = min(FRACTIONS, key=lambda f: abs(x - f))
    how = "about" if abs(x - f) <= ABOUT else ("nearly" if x < f else "just over")
    return f"{how} {FRACTIONS[f]}"


def comparison(a: float, b: float, more: str = "higher", less: str = "lower", same: str = "level with",
               than: str = " than") -> str:
    """How ``a`` stands against ``b``: ``more`` (+ ``than``), ``less`` (+ ``than``) or ``same``.

    >>> comparison(3, 2), comparison(2, 3, "ends higher", "ends lower"), comparison(2, 2)
    ('higher than', 'ends lower than', 'level with')
    >>> comparison(6e-9, 6e-8, "above", "below", "at", than="")
    'below'
    """
    if a == b:
        return same
    return f"{more if a > b else less}{than}"


def order_heading(a_name: str, a: float, b_name: str, b: float, what: str = "peaks") -> str:
    """A heading whose verb the values choose: "Why offload + checkpointing peaks higher than offload".

    >>> order_heading("offload + checkpointing", 5, "offload alone", 4)
    'Why offload + checkpointing peaks higher than offload alone'
    >>> order_heading("offload + checkpointing", 4, "offload alone", 4)
    'Why offload + checkpointing peaks level with offload alone'
    """
    return f"Why {a_name} {what} {comparison(a, b)} {b_name}"
