"""Exercise checks, one marker per chapter: ``pytest tests/test_exercises.py -m ch09``.

Default: the reference answers in answers/ must pass. ``--impl exercises`` (what
``bp-mech check NN`` runs) checks the learner's files; the untouched stubs fail.
The checks themselves live in tests/checks/exNN.py and compare against independent
references (float64 autograd, finite differences, transformers, Accelerate).
"""

import pytest

from checks import ex09
from checks import ex10


@pytest.mark.ch09
@pytest.mark.parametrize("check", ex09.CHECKS, ids=lambda c: c.__name__)
def test_ex09(impl, check):
    check(impl("ex09_local_backward"))


@pytest.mark.ch10
@pytest.mark.parametrize("check", ex10.CHECKS, ids=lambda c: c.__name__)
def test_ex10(impl, check):
    check(impl("ex10_attention_backward"))
