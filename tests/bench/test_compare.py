"""``bench.compare``: relative errors by hand, and a probe against the plain probe. Which tolerance a
strategy gets is held by ``tests/projects/test_memory_strategy.py``."""

import math
from types import SimpleNamespace

import pytest
import torch

from bp_mech.bench.compare import Comparison, all_finite, compare, relative_error, relative_l2


def test_relative_error_is_the_max_difference_over_the_max_of_the_reference():
    a, b = torch.tensor([1.0, 2.5, -4.0]), torch.tensor([1.0, 2.0, -5.0])
    assert relative_error(a, b) == pytest.approx(1.0 / 5.0)  # max |a - b| = 1, max |b| = 5
    assert relative_error(torch.tensor([0.5]), torch.zeros(1)) == 0.5  # b all 0: absolute
    assert math.isnan(relative_error(torch.tensor([math.nan]), torch.ones(1)))
    assert relative_error(torch.ones(0), torch.ones(0)) == 0.0
    # float64 throughout: float32 inputs whose difference float32 would round away
    assert relative_error(torch.tensor([1.0 + 2**-23]), torch.tensor([1.0])) == 2**-23


def test_relative_l2_is_the_global_norm_of_the_difference_over_the_reference_or_the_update():
    a = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]])]
    r = [torch.zeros(2), torch.zeros(2, 1)]
    base = [torch.tensor([0.0, 1.0]), torch.zeros(2, 1)]
    assert relative_l2(a, [x + 0.0 for x in a]) == 0.0
    assert relative_l2(a, r) == 5.0  # ||r|| = 0: the absolute norm of the difference, sqrt(9 + 16)
    assert relative_l2(a, r, base) == pytest.approx(5.0 / 1.0)  # over ||r - base|| = 1
    assert relative_l2(r, a) == pytest.approx(1.0)  # ||a|| = 5


def test_all_finite_skips_missing_tensors():
    assert all_finite([torch.ones(2), None]) and not all_finite([torch.tensor([1.0, math.inf])])


def _probe(loss, grads, norm):
    return SimpleNamespace(loss=loss, grads=grads, grad_norm=norm)


def test_compare_reports_each_error_and_bitwise_equality():
    ref = _probe(2.0, [torch.tensor([1.0, -2.0]), None], 3.0)
    assert compare(ref, ref) == Comparison(0.0, 0.0, 0.0, True)
    got = compare(ref, _probe(2.5, [torch.tensor([1.0, -1.0]), None], 2.4))
    assert got == Comparison(0.25, 0.5, pytest.approx(0.2), False)
    assert got.within((0.3, 0.5)) and not got.within((0.2, 1.0))


def test_a_missing_gradient_or_a_non_finite_value_is_an_infinite_error():
    ref = _probe(1.0, [torch.ones(2)], 1.0)
    assert compare(ref, _probe(1.0, [None], 1.0)).grad_error == math.inf
    bad = compare(ref, _probe(math.nan, [torch.tensor([math.nan, 1.0])], math.inf))
    assert (bad.loss_error, bad.grad_error, bad.grad_norm_error, bad.bitwise) == (math.inf, math.inf, math.inf, False)
    assert not bad.within((1e30, 1e30))
