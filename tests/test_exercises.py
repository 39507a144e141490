"""Exercise checks, one marker per chapter: ``pytest tests/test_exercises.py -m ch09``.

Default: the reference answers in answers/ must pass. ``--impl exercises`` (what
``bp-mech check NN`` runs) checks the learner's files; the untouched stubs fail.
The checks themselves live in tests/checks/exNN.py and compare against independent
references (float64 autograd, finite differences, transformers, Accelerate).
"""

import pytest

from checks import cases


@pytest.mark.parametrize("name, check", list(cases()))
def test_exercise(impl, name, check):
    check(impl(name))
