"""One contract engine: a graded function is declared once, and every check of it is derived.

A ``Contract`` states what the exercise's docstring promises: how a case (a dict: seed, shapes, the special
inputs a docstring names) becomes the arguments (``inputs``, float64 tensors, in call order), an independent
``ref`` (float64 autograd, a brute force, a real measurement: never the answer file), the outputs' names, the
documented ``defaults``, the lower ``dtypes`` admitted (with their tolerance), and the cases: named lists of
explicit examples (``""`` the main one; another, ``"tiny_rows"``, is its own check ``check_<fn>__tiny_rows``)
and a hypothesis strategy ``draw`` whose derandomized cases follow the main examples. On every case ``check``
holds the solution, for every function alike, to:

- the value against ``ref`` (finite where it is; a lone non-tensor result of exactly the type ``returns``);
- the documented defaults left out, as a reader calls it (an argument equal to its default is not passed);
- inputs unchanged (a config object field by field), the same result for non-contiguous views of them, each
  lower dtype in, that dtype out, and with each ``orderless`` argument reversed (list items, dict keys);
- a tuple of the outputs (a lone output: itself), sharing no storage with an input or with each other, and
  carrying no autograd graph;
- global state restored, also when it raises: grad mode, inference mode, default dtype, autocast, torch's
  RNG (unless ``rng``), the train flags and hooks of modules passed in; the engine puts it back itself, and
  every check starts from one clean state (``clean``): no outcome depends on the order checks run in;
- ``NotImplementedError`` (an untouched stub) passed through as it is;
- where ``ref`` gives ``Raises(error, why)`` (an input the docstring refuses): that exception, and no other.

Results that are not tensors (a count, a list of weights, a dict of bytes) are compared element by element, each
of exactly the reference's type (``common.assert_same``); tensors inside lists and dicts are viewed, cast and
watched as top-level ones are. A class (or a function used through a protocol) is graded through ``use``: a
driver that builds it, calls its methods in the documented order and returns what a reader would observe.

A failure is one line (``common``): ``<fn>: <what> differs from <ref>, max rel error E > TOL at <input>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bp_mech.checks.common import CheckFailed, assert_close, assert_same, call, describe
from bp_mech.checks.global_state import clean, restore, state
from bp_mech.checks.properties import assert_finite, assert_type, call_unmodified, explore, strided

DRAWN = 8  # drawn cases per function, after its explicit examples: enough to vary shapes and layouts; fast


@dataclass(frozen=True)
class Contract:
    """The declaration of one graded function (see the module docstring).

    Example:
        >>> k = Contract("double", lambda c: {"x": torch.full((2,), c["v"], dtype=torch.float64)},
        ...              lambda x: (2 * x,), ("y",), examples={"": [{"v": 1.0}]}, ref_name="2 x")
        >>> [c.__name__ for c in check(k)]
        ['check_double']
    """

    fn: str  # the exercise function (or class) it grades
    inputs: Callable[[dict], dict]  # case -> {argument: value}, in call order, float64 tensors
    ref: Callable[..., tuple]  # the independent reference: the expected outputs, one per name of outs
    outs: tuple[str, ...]  # the outputs' names, as the docstring's Returns gives them
    examples: dict = field(default_factory=dict)  # aspect ("" main) -> explicit cases tried every time
    draw: Any = None  # hypothesis strategy of cases (the main check's drawn ones), or None
    ref_name: str = "float64 autograd"  # what the reference is, in the failure message
    tol: float = 1e-10  # max relative error at float64 (a case's "tol" sets its own: an ill-conditioned case)
    dtypes: dict = field(default_factory=dict)  # lower dtype -> its tolerance against the float64 reference
    defaults: dict = field(default_factory=dict)  # argument -> documented default (left out when equal)
    strides: bool = True  # non-contiguous views of the tensor inputs give the same result
    returns: type | None = None  # a lone non-tensor result's exact type (int, float, bool, list, dict)
    use: Callable | None = None  # the graded object -> the callable the checks call on ``inputs`` (a class's driver)
    keep: tuple[str, ...] = ()  # arguments the docstring lets it modify
    orderless: tuple[str, ...] = ()  # arguments whose order the docstring says does not matter
    rng: bool = False  # it may draw from torch's global RNG
    note: Callable[[dict], str] | None = None  # case -> what is special about it, for the message
    promise: Callable | None = None  # (case, call, at) -> asserts a promise beyond the values (memory)


@dataclass(frozen=True)
class Raises:
    """What ``ref`` gives for an input the docstring refuses: the call must raise ``error`` (not another, not
    return), with the global state restored.

    Example:
        >>> Raises(ValueError, "k = 0").error.__name__
        'ValueError'
    """

    error: type  # the documented exception
    why: str  # what is wrong with the input, in words


def _raising(k: Contract, f, expect: Raises):
    """``f`` made to return None when it raises ``expect.error``, and to fail otherwise."""
    def g(*args, **kwargs):
        try:
            got = f(*args, **kwargs)
        except expect.error:
            return None
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 (the learner's code may raise anything)
            raise CheckFailed(f"{k.fn}: raised {type(e).__name__} for {expect.why}, expected "
                              f"{expect.error.__name__}") from e
        raise CheckFailed(f"{k.fn}: returned {describe(got)} for {expect.why}, expected {expect.error.__name__}")
    return g


# --- the call, guarded ------------------------------------------------------------------------


def _guarded(k: Contract, f, args: dict, at: str):
    """``f`` called on ``args`` (documented defaults left out), inputs watched, global state compared and
    restored; returns what ``f`` returned."""
    names = list(args)
    left = [n for n in names if n in k.defaults and _same(args[n], k.defaults[n])]  # left out, as a reader does
    cut = names.index(left[0]) if left else len(names)  # the arguments after the first left out: by keyword
    kw = {n: args[n] for n in names[cut:] if n not in left}
    before = state(args)
    try:
        return call_unmodified(k.fn, f, *(args[n] for n in names[:cut]), names=(*names[:cut], *kw), at=at,
                               keep=k.keep, **kw)
    except NotImplementedError:
        restore(before, args)  # a stub: "not done yet", whatever it changed
        raise
    finally:
        _leaks(k, before, args, at)


def _leaks(k: Contract, before: dict, args: dict, at: str) -> None:
    """Fail when the global state differs from ``before``; put it back either way."""
    after = state(args)
    restore(before, args)
    for what, value in before.items():
        if after[what] != value and (what != "torch RNG state" or not k.rng):
            old, new = ("its state", "another") if what == "torch RNG state" else (value, after[what])
            raise AssertionError(f"{k.fn}: left the {what} changed ({old} before, {new} after; restore it, also "
                                 f"when raising) at {at}")


def _tensors(x):
    """The tensors in ``x``, also inside lists, tuples and dicts (a module's are its own)."""
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return [t for v in x.values() for t in _tensors(v)] if isinstance(x, dict) else []


def _map(x, fn):
    """``x`` with every tensor in it (also inside lists, tuples and dicts) replaced by ``fn(tensor)``."""
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    return {key: _map(v, fn) for key, v in x.items()} if isinstance(x, dict) else x


def _reversed(x):
    """``x`` in reverse order: a list's items (each as it is), a dict's keys at every level of dicts."""
    if isinstance(x, dict):
        return {key: _reversed(v) if isinstance(v, dict) else v for key, v in reversed(x.items())}
    return type(x)(reversed(x)) if isinstance(x, list) else x


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b  # (an int 1 is not a default of 1.0)


# --- the derived checks ---------------------------------------------------------------------


def _words(k: Contract, case: dict, args: dict) -> str:
    def one(name, v):
        if torch.is_tensor(v):
            return f"{name} shape {tuple(v.shape)}"
        if _tensors(v) or isinstance(v, torch.nn.Module):
            return f"{name} {_brief(v)}"
        if callable(getattr(v, "to_dict", None)):  # a config: the note says what is special about it
            return f"{name} {describe(v)}"
        if name in k.defaults and _same(v, k.defaults[name]):
            return f"{name} left out (default {v!r})"
        return f"{name} {v:g}" if isinstance(v, float) else f"{name} {v!r}"
    return ", ".join(one(*kv) for kv in args.items()) + (f" ({k.note(case)})" if k.note and k.note(case) else "")


def _brief(v) -> str:
    if isinstance(v, torch.nn.Module):
        return f"a {type(v).__name__}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{key!r}: {_brief(x)}" for key, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_brief(x) for x in v) + "]"
    return f"shape {tuple(v.shape)}" if torch.is_tensor(v) else repr(v)


