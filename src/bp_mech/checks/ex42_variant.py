"""Checks of exercises/ex42_offload.py, the variant: ``BudgetOffload`` against plain float64 autograd (over two
backwards) and an independent counting pass that replays the budget rule on the storages one toy forward saves,
in order; its rules one by one (a storage exactly at the budget, views sharing a fate, parameters outside the
budget, a moved storage freed, a second unpack from a fresh copy); its life (``ex42_measure.lifecycle``).
"""

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.checks.engine import Contract
from bp_mech.checks.ex42_measure import (lifecycle, lifecycle_ref, plain_grads, saved_storages, scenarios, toy_step,
                                          within)

BUDGET = 20000  # BudgetOffload's budget in the lifecycle scenario: x (16 KiB) stays, if resident_bytes restarts at 0


def replay(seed, budget):
    """(d2h bytes, resident bytes): the budget rule replayed on the storages one toy forward saves.

    Args:
        seed: ``toy_params``'s seed.
        budget: the device budget in bytes.

    Returns:
        (moved, resident), ints.

    Example:
        >>> replay(0, 0)[1]
        0
    """
    resident = moved = 0
    for n in saved_storages(seed)[0]:
        if resident + n <= budget:
            resident += n
        else:
            moved += n
    return moved, resident


def _budget_step(cls, seed, budget):
    hooks, first, second = toy_step(lambda p: cls(p, budget), seed, True)
    return {"gradients of the first backward": first, "gradients of the second backward": second,
            "d2h_bytes": hooks.d2h_bytes, "resident_bytes": hooks.resident_bytes,
            "h2d_bytes after two backwards": within(hooks.h2d_bytes, 2 * replay(seed, budget)[0])}


def _budget_step_ref(seed, budget):
    moved, resident = replay(seed, budget)
    return {"gradients of the first backward": plain_grads(seed), "gradients of the second backward": plain_grads(seed),
            "d2h_bytes": moved, "resident_bytes": resident,
            "h2d_bytes after two backwards": within(2 * moved, 2 * moved)}


def _fresh():
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _budget_rules(cls, big, small, W):
    hooks = cls([W], 2048)
    ts = (big, small, big[:, :8], big.t(), W.t())
    packed = [hooks.pack(t) for t in ts]
    obs = {"d2h_bytes": hooks.d2h_bytes, "resident_bytes": hooks.resident_bytes}
    outs = [hooks.unpack(p) for p in packed]
    obs.update({"the unpacked tensors": [o.detach() for o in outs], "their strides": [o.stride() for o in outs]})
    exact = cls([], 1024)
    exact.pack(small)
    obs["resident_bytes and d2h_bytes of a 1024 B storage under a 1024 B budget"] = [exact.resident_bytes,
                                                                                     exact.d2h_bytes]
    gone, fresh = cls([], 0), _fresh()
    ref = StorageWeakRef(fresh.untyped_storage())
    p = gone.pack(fresh)
    del fresh
    gc.collect()
    obs["a moved tensor's storage freed after pack"] = ref.expired()
    first = gone.unpack(p)
    obs["the first unpack of a moved tensor"] = first.clone()
    first.mul_(-3.0)  # backward may write into what it unpacked: the next unpack needs a fresh copy
    obs["a second unpack, after the first one's result was written in place"] = gone.unpack(p)
    obs["h2d_bytes after the two unpacks of the moved 32 KiB storage"] = gone.h2d_bytes
    return obs


def _budget_rules_ref(big, small, W):
    ts = (big, small, big[:, :8], big.t(), W.t())
    return {"d2h_bytes": 16384, "resident_bytes": 1024, "the unpacked tensors": [t.detach().clone() for t in ts],
            "their strides": [t.stride() for t in ts],
            "resident_bytes and d2h_bytes of a 1024 B storage under a 1024 B budget": [1024, 0],
            "a moved tensor's storage freed after pack": True, "the first unpack of a moved tensor": _fresh(),
            "a second unpack, after the first one's result was written in place": _fresh(),
            "h2d_bytes after the two unpacks of the moved 32 KiB storage": 2 * 32768}


def _big():
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _budget_given(c):
    if c["scenario"] == "rules":
        g = torch.Generator().manual_seed(5)
        return {"scenario": "rules", "given": {"big": torch.randn(32, 64, generator=g, dtype=torch.float64),
                                               "small": torch.randn(128, generator=g, dtype=torch.float64),
                                               "W": torch.randn(64, 32, generator=g, dtype=torch.float64)
                                               .requires_grad_()}}
    if c["scenario"] == "lifecycle":
        return {"scenario": "lifecycle", "given": {"t": _big()}}
    return {"scenario": "step", "given": {"seed": c["seed"], "budget": c["budget"]}}


BUDGET_OFFLOAD = Contract(
    "BudgetOffload", _budget_given, outs=("the run",), strides=False, tol=1e-12,
    ref_name="the reference (plain float64 autograd, the budget rule replayed)",
    **scenarios({"step": (_budget_step, _budget_step_ref), "rules": (_budget_rules, _budget_rules_ref),
                 "lifecycle": (lambda cls, t: lifecycle(lambda p: cls(p, BUDGET), t, "BudgetOffload"),
                               lambda t: lifecycle_ref(replay(4, BUDGET)[0]))}),
    note=lambda c: {"step": f"the toy forward (float64) at budget={c.get('budget')} B, parameters as a generator, "
                            "then two backwards",
                    "rules": "budget 2048 B: a 16 KiB storage, then a 1 KiB one, two views of the first, a "
                             "parameter; then a 1 KiB storage under 1 KiB, a moved one unpacked twice",
                    "lifecycle": f"budget {BUDGET} B: pack, two instances, two forwards, a with block that raises"
                    }[c["scenario"]],
    examples={"": [{"scenario": "step", "seed": 0, "budget": 0}, {"scenario": "step", "seed": 1, "budget": 20000}],
              "rules": [{"scenario": "rules"}], "contract": [{"scenario": "lifecycle"}]})
