"""Exercise checks, one marker per chapter: ``pytest tests/test_exercises.py -m ch09``.

Default: the reference answers in answers/ must pass. ``--impl exercises`` (what
``bp-mech check NN`` runs) checks the learner's files; the untouched stubs fail.
The checks themselves live in tests/checks/exNN.py and compare against independent
references (float64 autograd, finite differences, transformers, Accelerate).
"""

import pytest

from checks import ex09
from checks import ex10
from checks import ex11
from checks import ex55
from checks import ex12
from checks import ex_amp
from checks import ex19
from checks import ex42
from checks import ex43


@pytest.mark.ch09
@pytest.mark.parametrize("check", ex09.CHECKS, ids=lambda c: c.__name__)
def test_ex09(impl, check):
    check(impl("ex09_local_backward"))


@pytest.mark.ch10
@pytest.mark.parametrize("check", ex10.CHECKS, ids=lambda c: c.__name__)
def test_ex10(impl, check):
    check(impl("ex10_attention_backward"))


@pytest.mark.ch11
@pytest.mark.parametrize("check", ex11.CHECKS, ids=lambda c: c.__name__)
def test_ex11(impl, check):
    check(impl("ex11_gradient_accumulation"))


@pytest.mark.ch55
@pytest.mark.parametrize("check", ex55.CHECKS, ids=lambda c: c.__name__)
def test_ex55(impl, check):
    check(impl("ex55_update_dynamics"))


@pytest.mark.ch12
@pytest.mark.parametrize("check", ex12.CHECKS, ids=lambda c: c.__name__)
def test_ex12(impl, check):
    check(impl("ex12_scheduler_clock"))


@pytest.mark.amp
@pytest.mark.parametrize("check", ex_amp.CHECKS, ids=lambda c: c.__name__)
def test_ex_amp(impl, check):
    check(impl("ex_amp_backward"))


@pytest.mark.ch19
@pytest.mark.parametrize("check", ex19.CHECKS, ids=lambda c: c.__name__)
def test_ex19(impl, check):
    check(impl("ex19_checkpointing"))


@pytest.mark.ch42
@pytest.mark.parametrize("check", ex42.CHECKS, ids=lambda c: c.__name__)
def test_ex42(impl, check):
    check(impl("ex42_offload"))


@pytest.mark.ch43
@pytest.mark.parametrize("check", ex43.CHECKS, ids=lambda c: c.__name__)
def test_ex43(impl, check):
    check(impl("ex43_state_ledger"))
