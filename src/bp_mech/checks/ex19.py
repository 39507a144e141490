"""Checks of exercises/ex19_checkpointing.py (never against the answer file).

References: plain float64 autograd on an identical copy of the block (gradients to 1e-12); the
bytes a plain block keeps alive after forward, measured with the package's storage tracker
(``bp_mech.instruments.peak.PeakMemory``); and counters the checks place *inside* the modules' own
``forward``, which count real executions however a solution calls them. The inputs come with and
without ``requires_grad`` (a frozen input: the parameters' gradients must still arrive, and the
block must still checkpoint), as 3-D and 2-D tensors, and with part of the block frozen. A
checkpointed block may keep its output and nothing else (1 KiB of slack); the counted modules
come as a list and as an ``nn.ModuleList``, one of them called twice per step.
"""

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.instruments.peak import PeakMemory
from bp_mech.checks import ex19_contract
from bp_mech.checks.common import assert_close, call

TOL = 1e-12  # float64: the recompute repeats the same operations
C, I = 16, 512  # block width and its wide inner width: the intermediates dominate the memory
SLACK = 1024  # bytes a checkpointed block may keep beyond its output (it needs none: x exists already)


class _Counted(nn.Module):
    """Wraps a module and counts its forward executions from inside ``forward``."""

    def __init__(self, net):
        super().__init__()
        self.net, self.n = net, 0

    def forward(self, x):
        self.n += 1
        return self.net(x)


def _mlp(seed, freeze_first=False):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(C, I), nn.SiLU(), nn.Linear(I, C)).double()
    if freeze_first:
        net[0].requires_grad_(False)
    return net


def _inputs(seed, requires_grad=True, shape=(4, 8)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, C, generator=g, dtype=torch.float64, requires_grad=requires_grad)
    return x, torch.randn(*shape, C, generator=g, dtype=torch.float64)


def check_CheckpointedBlock(m):
    fn = "CheckpointedBlock"
    # (seed, x.requires_grad, leading shape of x, first Linear frozen)
    for seed, x_grad, shape, frozen in ((0, True, (4, 8), False), (1, False, (4, 8), False), (2, True, (6,), False),
                                        (3, False, (2, 5), True)):
        at = (f"x shape {(*shape, C)}, x.requires_grad={x_grad}" + (", first Linear frozen" if frozen else ""))
        ref_block = _mlp(seed, frozen)
        block = copy.deepcopy(ref_block)
        x, dy = _inputs(seed, x_grad, shape)
        y_ref = ref_block(x)
        trainable = [(n, p) for n, p in ref_block.named_parameters() if p.requires_grad]
        want = torch.autograd.grad(y_ref, ([x] if x_grad else []) + [p for _, p in trainable], dy)
        y = call(fn, m.CheckpointedBlock(block), x, at=at)
        if not (torch.is_tensor(y) and y.requires_grad):
            raise AssertionError(f"{fn}: the output is not connected to autograd (no grad_fn) at {at}")
        assert_close(fn, "output", y.detach(), y_ref.detach(), tol=TOL, ref="the plain block", at=at)
        call(fn, y.backward, dy, at=at + " (in backward)")
        params = dict(block.named_parameters())
        got = ([x.grad] if x_grad else []) + [params[n].grad for n, _ in trainable]
        names = (["dx"] if x_grad else []) + [f"d{n}" for n, _ in trainable]
        for name, a, b in zip(names, got, want):
            if a is None:
                raise AssertionError(f"{fn}: {name} is None (no gradient arrived) at {at}")
            assert_close(fn, name, a, b, tol=TOL, ref="plain float64 autograd", at=at)
        for n, p in block.named_parameters():
            assert p.requires_grad or p.grad is None, f"{fn}: frozen {n} received a gradient at {at}"


def _held_after_forward(module, x):
    with PeakMemory("cpu", resident=[list(module.parameters()), [x]]) as pm:  # storages that exist already
        pm.mark("start")
        y = module(x)
        pm.mark("after_forward")
    return pm.marks["after_forward"] - pm.marks["start"], y


