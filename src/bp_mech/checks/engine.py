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
- inputs unchanged, the same result for non-contiguous views of them, each lower dtype in, that dtype out;
- a tuple of the outputs (a lone output: itself), sharing no storage with an input or with each other, and
  carrying no autograd graph;
- global state restored, also when it raises: grad mode, inference mode, default dtype, autocast, torch's
  RNG (unless ``rng``), the train flags and hooks of modules passed in; the engine puts it back itself, and
  every check starts from one clean state (``clean``): no outcome depends on the order checks run in;
- ``NotImplementedError`` (an untouched stub) passed through as it is.

A failure is one line (``common``): ``<fn>: <what> differs from <ref>, max rel error E > TOL at <input>``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bp_mech.checks.common import assert_close, call, describe
from bp_mech.checks.properties import assert_finite, assert_type, call_unmodified, explore, one_thread, strided

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
    tol: float = 1e-10  # max relative error at float64
    dtypes: dict = field(default_factory=dict)  # lower dtype -> its tolerance against the float64 reference
    defaults: dict = field(default_factory=dict)  # argument -> documented default (left out when equal)
    strides: bool = True  # non-contiguous views of the tensor inputs give the same result
    returns: type | None = None  # a lone non-tensor result's exact type (int, float, bool)
    keep: tuple[str, ...] = ()  # arguments the docstring lets it modify
    rng: bool = False  # it may draw from torch's global RNG
    note: Callable[[dict], str] | None = None  # case -> what is special about it, for the message
    promise: Callable | None = None  # (case, call, at) -> asserts a promise beyond the values (memory)


# --- global state ---------------------------------------------------------------------------


def state(args: dict) -> dict:
    """The global state a graded function must leave as it found it, with the modules among ``args``.

    Args:
        args: the function's arguments, by name.

    Returns:
        {what, in words: value}; two calls compare equal when nothing changed.

    Example:
        >>> s = state({})
        >>> s["grad mode"], s == state({})
        (True, True)
    """
    s = {"grad mode": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
         "default dtype": torch.get_default_dtype(),
         "CPU autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))}
    s["torch RNG state"] = bytes(torch.random.get_rng_state().numpy())
    for sub_name, sub, hooks in _modules(args):
        s[f"{sub_name}.training"] = sub.training
        s.update({f"{sub_name}'s {h.strip('_').replace('_', ' ')}": tuple(getattr(sub, h)) for h in hooks})
    return s


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _modules(args: dict):
    return [(n, sub, HOOKS) for name, a in args.items() if isinstance(a, torch.nn.Module)
            for n, sub in a.named_modules(prefix=name)]


def restore(before: dict, args: dict) -> None:
    """Put back the global state ``before`` (``state(args)``): flags, dtypes, RNG, train flags, hooks.

    Args:
        before: what ``state(args)`` gave before the call.
        args: the same arguments.

    Returns:
        None; the process's torch state and the modules in ``args`` are as ``before``.

    Example:
        >>> s = state({}); _ = torch.set_grad_enabled(False); restore(s, {}); torch.is_grad_enabled()
        True
    """
    torch.set_grad_enabled(before["grad mode"])
    torch.set_default_dtype(before["default dtype"])
    torch.set_autocast_enabled("cpu", before["CPU autocast"][0])
    torch.set_autocast_dtype("cpu", before["CPU autocast"][1])
    torch.random.set_rng_state(torch.frombuffer(bytearray(before["torch RNG state"]), dtype=torch.uint8))
    for sub_name, sub, hooks in _modules(args):
        sub.training = before.get(f"{sub_name}.training", sub.training)
        for h in hooks:
            keep = before.get(f"{sub_name}'s {h.strip('_').replace('_', ' ')}", ())
            for key in [k for k in getattr(sub, h) if k not in keep]:
                del getattr(sub, h)[key]


CLEAN = {"grad mode": True, "default dtype": torch.float32, "CPU autocast": (False, torch.bfloat16)}


@contextlib.contextmanager
def clean():
    """Run a check from one clean state: grad mode on, float32 default, autocast off, torch's RNG one draw
    past seed 0, one thread; the caller's state is put back after, whatever happened.

    Yields:
        None.

    Example:
        >>> torch.set_default_dtype(torch.float64)
        >>> with clean():
        ...     torch.get_default_dtype()
        torch.float32
        >>> torch.get_default_dtype()
        torch.float64
        >>> torch.set_default_dtype(torch.float32)
    """
    caller = state({})
    with one_thread():
        try:
            torch.manual_seed(0), torch.rand(1)  # one draw past a seed: a function that reseeds changes it
            restore({**CLEAN, "torch RNG state": bytes(torch.random.get_rng_state().numpy())}, {})
            yield
        finally:
            restore(caller, {})


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


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b  # (an int 1 is not a default of 1.0)


# --- the derived checks ---------------------------------------------------------------------


def _words(k: Contract, case: dict, args: dict) -> str:
    def one(name, v):
        if torch.is_tensor(v):
            return f"{name} shape {tuple(v.shape)}"
        if name in k.defaults and _same(v, k.defaults[name]):
            return f"{name} left out (default {v!r})"
        return f"{name} {v:g}" if isinstance(v, float) else f"{name} {v!r}"
    return ", ".join(one(*kv) for kv in args.items()) + (f" ({k.note(case)})" if k.note and k.note(case) else "")


def _compare(k: Contract, got, want, tol: float, at: str, dtype, args: dict) -> None:
    """Value, exact type, dtype, no graph, and no storage shared with an input or another output."""
    if k.returns is not None:
        assert_type(k.fn, k.outs[0], got, k.returns, at)
        assert got == want[0], f"{k.fn}: {k.outs[0]} is {got!r}, {k.ref_name} gives {want[0]!r} at {at}"
        return
    if len(k.outs) > 1 and (type(got) is not tuple or len(got) != len(k.outs)):
        raise AssertionError(f"{k.fn}: returned {describe(got)}, expected a tuple ({', '.join(k.outs)}) at {at}")
    seen = {n: a for n, a in args.items() if torch.is_tensor(a) and a.numel()}
    for name, o, w in zip(k.outs, (got,) if len(k.outs) == 1 else got, want):
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
    f = getattr(m, k.fn)
    args = k.inputs(case)
    want = k.ref(**args)
    at = _words(k, case, args)
    _compare(k, _guarded(k, f, args, at), want, k.tol, at, _dtype(args), args)
    if k.promise is not None:
        k.promise(case, lambda: call(k.fn, f, *args.values(), at=at), at)  # no snapshots in its measure
    view, dims = case.get("view", "slice"), [n for n, a in args.items() if torch.is_tensor(a) and a.dim()]
    if k.strides and dims:
        views = {n: strided(a, view) if n in dims else a for n, a in args.items()}
        at_v = f"{', '.join(dims)} as non-contiguous {view} views, {at}"
        _compare(k, _guarded(k, f, views, at_v), want, k.tol, at_v, _dtype(args), views)
    for dtype, tol in ({} if case.get("float64_only") else k.dtypes).items():
        low = {n: a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for n, a in args.items()}
        at_d = f"{str(dtype).removeprefix('torch.')} inputs, {at}"
        _compare(k, _guarded(k, f, low, at_d), want, tol, at_d, dtype, low)


def _dtype(args: dict):
    return next((a.dtype for a in args.values() if torch.is_tensor(a) and a.is_floating_point()), None)


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
