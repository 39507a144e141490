"""Part 02 · 19, the mechanism: checkpointing leaves loss and every gradient equal; recomputes are
measured; ``configure`` undoes what it did and is a no-op when off; and the ex19 checks catch the
classic mistakes (mutants). The experiment's tests: tests/experiments/test_checkpointing.py."""

import contextlib
import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import dataclasses

from bp_mech import checkpointing
from bp_mech.instruments import counters
from bp_mech.bench.compare import compare
from bp_mech.bench.step import probe
from bp_mech.bench.strategy import configured, parse
from bp_mech.checks import ex19


@pytest.fixture(scope="module")
def probes(tiny):
    model, batches = tiny
    out = {}
    for name in checkpointing.CONFIGURATIONS:
        with configured(model, parse(name)):
            out[name] = probe(model, batches[0], parse(name))  # it counts the saved bytes, too
    return out


def test_every_configuration_leaves_loss_and_every_gradient_bitwise_equal(probes):
    for name in checkpointing.CONFIGURATIONS[1:]:
        c = compare(probes["plain"], probes[name])
        assert c.bitwise, (name, c)
        assert c.loss_error == c.grad_error == c.grad_norm_error == 0.0, (name, c)


def test_compare_sees_a_changed_gradient(probes):
    got = dataclasses.replace(probes["plain"], grads=[g.clone() for g in probes["plain"].grads])
    got.grads[3][0] += 1e-3
    c = compare(probes["plain"], got)
    assert not c.bitwise and c.grad_error > 0


def test_recompute_counts_are_measured(probes, tiny):
    L = len(tiny[0].model.layers)
    assert probes["plain"].calls == {"layer": [1] * L, "attn": [1] * L, "mlp": [1] * L}
    assert probes["plain"].recomputes == 0
    assert probes["checkpoint-all"].calls == {"layer": [2] * L, "attn": [2] * L, "mlp": [2] * L}
    assert probes["checkpoint-all"].recomputes == 2 * L
    every2 = [2 if i % 2 == 0 else 1 for i in range(L)]
    assert probes["checkpoint-every2"].calls["layer"] == every2
    assert probes["checkpoint-every2"].recomputes == 2 * math.ceil(L / 2)
    assert probes["checkpoint-mlp"].calls == {"layer": [1] * L, "attn": [1] * L, "mlp": [2] * L}
    assert probes["checkpoint-mlp"].recomputes == L


