"""``checks.common``: the one-line failure messages on inputs made by hand (a crash named with its input, a
stub passed through, a NaN that never passes, relative against absolute tolerance)."""

import math

import pytest
import torch

from bp_mech.checks.common import assert_all_close, assert_close, assert_value, autograd_grads, call, describe


def test_a_crash_becomes_one_line_naming_the_input_and_a_stub_passes_through():
    with pytest.raises(AssertionError, match=r"^f: raised ZeroDivisionError at x = 0: division by zero$"):
        call("f", lambda x: 1 / x, 0, at="x = 0")

    def stub(x):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        call("f", stub, 1, at="x = 1")
    assert call("f", lambda x, k=1: x + k, 2, k=3, at="") == 5


@pytest.mark.parametrize("x, words", [
    (None, "None"), (torch.zeros(2, 3), "a float32 tensor of shape (2, 3)"),
    (torch.ones(1, requires_grad=True) * 2, "a float32 tensor of shape (1,) with a graph"),
    (3, "an int"), (2.5, "a float"), ([1], "a list")])
def test_what_a_solution_returned_in_words(x, words):
    assert describe(x) == words


def test_assert_close_checks_kind_shape_dtype_and_the_max_relative_error():
    want = torch.tensor([1.0, -4.0], dtype=torch.float64)
    assert_close("f", "dx", want * (1 + 1e-12), want, tol=1e-10, ref="r", at="a")
    for got, match in ((None, "dx is None, expected a tensor of shape \\(2,\\)"), (3.0, "dx is a float"),
                       (torch.ones(3), "dx has shape \\(3,\\), r gives \\(2,\\)"),
                       (want + torch.tensor([0.0, 4e-3]), "max rel error 1.0e-03 > 1e-10"),
                       (torch.tensor([math.nan, -4.0]), "max rel error nan")):
        with pytest.raises(AssertionError, match=match):
            assert_close("f", "dx", got, want, tol=1e-10, ref="r", at="a")
    with pytest.raises(AssertionError, match="dtype torch.float32, expected torch.float64"):
        assert_close("f", "dx", want.float(), want, tol=1.0, ref="r", at="a", dtype=torch.float64)


def test_a_tuple_of_tensors_by_name():
    want = (torch.ones(2), torch.zeros(1))
    assert_all_close("f", ("a", "b"), want, want, tol=0.0, ref="r", at="x")
    with pytest.raises(AssertionError, match=r"returned a tuple, expected a tuple \(a, b, c\)"):
        assert_all_close("f", ("a", "b", "c"), want, want, tol=0.0, ref="r", at="x")


def test_a_number_is_relative_to_the_reference_or_absolute_at_zero():
    assert_value("f", "loss", torch.tensor(2.02), 2.0, tol=0.011, ref="r", at="x")
    assert_value("f", "loss", 0.005, 0.0, tol=0.01, ref="r", at="x")
    for got in (2.1, math.nan, None):
        with pytest.raises(AssertionError):
            assert_value("f", "loss", got, 2.0, tol=0.01, ref="r", at="x")


def test_the_reference_gradients_are_autograd_s_on_fresh_leaves():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    (dx,) = autograd_grads(lambda t: t ** 3, [x], torch.ones(2, dtype=torch.float64))
    assert dx.tolist() == [3.0, 12.0] and not x.requires_grad


def test_a_floating_result_where_the_reference_counts_integers_is_refused():
    with pytest.raises(AssertionError, match="n has dtype torch.float32, expected integers"):
        assert_close("f", "n", torch.tensor(3.0), torch.tensor(3), tol=0.0, ref="a count", at="here")


def test_inf_and_nan_where_the_reference_has_them_pass_and_nowhere_else():
    want = torch.tensor([1.0, math.inf, math.nan])
    assert_close("f", "y", torch.tensor([1.0, math.inf, math.nan]), want, tol=0.0, ref="r", at="here")
    with pytest.raises(AssertionError, match="where it is not finite"):
        assert_close("f", "y", torch.tensor([1.0, -math.inf, math.nan]), want, tol=0.0, ref="r", at="here")
    with pytest.raises(AssertionError, match="max rel error"):
        assert_close("f", "y", torch.tensor([2.0, math.inf, math.nan]), want, tol=0.0, ref="r", at="here")
    assert_value("f", "n", math.inf, math.inf, tol=0.0, ref="r", at="here")
    assert_value("f", "n", math.nan, math.nan, tol=0.0, ref="r", at="here")
    with pytest.raises(AssertionError):
        assert_value("f", "n", 1.0, math.inf, tol=0.0, ref="r", at="here")