def _compare(k: Contract, got, want, tol: float, at: str, dtype, args: dict) -> None:
    """Value, exact type, dtype, no graph, and no storage shared with an input or another output."""
    if k.returns is not None:
        assert_type(k.fn, k.outs[0], got, k.returns, at)
    if len(k.outs) > 1 and (type(got) is not tuple or len(got) != len(k.outs)):
        raise AssertionError(f"{k.fn}: returned {describe(got)}, expected a tuple ({', '.join(k.outs)}) at {at}")
    seen = {n: t for n, a in args.items() if n not in k.keep for t in _tensors(a) if t.numel()}
    for name, o, w in zip(k.outs, (got,) if len(k.outs) == 1 else got, want):
        if not torch.is_tensor(w):
            assert_same(k.fn, name, o, w, tol=tol, ref=k.ref_name, at=at, dtype=dtype)
            continue
        if torch.is_tensor(o) and o.shape == w.shape and bool(torch.isfinite(w).all()):
            assert_finite(k.fn, name, o, at)
        assert_close(k.fn, name, o, w, tol=tol, ref=k.ref_name, at=at, dtype=dtype)
        if o.requires_grad:
            raise AssertionError(f"{k.fn}: {name} is attached to the autograd graph (requires_grad=True), "
                                 f"expected a detached value at {at}")
        for n, a in seen.items():
            if o.numel() and o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
                kind = "the input " if n in args else ""
                raise AssertionError(f"{k.fn}: {name} shares its storage with {kind}{n} (return a new tensor; "
                                     f"a later in-place update of one would change the other) at {at}")
        seen[name] = o


