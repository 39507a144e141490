"""Checks of exercises/ex19_checkpointing.py (never against the answer file).

References: plain float64 autograd on an identical copy of the block (gradients to 1e-12); the
bytes a plain block keeps alive after forward, measured with the package's storage tracker
(``bp_mech.tracking.PeakMemory``); and counters the checks place *inside* the modules' own
``forward``, which count real executions however a solution calls them.
"""

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.tracking import PeakMemory

TOL = 1e-12  # float64: the recompute repeats the same operations
C, I = 16, 512  # block width and its wide inner width: the intermediates dominate the memory
KEEP_FRACTION = 0.25  # a checkpointed block may keep at most this share of what a plain one keeps


class _Counted(nn.Module):
    """Wraps a module and counts its forward executions from inside ``forward``."""

    def __init__(self, net):
        super().__init__()
        self.net, self.n = net, 0

    def forward(self, x):
        self.n += 1
        return self.net(x)


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(C, I), nn.SiLU(), nn.Linear(I, C)).double()


def _inputs(seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, C, generator=g, dtype=torch.float64, requires_grad=requires_grad)
    return x, torch.randn(4, 8, C, generator=g, dtype=torch.float64)


def _close(name, got, want):
    assert got is not None, f"{name}: no gradient arrived (None)"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:g} against plain float64 autograd"


def check_gradients(m):
    for seed, x_grad in ((0, True), (1, False)):  # x not requiring grad: parameter grads must still arrive
        ref_block = _mlp(seed)
        block = copy.deepcopy(ref_block)
        x, dy = _inputs(seed, x_grad)
        y_ref = ref_block(x)
        want = torch.autograd.grad(y_ref, ([x] if x_grad else []) + list(ref_block.parameters()), dy)
        y = m.CheckpointedBlock(block)(x)
        assert y.requires_grad, "the output is not connected to autograd (no grad_fn)"
        _close("output", y.detach(), y_ref.detach())
        y.backward(dy)
        got = ([x.grad] if x_grad else []) + [p.grad for p in block.parameters()]
        names = (["dx"] if x_grad else []) + [f"d{n}" for n, _ in block.named_parameters()]
        for name, a, b in zip(names, got, want):
            _close(f"{name} (x.requires_grad={x_grad})", a, b)


def _held_after_forward(module, x):
    with PeakMemory("cpu", resident=[list(module.parameters()), [x]]) as pm:  # storages that exist already
        pm.mark("start")
        y = module(x)
        pm.mark("after_forward")
    return pm.marks["after_forward"] - pm.marks["start"], y


def check_keeps_only_input(m):
    x, _ = _inputs(2)
    plain, y_ref = _held_after_forward(_mlp(2), x)
    held, y = _held_after_forward(m.CheckpointedBlock(_mlp(2)), x)
    out = y_ref.numel() * y_ref.element_size()
    limit = out + KEEP_FRACTION * (plain - out)
    assert held <= limit, (f"after forward the checkpointed block keeps {held} B alive, a plain block {plain} B "
                           f"(output {out} B): it is not checkpointing (limit {limit:.0f} B)")


def check_counts_real_executions(m):
    counted = _Counted(_mlp(3))
    cb = m.CheckpointedBlock(counted)
    x, dy = _inputs(3)
    y = cb(x)
    assert (cb.calls, counted.n) == (1, 1), f"after one forward: calls={cb.calls}, block really ran {counted.n}x (want 1)"
    y.backward(dy)
    assert counted.n == 2, f"the block ran {counted.n}x in forward + backward: backward did not recompute it"
    assert cb.calls == counted.n, f"calls={cb.calls} but the block really ran {counted.n}x"
    cb(x).backward(dy)
    assert cb.calls == counted.n == 4, f"after two steps: calls={cb.calls}, really {counted.n} (want 4)"
    with torch.no_grad():
        cb(x)
    assert cb.calls == counted.n == 5, f"a no_grad forward recomputes nothing: calls={cb.calls}, really {counted.n}"


def _layers():
    torch.manual_seed(4)
    return [_Counted(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) for _ in range(4)]


def check_count_forward_calls(m):
    layers = _layers()
    x = torch.randn(3, 8, requires_grad=True)

    def step():  # layers 0 and 2 checkpointed (non-reentrant): they run again in backward
        h = x
        for i, layer in enumerate(layers):
            h = checkpoint(layer, h, use_reentrant=False) if i % 2 == 0 else layer(h)
        h.sum().backward()

    for attempt in (1, 2):
        before = [l.n for l in layers]
        got = m.count_forward_calls(layers, step)
        want = [l.n - b for l, b in zip(layers, before)]
        assert list(got) == want, f"call {attempt}: counted {list(got)}, the layers really ran {want}"
        assert want == [2, 1, 2, 1]
        left = [len(l._forward_pre_hooks) + len(l._forward_hooks) for l in layers]
        assert not any(left), f"hooks left on the modules after call {attempt}: {left}"

    def failing_step():
        layers[0](x)
        raise RuntimeError("step failed")

    try:
        m.count_forward_calls(layers, failing_step)
    except RuntimeError:
        pass
    left = [len(l._forward_pre_hooks) + len(l._forward_hooks) for l in layers]
    assert not any(left), f"hooks left behind when step raised: {left}"


CHECKS = [check_gradients, check_keeps_only_input, check_counts_real_executions, check_count_forward_calls]
