"""``checks.properties``: each property on a solution made by hand that keeps it and one that breaks it (an
input changed, NaN-aware; a view; an alias; a graph; a type; JSON; a non-finite value; a swallowed error)
and ``explore``'s shrinking to the smallest failing case. Each property against the chapters' mutants:
``tests/checks/test_contract_*.py``."""

import math

import pytest
import torch
from hypothesis import strategies as st

from bp_mech.checks import properties as P


def test_explore_reports_the_smallest_failing_case_and_a_stub_at_once(monkeypatch):
    monkeypatch.setattr(P, "SHRINK", True)

    def body(n):
        if n >= 37:
            raise AssertionError(f"n = {n}")

    with pytest.raises(AssertionError, match="^n = 37$"):  # shrunk from whatever was drawn first
        P.explore(st.integers(0, 10_000), body, examples=200)
    seen = []

    def stub(n):
        seen.append(n)
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        P.explore(st.integers(), stub, corners=(5,))
    assert seen == [5]  # the corner first, and nothing after the stub


def test_a_change_is_nan_aware_and_infinite_for_a_new_shape():
    nan = torch.tensor([math.nan, 1.0])
    assert P.max_change(nan, nan.clone()) == 0.0
    assert P.max_change(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.5])) == 2.5
    assert P.max_change(torch.ones(2), torch.tensor([1.0, math.nan])) == math.inf
    assert P.max_change(torch.ones(2), torch.ones(3)) == math.inf


def test_call_unmodified_names_what_changed_and_spares_what_may_change():
    def scale_(x, out):
        out.mul_(2)
        return x * 2

    x, out = torch.ones(2), torch.ones(2)
    with pytest.raises(AssertionError, match=r"^f: out was modified in place, max change 1 at here$"):
        P.call_unmodified("f", scale_, x, out, names=("x", "out"), at="here")
    P.call_unmodified("f", scale_, x, out, names=("x", "out"), at="here", keep=("out",))
    batch = {"ids": torch.zeros(2)}
    with pytest.raises(AssertionError, match=r"batch\['ids'\] was modified"):
        P.call_unmodified("g", lambda b: b["ids"].add_(1), batch, names=("batch",), at="")


class _Config:  # a config object as transformers' are: attributes, and to_dict() of them
    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to_dict(self):
        return dict(self.__dict__)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "tied", False), r"^f: cfg.tied was modified in place, True -> False at here$"),
    (lambda c: setattr(c, "head_dim", 8), r"^f: cfg.head_dim was modified in place, None -> 8 at here$"),
    (lambda c: delattr(c, "hidden"), r"^f: cfg.hidden was modified in place, 16 -> None at here$"),
])
def test_a_config_is_compared_field_by_field(change, message):
    P.call_unmodified("f", lambda c: c.hidden * 2, _Config(hidden=16, tied=True), names=("cfg",), at="here")
    with pytest.raises(AssertionError, match=message):
        P.call_unmodified("f", change, _Config(hidden=16, tied=True), names=("cfg",), at="here")


def test_strided_views_hold_the_same_values():
    x = torch.arange(12.0).reshape(3, 4).requires_grad_()
    for how in ("slice", "transpose"):
        v = P.strided(x, how)
        assert torch.equal(v, x) and not v.is_contiguous() and v.requires_grad and v.is_leaf


def test_the_output_properties():
    x = torch.ones(3)
    with pytest.raises(AssertionError, match="shares its storage with the input x"):
        P.assert_no_alias("f", "y", x[1:], {"x": x}, "a")
    P.assert_no_alias("f", "y", x.clone(), {"x": x}, "a")
    with pytest.raises(AssertionError, match="attached to the autograd graph"):
        P.assert_detached("f", "loss", torch.ones(1, requires_grad=True) * 2, "a")
    with pytest.raises(AssertionError, match="is a bool, expected an int"):
        P.assert_type("f", "n", True, int, "a")
    with pytest.raises(AssertionError, match="cannot be written to a record"):
        P.assert_json("f", "row", {"x": math.inf}, "a")
    with pytest.raises(AssertionError, match=r"out\[1\] has 1 non-finite values"):
        P.assert_finite("f", "out", (torch.ones(1), torch.tensor([1.0, math.inf])), "a")


def test_assert_raises_wants_the_documented_error_neither_swallowed_nor_replaced():
    def raises(exc):
        def f(x):
            raise exc("x")
        return f

    P.assert_raises("f", raises(ValueError), (1,), ValueError, "x = 1", "a")
    with pytest.raises(AssertionError, match=r"^f: returned 2 for x = 1, expected ValueError \(do not swallow it\)"):
        P.assert_raises("f", lambda x: x + 1, (1,), ValueError, "x = 1", "a")
    with pytest.raises(AssertionError, match="raised KeyError for x = 1, expected ValueError"):
        P.assert_raises("f", raises(KeyError), (1,), ValueError, "x = 1", "a")
    with pytest.raises(NotImplementedError):
        P.assert_raises("f", raises(NotImplementedError), (1,), ValueError, "x = 1", "a")


def test_numbers_inside_a_list_or_dict_are_watched_too():
    def sorts(xs, d):
        xs.sort()
        return sum(xs)

    def grows(xs, d):
        d["extra"] = 1
        return 0

    with pytest.raises(AssertionError, match=r"xs\[0\] was modified in place"):
        P.call_unmodified("f", sorts, [3, 1, 2], {"a": 1}, names=("xs", "d"), at="here")
    with pytest.raises(AssertionError, match=r"d \(its length or keys\) was modified in place"):
        P.call_unmodified("f", grows, [1], {"a": 1}, names=("xs", "d"), at="here")
    assert P.call_unmodified("f", lambda xs, d: 1, [float("nan")], {"a": "s"}, names=("xs", "d"), at="here") == 1
