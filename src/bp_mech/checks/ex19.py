"""Checks of exercises/ex19_checkpointing.py: one declaration per function (``engine.Contract``).

References: plain float64 autograd on the same block (gradients to 1e-12); counters placed *inside* the
modules' own ``forward`` (real executions, however a solution calls them); the bytes a plain block keeps alive
after forward (``instruments.peak.PeakMemory``, tracked CPU storages: a checkpointed block keeps its output and
at most 1 KiB more); a brute force over every set of layers; counting-only ``saved_tensors_hooks``
(``SavedBytesCounter``) on MLP stacks. Never the answer file. The class and the functions that take modules and
a step are graded through drivers (``use``): what a reader observes, in order. The domains: inputs with and
without ``requires_grad``, part of the block frozen, no to two leading dimensions, strided inputs; modules as a
list and as an ``nn.ModuleList``, checkpointed or run twice; byte counts above 2**53, a step exactly at the
budget, nothing that fits (``ValueError``).
"""

import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.checks.common import CheckFailed
from bp_mech.checks.engine import Contract, Raises, checks
from bp_mech.checks.ex19_variant import CHOOSE, PREDICT, seeded
from bp_mech.checks.properties import max_change
from bp_mech.instruments.peak import PeakMemory

TOL = 1e-12  # float64: the recompute repeats the same operations
SLACK = 1024  # bytes a checkpointed block may keep beyond its output (it needs none: x exists already)
_HELD = {}  # what the driver measured at its last forward (the memory promise reads it)


class _Counted(nn.Module):
    """Wraps a module and counts its forward executions from inside ``forward``."""

    def __init__(self, net):
        super().__init__()
        self.net, self.n = net, 0

    def forward(self, x):
        self.n += 1
        return self.net(x)


class _Boom(nn.Module):
    """A block whose forward raises KeyError."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        raise KeyError("the block failed")


def _block(c):
    g = torch.Generator().manual_seed(c["seed"])
    if c.get("boom"):
        return {"block": _Boom(), "x": torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True),
                "dy": torch.randn(2, 4, generator=g, dtype=torch.float64)}
    w, inner = (16, 512) if c.get("memory") else (8, 32)
    block = seeded(nn.Sequential(nn.Linear(w, inner), nn.SiLU(), nn.Linear(inner, w)).double(), c["seed"])
    if c.get("frozen"):
        block[0].requires_grad_(False)
    x = torch.randn(*c["lead"], w, generator=g, dtype=torch.float64).requires_grad_(c["x_grad"])
    return {"block": block, "x": x, "dy": torch.randn(*c["lead"], w, generator=g, dtype=torch.float64)}


def _held_after_forward(module, x):
    """(bytes a forward of ``module`` keeps alive, its output), tracked CPU storages."""
    with PeakMemory("cpu", resident=[list(module.parameters()), [x]]) as pm:  # storages that exist already
        pm.mark("start")
        y = module(x)
        pm.mark("after_forward")
    return pm.marks["after_forward"] - pm.marks["start"], y


def _drive_block(cls):
    """A forward, its backward, a second step, a no_grad forward, then a second block's forward."""
    def run(block, x, dy):
        counted = _Counted(block)
        cb = cls(counted)
        if isinstance(block, _Boom):
            return cb(x)  # must raise
        before = x.detach().clone()
        _HELD["held"], y = _held_after_forward(cb, x)
        if change := max_change(before, x):  # (the engine sees it after the whole run: backward would fail first)
            raise CheckFailed(f"CheckpointedBlock: x was modified in place by the forward, max change {change:.2g} "
                              f"at x shape {tuple(x.shape)}")
        seen = [x.requires_grad, cb.calls, counted.n]
        named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        leaves = ([x] if x.requires_grad else []) + [p for _, p in named]
        linked = torch.is_tensor(y) and y.requires_grad
        grads = torch.autograd.grad(y, leaves, dy, allow_unused=True) if linked else [None] * len(leaves)
        seen += [cb.calls, counted.n]
        torch.autograd.grad(cb(x), leaves, dy)
        seen += [cb.calls, counted.n]
        with torch.no_grad():
            cb(x)
        seen += [cb.calls, counted.n]
        other = cls(_Counted(block))
        other(x)
        dx = grads[0] if x.requires_grad else None
        return (y.detach() if linked else y, seen[0], linked, dx,
                {n: g for (n, _), g in zip(named, grads[-len(named):])}, *seen[1:], other.calls, cb.calls)
    return run


def _block_ref(block, x, dy):
    if isinstance(block, _Boom):
        return Raises(KeyError, "a block whose forward raises KeyError (it propagates, unchanged)")
    named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    y = block(xr)
    grads = torch.autograd.grad(y, ([xr] if x.requires_grad else []) + [p for _, p in named], dy)
    return (y.detach(), x.requires_grad, True, grads[0] if x.requires_grad else None,
            {n: g for (n, _), g in zip(named, grads[-len(named):])}, 1, 1, 2, 2, 4, 4, 5, 5, 1, 5)


