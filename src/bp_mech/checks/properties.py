"""The contract behind the mathematics: what every exercise check holds a solution to.

A result that matches float64 autograd on a few well-behaved inputs is not yet a correct solution.
A grader who did not write the answer also checks what the docstring promises around the result:

- ``explore``: the property is tried on cases *drawn* by hypothesis (seeded, derandomized, no example
  database, a bounded number of examples), and a failure is reported on its minimal counterexample;
- ``call_unmodified``: the inputs are not modified (clones compared before and after, NaN-aware; a config
  object field by field, ``to_dict()``);
- ``strided``: the same values in a non-contiguous view (a transpose, a slice of a larger storage);
- ``assert_no_alias``, ``assert_detached``, ``assert_type``, ``assert_json``, ``assert_finite``: what comes
  back does not share an input's storage, carries no autograd graph, is exactly the documented type,
  survives ``json.dumps`` and is finite where the mathematics is.

Every failure is one line in words, ``<function>: <what>, <by how much> at <input>`` (``common``), which is
what ``bp-mech check NN`` prints:

    >>> import torch
    >>> def scale_(x, dy):
    ...     dy.mul_(2.0)  # a classic slip: the upstream gradient reused as a buffer
    ...     return x * dy
    >>> x, dy = torch.ones(3), torch.ones(3)
    >>> try:
    ...     call_unmodified("scale_", scale_, x, dy, names=("x", "dy"), at="shape (3,)")
    ... except AssertionError as e:
    ...     print(e)
    scale_: dy was modified in place, max change 1 at shape (3,)
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from bp_mech.checks.common import call, describe

EXAMPLES = 12  # cases per explored property: enough to reach shapes, magnitudes and dtypes; the suite stays < 60 s


@contextlib.contextmanager
def one_thread():
    """One intra-op thread, the caller's count restored after: a check's tensors are tiny, and on a busy
    two-core machine more threads only wait for each other (ten times slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def explore(strategy, body: Callable[[Any], None], *, examples: int = EXAMPLES, corners: tuple = ()) -> None:
    """Run ``body(case)`` on ``examples`` cases drawn from the hypothesis ``strategy``, on one thread.

    Derandomized (the same cases on every machine and every run), no example database, no deadline,
    quiet, no "explain" phase (it traces every line and takes tens of seconds). A failing case is shrunk
    to a minimal one (``SHRINK``) and its exception re-raised, so the learner reads the smallest input
    that breaks the contract. ``NotImplementedError`` (an untouched stub) is raised at once, unshrunk.
    ``corners``: cases tried first, every time, whatever is drawn (the corners a contract names).
    """
    from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings

    phases = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if SHRINK else ())

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False, phases=phases)
    @given(strategy)
    def run(case):
        if not stub:
            try:
                body(case)
            except NotImplementedError as e:  # a stub: reported as it is, not shrunk as a failure
                stub.append(e)

    for case in reversed(corners):
        run = example(case)(run)
    stub: list[NotImplementedError] = []
    with one_thread():
        run()
    if stub:
        raise stub[0]


SHRINK = True  # the mutant tests turn it off (tests/conftest.py): a mutant only has to be rejected


# --- inputs left as they were ---------------------------------------------------------------


def _snapshot(x):
    """A deep copy of the tensors in ``x`` (nested lists, tuples, dicts; a parameter's ``.grad``; a
    module's state), or None where there is nothing to compare."""
    if torch.is_tensor(x):
        grad = x.grad.detach().clone() if x.is_leaf and x.grad is not None else None
        return ("tensor", x.detach().clone(), grad)
    if isinstance(x, torch.nn.Module):
        return ("module", {k: v.detach().clone() for k, v in x.state_dict().items()})
    if isinstance(x, (list, tuple)):
        return ("seq", [_snapshot(v) for v in x], len(x))
    if isinstance(x, dict):
        return ("dict", {k: _snapshot(v) for k, v in x.items()}, len(x))
    if callable(getattr(x, "to_dict", None)):  # a config (transformers' PretrainedConfig): its fields
        return ("config", x.to_dict())
    return ("value", x) if isinstance(x, (int, float, str, bool)) and not isinstance(x, torch.Tensor) else None


