"""Exercise checks, one marker per chapter: ``pytest tests/checks/test_exercises.py -m ch09``.

Default: the reference answers in answers/ must pass. ``--impl exercises`` (what
``bp-mech check NN`` runs) checks the learner's files; the untouched stubs fail.
The checks themselves live in src/bp_mech/checks/exNN.py and compare against independent
references (float64 autograd, finite differences, transformers, Accelerate).
"""

import pytest

from bp_mech.checks import cases


@pytest.mark.parametrize("name, check", list(cases()))
def test_exercise(impl, name, check):
    check(impl(name))