def check_CheckpointedBlock__memory(m):
    fn = "CheckpointedBlock"
    for x_grad in (True, False):  # a frozen input must not turn checkpointing off
        x, _ = _inputs(2, x_grad)
        at = f"x shape {tuple(x.shape)}, x.requires_grad={x_grad}, inner width {I}"
        plain, y_ref = _held_after_forward(_mlp(2), x)
        held, _ = call(fn, _held_after_forward, m.CheckpointedBlock(_mlp(2)), x, at=at)
        out = y_ref.numel() * y_ref.element_size()
        assert held <= out + SLACK, (
            f"{fn}: keeps {held} B alive after forward, its output is {out} B (limit {out + SLACK} B; a plain block "
            f"keeps {plain} B; tracked CPU storages) at {at}: keep only the input, which exists already")


def check_CheckpointedBlock__counts(m):
    fn = "CheckpointedBlock"
    counted = _Counted(_mlp(3))
    cb = m.CheckpointedBlock(counted)
    x, dy = _inputs(3)
    y = call(fn, cb, x, at="the first forward")
    assert (cb.calls, counted.n) == (1, 1), (
        f"{fn}: calls is {cb.calls} after one forward, the block really ran {counted.n}x (want 1)")
    call(fn, y.backward, dy, at="the first backward")
    assert counted.n == 2, f"{fn}: the block really ran {counted.n}x in forward + backward (want 2): no recompute"
    assert cb.calls == counted.n, f"{fn}: calls is {cb.calls}, the block really ran {counted.n}x after one step"
    call(fn, lambda: cb(x).backward(dy), at="a second step")
    assert cb.calls == counted.n == 4, (
        f"{fn}: calls is {cb.calls}, the block really ran {counted.n}x after two steps (want 4)")
    with torch.no_grad():
        call(fn, cb, x, at="a forward under torch.no_grad()")
    assert cb.calls == counted.n == 5, (
        f"{fn}: calls is {cb.calls}, the block really ran {counted.n}x after a no_grad forward "
        f"(want 5: it recomputes nothing)")


def _layers():
    torch.manual_seed(4)
    return [_Counted(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) for _ in range(4)]


def _hooks_left(layers):
    return [len(l._forward_pre_hooks) + len(l._forward_hooks) for l in layers]


def check_count_forward_calls(m):
    fn = "count_forward_calls"
    for kind in ("list", "nn.ModuleList"):
        layers = _layers()
        modules = layers if kind == "list" else nn.ModuleList(layers)
        x = torch.randn(3, 8, requires_grad=True)

        def step(x=x, layers=layers):  # layers 0 and 2 checkpointed (non-reentrant): they run again in backward; layer 1 runs twice
            h = x
            for i, layer in enumerate(layers):
                h = checkpoint(layer, h, use_reentrant=False) if i % 2 == 0 else layer(h)
            h = layers[1](h)
            h.sum().backward()

        for attempt in (1, 2):
            at = f"call {attempt} with the modules as a {kind}"
            before = [l.n for l in layers]
            got = call(fn, m.count_forward_calls, modules, step, at=at)
            want = [l.n - b for l, b in zip(layers, before)]
            assert want == [2, 2, 2, 1]
            assert list(got) == want, f"{fn}: counted {list(got)}, the modules really ran {want} times at {at}"
            assert not any(_hooks_left(layers)), f"{fn}: hooks left on the modules {_hooks_left(layers)} after {at}"

    def failing_step():
        layers[0](x)
        raise RuntimeError("step failed")

    try:
        m.count_forward_calls(layers, failing_step)
    except RuntimeError:
        pass
    assert not any(_hooks_left(layers)), f"{fn}: hooks left on the modules {_hooks_left(layers)} when step raised"


# the contract, the variant and the prediction (ex19_contract.py)
CHECKS = [check_CheckpointedBlock, check_CheckpointedBlock__memory, check_CheckpointedBlock__counts,
          check_count_forward_calls, *ex19_contract.CHECKS]