def _keeps_its_output_only(case, call, at):
    """The promise of checkpointing: after forward, the output and at most 1 KiB more stay alive."""
    if case.get("memory"):
        call()
        args = _block(case)
        plain, y = _held_after_forward(args["block"], args["x"])
        out, held = y.numel() * y.element_size(), _HELD["held"]
        assert held <= out + SLACK, (
            f"CheckpointedBlock: keeps {held} B alive after forward, its output is {out} B (limit {out + SLACK} B; a "
            f"plain block keeps {plain} B; tracked CPU storages) at {at}: keep only the input, which exists already")


def _case(seed, lead, x_grad, frozen=False, **more):
    return {"seed": seed, "lead": lead, "x_grad": x_grad, "frozen": frozen, **more}


BLOCK = Contract(
    "CheckpointedBlock", _block, _block_ref,
    ("y", "x.requires_grad after the forward", "y.requires_grad", "dx", "the parameters' gradients",
     "calls after a forward", "block runs after a forward", "calls after its backward", "block runs after its backward",
     "calls after a second step", "block runs after a second step", "calls after a no_grad forward",
     "block runs after a no_grad forward", "a second block's calls after its forward",
     "the first block's calls after a second block ran"),
    tol=TOL, use=_drive_block, promise=_keeps_its_output_only, ref_name="a plain run of the block",
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "x_grad": st.booleans(), "frozen": st.booleans(),
                                "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
                                "view": st.sampled_from(("slice", "transpose"))}),
    note=lambda c: c.get("boom") and "a block that raises KeyError" or (
        f"x.requires_grad={c['x_grad']}" + (", first Linear frozen" if c.get("frozen") else "")
        + (", inner width 512" if c.get("memory") else "")),
    examples={"": [_case(0, (4, 8), True), _case(1, (4, 8), False), _case(2, (6,), True), _case(3, (2, 5), False, True),
                   _case(4, (), True)],
              "memory": [_case(2, (4, 8), True, memory=True), _case(2, (4, 8), False, memory=True)],
              "block_raises": [{"seed": 5, "boom": True}]})


class _Layers(list):
    """A list of modules that reads short in a failure message."""

    def __repr__(self):
        return f"a list of {len(self)} modules"


class _Step:
    """One training step over ``layers``: the checkpointed ones (non-reentrant) run again in backward, ``again``
    runs a second time; ``raises``: it fails after a forward."""

    def __init__(self, layers, x, ckpt, again, raises):
        self.layers, self.x, self.ckpt, self.again, self.raises = layers, x, ckpt, again, raises

    def __call__(self):
        h = self.x
        for layer, ck in zip(self.layers, self.ckpt):
            h = checkpoint(layer, h, use_reentrant=False) if ck else layer(h)
            if self.raises:
                raise KeyError("step failed")
        if self.again is not None:
            h = self.layers[self.again](h)
        h.sum().backward()

    def __repr__(self):
        ck = [i for i, c in enumerate(self.ckpt) if c]
        return (f"a step ({'a failing one' if self.raises else f'layers {ck} checkpointed'}"
                + (f", layer {self.again} run twice" if self.again is not None else "") + ")")


def _steps(c):
    g = torch.Generator().manual_seed(c["seed"])
    n = len(c["ckpt"])
    layers = _Layers(_Counted(seeded(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), c["seed"] + i)) for i in range(n))
    again = None if c.get("again", -1) < 0 else c["again"] % n
    step = _Step(layers, torch.randn(3, 8, generator=g, requires_grad=True), c["ckpt"], again, c.get("raises"))
    return {"modules": layers if c["kind"] == "list" else nn.ModuleList(layers), "step": step}


def _real_runs(modules, step):
    if step.raises:
        return Raises(KeyError, "a step that raises KeyError (it propagates, after the hooks are removed)")
    before = [m.n for m in modules]
    step()
    want = [m.n - b for m, b in zip(modules, before)]
    return want, [0] * len(want), want


def _drive_counts(f):
    def run(modules, step):
        if step.raises:
            return f(modules, step)  # must raise
        first = f(modules, step)
        left = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules]
        return first, left, f(modules, step)
    return run


COUNTS = Contract(
    "count_forward_calls", _steps, _real_runs,
    ("the counts", "hooks left on the modules", "the counts of a second call"), use=_drive_counts,
    ref_name="each module's own counter", strides=False,
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "ckpt": st.lists(st.booleans(), min_size=1, max_size=4),
                                "again": st.integers(-1, 3), "kind": st.sampled_from(("list", "nn.ModuleList"))}),
    examples={"": [{"seed": 4, "ckpt": (True, False, True, False), "again": 1, "kind": k}
                   for k in ("list", "nn.ModuleList")],
              "step_raises": [{"seed": 5, "ckpt": (False, True), "kind": "nn.ModuleList", "raises": True}]})

CHECKS = checks(BLOCK, COUNTS, CHOOSE, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex19.check_CheckpointedBlock__memory, ...
