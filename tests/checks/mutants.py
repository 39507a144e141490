"""Wrong solutions of the kinds a contract check must reject, built around a right one.

Each wrapper takes a correct function and returns one that gives the right numbers on the easy inputs
but breaks one documented property (``bp_mech.checks.properties``). Use them with ``conftest.mutant``:

    bad = mutant("ex09_local_backward", silu_backward=modifies_input(answer.silu_backward, 1))
    with pytest.raises(AssertionError, match="dy was modified in place"):
        ex09.check_silu_backward__contract(bad)
"""

import functools
import inspect

import torch


def modifies_input(f, index: int, how=lambda t: t.mul_(2.0)):
    """Right result, then the positional argument ``index`` is overwritten in place (a reused buffer)."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        out = f(*args, **kwargs)
        target = args[index]
        with torch.no_grad():
            how(target if torch.is_tensor(target) else target[0])
        return out
    return g


def contiguous_only(f):
    """Raises on non-contiguous tensors, as ``x.view(-1, C)`` does (a solution tried on fresh tensors only)."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        for a in list(args) + list(kwargs.values()):
            if torch.is_tensor(a) and not a.is_contiguous():
                raise RuntimeError("view size is not compatible with input tensor's size and stride")
        return f(*args, **kwargs)
    return g


def storage_order_only(f):
    """Reads every tensor argument in storage order (``as_strided`` over ``t.stride()`` of a contiguous
    tensor): right on contiguous inputs, silently wrong on a transposed or sliced view."""
    def flat(t):
        return t.as_strided(t.shape, t.contiguous().stride()) if torch.is_tensor(t) and not t.is_contiguous() else t

    @functools.wraps(f)
    def g(*args, **kwargs):
        return f(*[flat(a) for a in args], **{k: flat(v) for k, v in kwargs.items()})
    return g


def attached(f):
    """The result keeps an autograd graph (computed from a tensor that requires grad)."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        out = f(*args, **kwargs)
        one = torch.ones((), dtype=torch.float64, requires_grad=True)
        if torch.is_tensor(out):
            return out * one.to(out.dtype)
        return type(out)(o * one.to(o.dtype) if torch.is_tensor(o) and o.is_floating_point() else o for o in out)
    return g


def as_tensor(f):
    """A Python number returned as a 0-dim tensor (what ``x.sum()`` gives before ``.item()``)."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        out = f(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(torch.tensor(o) if isinstance(o, (int, float)) and not isinstance(o, bool) else o for o in out)
        return torch.tensor(out)
    return g


def returns_input(f, index: int):
    """The result written into the input ``index`` and returned (an alias of it)."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        out = f(*args, **kwargs)
        target = args[index]
        with torch.no_grad():
            target.copy_(out)
        return target
    return g


def caught_by(checks, m, fn: str) -> int:
    """How many of ``checks`` reject the solutions ``m``; each rejection must name ``fn`` first (``<fn>: ...``, the
    one-line message ``bp-mech check`` prints)."""
    caught = 0
    for check in checks:
        try:
            check(m)
        except AssertionError as e:
            assert str(e).startswith(f"{fn}: "), e
            caught += 1
    return caught


def leaks(f, leak, then=None):
    """Right values, but a global switch left flipped by ``leak`` (called with the first arguments it takes: a
    model to leave in eval mode), and, with ``then``, that exception raised after."""
    takes = len(inspect.signature(leak).parameters)

    @functools.wraps(f)
    def g(*args, **kwargs):
        out = f(*args, **kwargs)
        leak(*args[:takes])
        if then is not None:
            raise then
        return out
    return g


def rejects(exercise: str, check, match: str, **over) -> None:
    """``check`` rejects the answers of ``exercise`` with ``over``'s functions replaced, by a one-line message that
    names the (first) replaced function and matches ``match``."""
    import pytest
    from conftest import mutant

    with pytest.raises(AssertionError, match=f"^{next(iter(over))}: .*(?:{match})"):
        check(mutant(exercise, **over))