def max_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """The largest change between two tensors of one shape, NaN-aware (NaN -> NaN is no change, a value
    that became NaN or inf is an infinite change); ``inf`` when shape or dtype changed."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return math.inf
    a, b = before.double(), after.detach().double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return 0.0
    diff = (a - b).abs().masked_fill(same, 0.0)
    return float(diff.nan_to_num(nan=math.inf).max())


def _changes(name: str, snap, x) -> list[tuple[str, float]]:
    if snap is None:
        return []
    kind = snap[0]
    if kind == "tensor":
        out = [(name, max_change(snap[1], x))]
        if snap[2] is not None:
            out.append((f"{name}.grad", max_change(snap[2], x.grad) if x.grad is not None else math.inf))
        return out
    if kind == "module":
        state = x.state_dict()
        return [(f"{name}.{k}", max_change(v, state[k]) if k in state else math.inf) for k, v in snap[1].items()]
    if kind == "config":  # a field changed, added or removed: named with its values
        now = x.to_dict()
        return [(f"{name}.{k}", f"{snap[1].get(k)!r} -> {now.get(k)!r}") for k in sorted(set(snap[1]) | set(now))
                if snap[1].get(k) != now.get(k)]
    if kind == "value":  # a number or a string inside a list or dict (a top-level one cannot change)
        return [(name, 0.0 if snap[1] == x or (snap[1] != snap[1] and x != x) else math.inf)]
    if len(x) != snap[2] or (kind == "dict" and set(x) != set(snap[1])):
        return [(f"{name} (its length or keys)", math.inf)]
    if kind == "seq":
        return [c for i, (s, v) in enumerate(zip(snap[1], x)) for c in _changes(f"{name}[{i}]", s, v)]
    return [c for k, s in snap[1].items() for c in _changes(f"{name}[{k!r}]", s, x[k])]


def call_unmodified(fn: str, f, *args, names: tuple[str, ...], at: str, keep: tuple[str, ...] = (), **kwargs):
    """``f(*args, **kwargs)`` through ``common.call``; fails when an argument (or a tensor inside it) changed.

    ``names`` names the positional arguments, then the keyword ones in order; ``keep`` lists those the
    docstring allows the function to modify (an in-place update's target).
    """
    named = dict(zip(names, list(args) + list(kwargs.values())))
    snaps = {k: _snapshot(v) for k, v in named.items() if k not in keep}
    out = call(fn, f, *args, at=at, **kwargs)
    for k, snap in snaps.items():
        for what, change in _changes(k, snap, named[k]):
            if isinstance(change, str) or change > 0:  # a config's field: its old and new value, in words
                how = change if isinstance(change, str) else f"max change {change:.2g}"
                raise AssertionError(f"{fn}: {what} was modified in place, {how} at {at}")
    return out


# --- views and storages --------------------------------------------------------------------


def strided(t: torch.Tensor, how: str = "slice") -> torch.Tensor:
    """The values of ``t`` in a non-contiguous view. ``"slice"``: every other element of a storage twice
    as large (stride 2 in the last dimension); ``"transpose"``: stored transposed in its last two
    dimensions (``t.mT.contiguous().mT``; 2-D and more). Gradient tracking is kept as it was.

    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> v = strided(x)
    >>> torch.equal(v, x), v.is_contiguous(), v.stride()
    (True, False, (6, 2))
    >>> strided(x, "transpose").stride()
    (1, 2)
    """
    with torch.no_grad():
        if how == "transpose" and t.dim() >= 2:
            view = t.detach().mT.contiguous().mT
        else:
            big = t.detach().new_zeros(*t.shape[:-1], 2 * t.shape[-1]) if t.dim() else t.detach().new_zeros(2)
            view = big[..., ::2] if t.dim() else big[0]
            view.copy_(t.detach())
    return view.requires_grad_(t.requires_grad) if t.is_leaf else view


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def assert_no_alias(fn: str, what: str, out, inputs: dict, at: str) -> None:
    """``out`` (a tensor, or a tuple of them) shares no storage with any tensor in ``inputs`` (name -> tensor)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for o in outs:
        if not torch.is_tensor(o) or o.numel() == 0:
            continue
        for name, x in inputs.items():
            if torch.is_tensor(x) and x.numel() and _storage(o) == _storage(x):
                raise AssertionError(f"{fn}: {what} shares its storage with the input {name} (return a new tensor; "
                                     f"a later in-place update of one would change the other) at {at}")


def assert_detached(fn: str, what: str, out, at: str) -> None:
    """``out`` carries no autograd graph (``requires_grad`` False): a value to log, not to differentiate."""
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if torch.is_tensor(o) and o.requires_grad:
            raise AssertionError(f"{fn}: {what} is attached to the autograd graph (requires_grad=True), expected a "
                                 f"detached value at {at}")


def assert_type(fn: str, what: str, got, expected: type | tuple[type, ...], at: str) -> None:
    """``type(got)`` is exactly one of ``expected``: a ``bool`` is not an ``int``, a 0-dim tensor not a ``float``."""
    types = expected if isinstance(expected, tuple) else (expected,)
    if type(got) not in types:
        names = " or ".join(t.__name__ for t in types)
        raise AssertionError(f"{fn}: {what} is {describe(got)}, expected {'an' if names[0] in 'aeiou' else 'a'} "
                             f"{names} at {at}")


def assert_json(fn: str, what: str, got, at: str) -> None:
    """``got`` survives ``json.dumps`` unchanged in kind (a value a record can store)."""
    try:
        json.dumps(got, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{fn}: {what} cannot be written to a record ({e}) at {at}") from None


def assert_finite(fn: str, what: str, got, at: str) -> None:
    """Every value of ``got`` (a tensor, a number, or a tuple of them) is finite."""
    for i, o in enumerate(got if isinstance(got, (tuple, list)) else (got,)):
        name = what if not isinstance(got, (tuple, list)) else f"{what}[{i}]"
        if torch.is_tensor(o):
            bad = (~torch.isfinite(o.detach())).sum().item() if o.is_floating_point() else 0
            if bad:
                raise AssertionError(f"{fn}: {name} has {bad} non-finite values where the mathematics is finite at {at}")
        elif isinstance(o, float) and not math.isfinite(o):
            raise AssertionError(f"{fn}: {name} is {o} where the mathematics is finite at {at}")


def assert_raises(fn: str, f, args, error: type, what: str, at: str) -> None:
    """``f(*args)`` raises ``error``: the documented exception propagates, it is not swallowed or replaced.
    ``NotImplementedError`` (a stub) passes through."""
    try:
        got = f(*args)
    except error:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 (the learner's code may raise anything)
        raise AssertionError(f"{fn}: raised {type(e).__name__} for {what}, expected {error.__name__} at {at}") from e
    raise AssertionError(f"{fn}: returned {got!r:.80} for {what}, expected {error.__name__} (do not swallow "
                         f"it) at {at}")