def _hold(k: Contract, m, case: dict) -> None:
    """Every derived property on one case."""
    f = k.use(getattr(m, k.fn)) if k.use is not None else getattr(m, k.fn)
    args = k.inputs(case)
    want = k.ref(**args)
    at = _words(k, case, args)
    if isinstance(want, Raises):  # a refused input: the documented exception, state restored, nothing else
        try:
            return _guarded(k, _raising(k, f, want), args, at)
        except CheckFailed as e:
            raise CheckFailed(f"{e} at {at}") from e.__cause__
    tol = case.get("tol", k.tol)
    _compare(k, _guarded(k, f, args, at), want, tol, at, _dtype(args), args)
    if k.promise is not None:
        k.promise(case, lambda: call(k.fn, f, *args.values(), at=at), at)  # no snapshots in its measure
    view = case.get("view", "slice")
    dims = [n for n, a in args.items() if any(t.dim() for t in _tensors(a))]
    if k.strides and dims:
        views = {n: _map(a, lambda t: strided(t, view) if t.dim() else t) if n in dims else a for n, a in args.items()}
        at_v = f"{', '.join(dims)} as non-contiguous {view} views, {at}"
        _compare(k, _guarded(k, f, views, at_v), want, tol, at_v, _dtype(args), views)
    for n in k.orderless:
        flipped, at_o = {**args, n: _reversed(args[n])}, f"{n} in reverse order, {at}"
        _compare(k, _guarded(k, f, flipped, at_o), want, tol, at_o, _dtype(args), flipped)
    for dtype, low_tol in ({} if case.get("float64_only") else k.dtypes).items():
        low = {n: _map(a, lambda t: t.to(dtype) if t.is_floating_point() else t) for n, a in args.items()}
        at_d = f"{str(dtype).removeprefix('torch.')} inputs, {at}"
        _compare(k, _guarded(k, f, low, at_d), want, low_tol, at_d, dtype, low)


def _dtype(args: dict):
    return next((t.dtype for a in args.values() for t in _tensors(a) if t.is_floating_point()), None)


def check(k: Contract) -> list[Callable]:
    """The checks of one declaration: ``check_<fn>`` (the main examples, then ``DRAWN`` drawn cases) and one
    ``check_<fn>__<aspect>`` per other list of examples; each takes the solutions module and raises
    AssertionError (one line) on a broken promise, NotImplementedError on a stub. ``.tests`` names ``fn``.

    Args:
        k: the declaration.

    Returns:
        the check functions, the main one first.

    Example:
        >>> k = Contract("f", lambda c: {"x": torch.ones(2, dtype=torch.float64)}, lambda x: (x,), ("y",),
        ...              examples={"": [{}], "zeros": [{}]})
        >>> [c.tests for c in check(k)]
        ['f', 'f']
    """
    out = []
    for aspect in dict.fromkeys(["", *k.examples]):
        def run(m, aspect=aspect):
            with clean():
                cases = tuple(k.examples.get(aspect, ()))
                if aspect == "" and k.draw is not None:  # the examples, then the drawn cases: one list
                    explore(k.draw, lambda c: _hold(k, m, c), examples=DRAWN, corners=cases)
                for c in cases if aspect or k.draw is None else ():
                    _hold(k, m, c)
        run.__name__ = run.__qualname__ = f"check_{k.fn}" + (f"__{aspect}" if aspect else "")
        run.tests = k.fn
        out.append(run)
    return out


def checks(*contracts: Contract) -> list[Callable]:
    """All the checks of a chapter's declarations, in order (``check`` for each).

    Args:
        contracts: the chapter's declarations, in the exercise file's order.

    Returns:
        the list a chapter's ``CHECKS`` is.

    Example:
        >>> checks()
        []
    """
    return [c for k in contracts for c in check(k)]
