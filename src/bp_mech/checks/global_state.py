"""The global state a graded function must leave as it found it, and the one clean state every check starts from.

``state`` reads it (grad mode, inference mode, default dtype, CPU autocast, torch's RNG, the train flags and hooks
of the modules passed in), ``restore`` puts it back, ``clean`` runs a check from one clean state and gives the
caller's back after: no check's outcome depends on what ran before it (``engine``).
"""

from __future__ import annotations

import contextlib

import torch

from bp_mech.checks.properties import one_thread

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
