"""Every exercise check fails on the untouched stubs in exercises/ (whatever --impl says).

The mutant tests in each tests/test_<mechanism>.py show that the checks also catch the
classic mistakes; tests/checks/test_exercises.py shows that they pass on the answers.
"""

import pytest
from conftest import ROOT, load_solution

from bp_mech.checks import cases


@pytest.mark.parametrize("name, check", list(cases()))
def test_check_fails_on_the_untouched_stub(name, check):
    with pytest.raises(NotImplementedError):
        check(load_solution(ROOT / "exercises", name))
