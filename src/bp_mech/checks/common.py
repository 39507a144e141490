"""What the exercise checks share: the one-line failure message ``bp-mech check`` prints.

Every failure reads ``<function>: <what> differs from <reference>, max rel error E > TOL at <input>``
(conventions.md). A solution that crashes on some input (a hard-coded 3-D shape, a Python ``min`` of
a tensor, ...) fails the same way, naming the input, through ``call``; ``NotImplementedError`` (an
untouched stub) passes through unchanged. inf and NaN pass only where the reference has them, exactly.
"""

from __future__ import annotations

import math

import torch

from bp_mech.bench.compare import relative_error


class CheckFailed(AssertionError):
    """A check's own verdict, raised inside ``call`` (a driver of a class, an expected exception): passed on as it is."""


def call(fn: str, f, *args, at: str, **kwargs):
    """``f(*args, **kwargs)``; any exception but ``NotImplementedError`` (and a ``CheckFailed``) becomes one
    AssertionError line."""
    try:
        return f(*args, **kwargs)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise AssertionError(f"{fn}: raised {type(e).__name__} at {at}: {first}") from e


def int_as_float(fn: str, got, at: str = "") -> float:
    """A predicted byte count, which must be exactly an ``int``, as a float for a relative comparison."""
    if type(got) is not int:
        raise CheckFailed(f"{fn}: the prediction is {describe(got)}, expected an int (bytes){at}")
    return float(got)


def autograd_grads(fn, inputs, dy) -> tuple:
    """The reference: autograd's gradients of ``fn(*inputs)`` for output gradient ``dy``, w.r.t. fresh
    leaf copies of ``inputs``."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, dy)


def randn64(g: torch.Generator, *shape) -> torch.Tensor:
    """A float64 standard-normal tensor of ``shape`` drawn from ``g``."""
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def describe(x) -> str:
    """What a solution returned, in words: ``a float32 tensor of shape (2, 3)``, ``an int``, ``None``."""
    if x is None:
        return "None"
    if torch.is_tensor(x):
        grad = " with a graph" if x.requires_grad else ""
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}{grad}"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def assert_close(fn: str, what: str, got, want: torch.Tensor, *, tol: float, ref: str, at: str,
                 dtype: torch.dtype | None = None) -> None:
    """``got`` is a tensor of ``want``'s shape (and of ``dtype``, when given) within ``tol`` relative error."""
    if got is None:
        raise AssertionError(f"{fn}: {what} is None, expected a tensor of shape {tuple(want.shape)} at {at}")
    if not torch.is_tensor(got):
        raise AssertionError(f"{fn}: {what} is {describe(got)}, expected a tensor at {at}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{fn}: {what} has shape {tuple(got.shape)}, {ref} gives {tuple(want.shape)} at {at}")
    if dtype is not None and got.dtype != dtype:
        raise AssertionError(f"{fn}: {what} has dtype {got.dtype}, expected {dtype} at {at}")
    if got.is_floating_point() and not (want.is_floating_point() or want.is_complex()):
        raise AssertionError(f"{fn}: {what} has dtype {got.dtype}, expected integers ({want.dtype}) at {at}")
    finite = torch.isfinite(want) if want.is_floating_point() else None
    if finite is not None and not bool(finite.all()):  # inf and NaN where the reference has them, exactly
        g, w = got.detach()[~finite].double(), want[~finite].double()
        if not bool(((g == w) | (torch.isnan(g) & torch.isnan(w))).all()):
            raise AssertionError(f"{fn}: {what} differs from {ref} where it is not finite (inf or NaN expected: "
                                 f"{w.tolist()[:4]}, got {g.tolist()[:4]}) at {at}")
        got, want = got.detach()[finite], want[finite]
    err = relative_error(got, want)
    assert err <= tol, f"{fn}: {what} differs from {ref}, max rel error {err:.1e} > {tol:g} at {at}"


def assert_all_close(fn: str, names, got, want, *, tol: float, ref: str, at: str) -> None:
    """``got`` is a tuple of tensors, one per name, each close to its ``want`` (``assert_close``)."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        raise AssertionError(f"{fn}: returned {describe(got)}, expected a tuple ({', '.join(names)}) at {at}")
    for name, a, w in zip(names, got, want):
        assert_close(fn, name, a, w, tol=tol, ref=ref, at=at)


def assert_value(fn: str, what: str, got, want: float, *, tol: float, ref: str, at: str) -> None:
    """A number (Python or 0-dim tensor) within ``tol`` of ``want``, relative (absolute when want is 0)."""
    try:
        value = float(got.detach() if torch.is_tensor(got) else got)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{fn}: {what} is {type(got).__name__} {got!r:.60}, expected a number at {at}") from None
    if not math.isfinite(want) and (value == want or (math.isnan(value) and math.isnan(want))):
        return  # inf where the reference has inf (of its sign), NaN where it has NaN
    err = abs(value - want) / (abs(want) if want else 1.0)
    assert err <= tol, (f"{fn}: {what} is {value:.8g}, {ref} gives {want:.8g} (rel error {err:.1e} > {tol:g}) "
                        f"at {at}")


def assert_same(fn: str, what: str, got, want, *, tol: float, ref: str, at: str, dtype=None) -> None:
    """``got`` is ``want`` in kind and value: a tensor within ``tol`` (of ``dtype`` when given and ``want`` is
    floating), a float within ``tol`` relative (absolute at 0), an int, bool, str or None exactly, each of exactly
    ``want``'s type (a bool is not an int, a 0-dim tensor not a float); a list, tuple or dict element by element."""
    if torch.is_tensor(want):
        return assert_close(fn, what, got, want, tol=tol, ref=ref, at=at,
                            dtype=dtype if want.is_floating_point() else None)
    if type(got) is not type(want):
        kind = type(want).__name__
        raise AssertionError(f"{fn}: {what} is {describe(got)}, expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
                             f" at {at}")
    if isinstance(want, (list, tuple, dict)):
        if len(got) != len(want) or (isinstance(want, dict) and set(got) != set(want)):
            keys = (lambda d: sorted(map(str, d))) if isinstance(want, dict) else len
            raise AssertionError(f"{fn}: {what} has {keys(got)} entries, {ref} gives {keys(want)} at {at}")
        for key, w in (want.items() if isinstance(want, dict) else enumerate(want)):
            assert_same(fn, f"{what}[{key!r}]", got[key], w, tol=tol, ref=ref, at=at, dtype=dtype)
    elif isinstance(want, float):
        assert_value(fn, what, got, want, tol=tol, ref=ref, at=at)
    elif got != want:
        raise AssertionError(f"{fn}: {what} is {got!r:.80}, {ref} gives {want!r:.80} at {at}")