def test_checkpointing_keeps_less_until_backward(probes):
    saved = {n: p.saved_bytes for n, p in probes.items()}
    held = {n: p.held_after_forward for n, p in probes.items()}
    for d in (saved, held):
        assert d["checkpoint-all"] < d["checkpoint-every2"] < d["plain"], d
        assert d["checkpoint-all"] < d["checkpoint-mlp"] < d["plain"], d


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake-tensors"])
def test_saved_bytes_counter_counts_a_storage_once(fake):
    """Also under ``FakeTensorMode``, where every storage's ``data_ptr()`` is 0: storages by identity."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.randn(64, 64, requires_grad=True)
        w = nn.Parameter(torch.randn(64, 64))
        counter = counters.SavedBytesCounter([w])
        with counter:
            h = (x * 2) @ w  # matmul saves x*2 and the parameter w
            a, b = h.chunk(2, -1)  # two views of h's storage
            (a.sigmoid() * b).sum()  # sigmoid saves its output (64 x 32); mul saves it and b
    n = 64 * 64 * 4
    assert counter.param_saves == 1
    assert counter.bytes == n + n + n // 2, counter.storages  # x*2, h (once for b), sigmoid's output
    assert counter.tensor_bytes > counter.bytes


def test_configure_restores_the_model(tiny):
    model, _ = tiny
    mlp_types = [type(l.mlp) for l in model.model.layers]
    for name in checkpointing.CONFIGURATIONS:
        with checkpointing.configure(model, name):
            pass
        assert not any(l.gradient_checkpointing for l in model.model.layers)
        assert [type(l.mlp) for l in model.model.layers] == mlp_types
        assert not getattr(model, "_require_grads_hooks", [])


def test_plain_is_the_off_switch_and_touches_nothing(tiny):
    model, _ = tiny
    module_types = lambda: {name: type(module) for name, module in model.named_modules()}  # noqa: E731
    before = module_types()
    switch = checkpointing.configure(model, "plain")
    assert isinstance(switch, contextlib.nullcontext)
    with switch as entered:
        assert entered is model and not any(l.gradient_checkpointing for l in model.model.layers)
        assert module_types() == before


def test_every_configuration_gives_the_model_back_and_unknown_names_fail(tiny):
    model, _ = tiny
    for name in checkpointing.CONFIGURATIONS:
        with checkpointing.configure(model, name) as entered:
            assert entered is model
    with pytest.raises(ValueError, match="checkpoint-everything"):
        checkpointing.configure(model, "checkpoint-everything")


def test_from_scratch_checkpoint_equals_torch_checkpoint():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    block = checkpointing.CheckpointedBlock(mlp)
    ours = torch.autograd.grad(block(x).sum(), [x, *mlp.parameters()])
    ref = torch.autograd.grad(checkpoint(mlp, x, use_reentrant=False).sum(), [x, *mlp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert block.calls == 2


# --- the ex19 checks catch the classic mistakes ----------------------------------------


class _NotCheckpointing(nn.Module):  # counts, but keeps every activation (a plain forward)
    def __init__(self, block):
        super().__init__()
        self.block, self.calls = block, 0

    def forward(self, x):
        self.calls += 1
        return self.block(x)


class _AssumedCount(_NotCheckpointing):  # "checkpointing costs one extra forward": typed, not measured
    def forward(self, x):
        self.calls += 2
        return self.block(x)


class _CountsOnlyForward(_NotCheckpointing):  # really checkpoints, but misses the recompute
    def forward(self, x):
        self.calls += 1
        return checkpoint(self.block, x, use_reentrant=False)


class _ReentrantInputOnly(_NotCheckpointing):  # reentrant design with params hidden: no param grads
    def forward(self, x):
        return checkpoint(self._run, x, use_reentrant=True)

    def _run(self, x):
        self.calls += 1
        return self.block(x)


def _answers():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "answers" / "ex19_checkpointing.py"
    spec = importlib.util.spec_from_file_location("_ans19", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _with(block_cls=None, counter=None):
    ans = _answers()
    return type("Sol", (), {"CheckpointedBlock": block_cls or ans.CheckpointedBlock,
                            "count_forward_calls": staticmethod(counter or ans.count_forward_calls)})


class _AllParamsFunction(torch.autograd.Function):
    """Checkpoints, but asks autograd.grad for every parameter, frozen ones included."""

    @staticmethod
    def forward(ctx, fn, x, *params):
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)
        return None, *torch.autograd.grad(y, [x, *ctx.params], dy)


class _GradsForFrozenParams(_NotCheckpointing):
    def forward(self, x):
        return _AllParamsFunction.apply(self._run, x, *self.block.parameters())

    def _run(self, x):
        self.calls += 1
        return self.block(x)


class _PlainWhenInputFrozen(_NotCheckpointing):  # "x needs no grad: nothing to checkpoint" -- but the weights do
    def forward(self, x):
        if not x.requires_grad:
            self.calls += 1
            return self.block(x)
        return checkpoint(self._run, x, use_reentrant=False)

    def _run(self, x):
        self.calls += 1
        return self.block(x)


class _SavesACopyOfTheInput(_NotCheckpointing):  # checkpoints, but keeps x.clone(): a second copy of the input
    def forward(self, x):
        self.kept = x.detach().clone()
        return checkpoint(self._run, x, use_reentrant=False)

    def _run(self, x):
        self.calls += 1
        return self.block(x)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the reentrant mutant's own warning
@pytest.mark.parametrize("cls,check", [
    (_NotCheckpointing, ex19.check_CheckpointedBlock__memory),
    (_NotCheckpointing, ex19.check_CheckpointedBlock),
    (_AssumedCount, ex19.check_CheckpointedBlock),
    (_CountsOnlyForward, ex19.check_CheckpointedBlock),
    (_ReentrantInputOnly, ex19.check_CheckpointedBlock),
    (_GradsForFrozenParams, ex19.check_CheckpointedBlock),
    (_PlainWhenInputFrozen, ex19.check_CheckpointedBlock__memory),
    (_SavesACopyOfTheInput, ex19.check_CheckpointedBlock__memory),
])
def test_ex19_checks_catch_checkpoint_mistakes(cls, check):
    with pytest.raises(AssertionError, match="^CheckpointedBlock: "):
        check(_with(block_cls=cls))


def test_the_frozen_input_mutant_is_right_in_value():
    """What the memory check rejects is memory (and, with a frozen input, the missing recompute): the values pass."""
    with pytest.raises(AssertionError, match="^CheckpointedBlock: calls after its backward is 1, .* gives 2"):
        ex19.check_CheckpointedBlock(_with(block_cls=_PlainWhenInputFrozen))
    ex19.check_CheckpointedBlock(_with(block_cls=_SavesACopyOfTheInput))


def _hooks_left_behind(modules, step):
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda mod, args, i=i: counts.__setitem__(i, counts[i] + 1))
    step()
    return counts


def _assumed_counts(modules, step):
    step()
    return [1] * len(modules)


def _list_index_counts(modules, step):  # modules.index(mod) in the hook: a list has it, a ModuleList not
    counts = [0] * len(modules)
    handles = [m.register_forward_pre_hook(lambda mod, args: counts.__setitem__(modules.index(mod),
                                                                                   counts[modules.index(mod)] + 1))
               for m in modules]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return counts


@pytest.mark.parametrize("counter", [_hooks_left_behind, _assumed_counts, _list_index_counts])
def test_ex19_checks_catch_counting_mistakes(counter):
    with pytest.raises(AssertionError, match="^count_forward_calls: "):
        ex19.check_count_forward_calls(_with(counter=counter))
