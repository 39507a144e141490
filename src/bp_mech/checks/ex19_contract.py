"""Checks of exercises/ex19_checkpointing.py beyond the value: the whole contract, explored.

* ``CheckpointedBlock``: the input is left as it was, a non-contiguous input gives the same output and
  gradients (float64 autograd), ``calls`` is an ``int`` and no counter is shared between two blocks, and an
  exception raised by the block propagates;
* ``count_forward_calls``: a ``list`` of ``int``, and an exception of ``step`` propagates;
* ``choose_checkpoint_layers`` (variant): against a brute force over every set of layers (hypothesis draws
  the layers, byte counts up to 2**60 and the budget), and on a tiny MLP stack whose saved bytes are
  measured with counting-only ``saved_tensors_hooks`` (``SavedBytesCounter``);
* ``predict_saved_bytes`` (predict, then measure): against that measurement, exactly (a byte count of a
  tracker has no noise: tolerance 0).
"""

import itertools

import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.instruments.counters import SavedBytesCounter
from bp_mech.checks.common import assert_close, call
from bp_mech.checks.properties import assert_raises, assert_type, call_unmodified, explore, strided

TOL = 1e-12


def _seeded(net, seed):
    """``net`` with weights drawn from a generator seeded by ``seed`` (``torch.manual_seed`` is slower)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return net


def _mlp(seed, c=8, inner=32):
    return _seeded(nn.Sequential(nn.Linear(c, inner), nn.SiLU(), nn.Linear(inner, c)).double(), seed)


def check_CheckpointedBlock__contract(m):
    fn = "CheckpointedBlock"

    def body(case):
        seed, lead, how, x_grad = case
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(*lead, 8, generator=g, dtype=torch.float64)
        dy = torch.randn(*lead, 8, generator=g, dtype=torch.float64)
        ref = _mlp(seed)
        x_ref = base.clone().requires_grad_(x_grad)
        want = torch.autograd.grad(ref(x_ref), ([x_ref] if x_grad else []) + list(ref.parameters()), dy)
        x = strided(base, how).requires_grad_(x_grad)
        at = f"x of shape {tuple(x.shape)} stride {x.stride()} ({how}), x.requires_grad={x_grad}"
        block = _mlp(seed)
        cb = call(fn, m.CheckpointedBlock, block, at=at)
        y = call_unmodified(fn, cb, x, names=("x",), at=at)
        assert x.requires_grad == x_grad, f"{fn}: x.requires_grad was changed to {x.requires_grad} at {at}"
        assert_close(fn, "output", y.detach(), ref(base).detach(), tol=TOL, ref="the plain block", at=at)
        before = x.detach().clone()
        call(fn, y.backward, dy, at=at + " (in backward)")
        assert torch.equal(before, x.detach()), f"{fn}: x was modified in place in backward at {at}"
        got = ([x.grad] if x_grad else []) + [p.grad for p in block.parameters()]
        names = (["dx"] if x_grad else []) + [f"d{n}" for n, _ in block.named_parameters()]
        for name, a, b in zip(names, got, want):
            assert_close(fn, name, a, b, tol=TOL, ref="plain float64 autograd", at=at)
        assert_type(fn, "calls", cb.calls, int, at)

    lead = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)
    explore(st.tuples(st.integers(0, 3), lead, st.sampled_from(["slice", "transpose"]), st.booleans()), body,
            examples=6)


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise KeyError("the block failed")


def check_CheckpointedBlock__instances(m):
    fn = "CheckpointedBlock"
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    a, b = call(fn, m.CheckpointedBlock, _mlp(0), at="construction"), m.CheckpointedBlock(_mlp(1))
    call(fn, lambda: a(x).sum().backward(), at="one step of the first of two blocks")
    call(fn, b, x, at="a forward of the second block")
    assert (a.calls, b.calls) == (2, 1), (
        f"{fn}: after one step of the first block and one forward of the second the counters are {a.calls} and "
        f"{b.calls} (want 2 and 1): the blocks share a counter")
    failing = m.CheckpointedBlock(_Boom())
    assert_raises(fn, failing, (torch.randn(2, 4, requires_grad=True),), KeyError,
                  "a block whose forward raises KeyError", "a forward")


def check_count_forward_calls__contract(m):
    fn = "count_forward_calls"
    torch.manual_seed(5)
    layers = [nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(2, 4)
    got = call(fn, m.count_forward_calls, layers, lambda: layers[1](layers[0](x)).sum().backward(), at="3 layers")
    assert_type(fn, "the result", got, list, "3 modules")
    for i, c in enumerate(got):
        assert_type(fn, f"count {i}", c, int, "3 modules")

    def failing_step():
        raise KeyError("step failed")

    assert_raises(fn, m.count_forward_calls, (layers, failing_step), KeyError, "a step that raises KeyError",
                  "3 layers")


# --- the variant: a checkpoint policy under a byte budget -------------------------------


def _kept(A, H, S):
    return sum(H[i] if i in S else a for i, a in enumerate(A))


def _fewest(A, H, budget):
    """Brute force: the size of the smallest set that fits, or None."""
    for k in range(len(A) + 1):
        if any(_kept(A, H, set(S)) <= budget for S in itertools.combinations(range(len(A)), k)):
            return k
    return None


def _judge(m, A, H, budget, at):
    fn = "choose_checkpoint_layers"
    best = _fewest(A, H, budget)
    if best is None:
        try:
            got = m.choose_checkpoint_layers(list(A), list(H), budget)
        except ValueError:
            return
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{fn}: raised {type(e).__name__}, expected ValueError (nothing fits) at {at}") from e
        raise AssertionError(f"{fn}: returned {got!r:.80}, expected ValueError: even every layer checkpointed "
                             f"keeps {sum(H)} B > budget at {at}")
    a, h = list(A), list(H)
    got = call_unmodified(fn, m.choose_checkpoint_layers, a, h, budget, names=("saved_bytes", "input_bytes"), at=at)
    for name, now, was in (("saved_bytes", a, A), ("input_bytes", h, H)):
        if now != list(was):
            raise AssertionError(f"{fn}: {name} was modified in place (now {now}) at {at}")
    assert_type(fn, "the result", got, list, at)
    for i in got:
        assert_type(fn, "a layer index", i, int, at)
    assert got == sorted(set(got)) and all(0 <= i < len(A) for i in got), (
        f"{fn}: returned {got}, expected distinct layer indices in range({len(A)}), ascending at {at}")
    kept = _kept(A, H, set(got))
    assert kept <= budget, f"{fn}: layers {got} keep {kept} B, over the budget by {kept - budget} B at {at}"
    assert len(got) == best, (f"{fn}: checkpoints {len(got)} layers {got}, {best} are enough (brute force over "
                              f"every set of layers) at {at}")


def check_choose_checkpoint_layers(m):
    cases = [([100, 100, 100], [10, 10, 10], 300, "the plain step fits"),
             ([100, 60, 90], [10, 50, 10], 200, "two layers could do, one is enough"),
             ([100, 90, 50], [95, 10, 5], 120, "A - H decides, not A"),
             ([2**60 + 3, 5], [0, 0], 2**60 + 7, "byte counts above 2**53"),
             ([100, 100], [50, 50], 100, "exactly at the budget, every layer"),
             ([100, 100], [50, 51], 100, "one byte over with every layer checkpointed")]
    for A, H, budget, what in cases:
        _judge(m, A, H, budget, f"saved_bytes={A}, input_bytes={H}, budget={budget} ({what})")

    @st.composite
    def instance(draw):
        L = draw(st.integers(1, 7))
        scale = draw(st.sampled_from([1, 2**20, 2**60]))
        A = [draw(st.integers(0, 1000)) * scale + draw(st.integers(0, 3)) for _ in range(L)]
        H = [draw(st.integers(0, a)) for a in A]
        lo, hi = sum(H) - 2, sum(A) + 1
        budget = max(0, draw(st.integers(lo, max(lo, hi))))
        return A, H, budget

    explore(instance(), lambda c: _judge(m, *c, f"saved_bytes={c[0]}, input_bytes={c[1]}, budget={c[2]}"),
            examples=25)


def _stack(expansions, c=4, seed=0):
    return _seeded(nn.ModuleList(nn.Sequential(nn.Linear(c, e * c), nn.SiLU(), nn.Linear(e * c, c))
                                 for e in expansions), seed)


def _measure(layers, x, chosen):
    """Saved bytes outside the checkpointed regions of one forward (counting-only hooks), then its backward."""
    counter = SavedBytesCounter([p for layer in layers for p in layer.parameters()])
    with counter:
        h = x
        for i, layer in enumerate(layers):
            h = checkpoint(layer, h, use_reentrant=False) if i in chosen else layer(h)
    h.sum().backward()
    return counter.bytes


def check_choose_checkpoint_layers__measured(m):
    fn = "choose_checkpoint_layers"
    layers = _stack([1, 8, 2, 6, 3])
    x = torch.randn(2, 3, 4, requires_grad=True)
    A = [_measure(layers[i:i + 1], x, set()) for i in range(len(layers))]  # each layer alone, measured
    H = [x.numel() * x.element_size()] * len(layers)
    plain = _measure(layers, x, set())
    for budget in (plain, plain - 1, plain // 2, sum(H)):
        at = f"an MLP stack of expansions (1, 8, 2, 6, 3), measured A={A}, H={H}, budget={budget}"
        got = call(fn, m.choose_checkpoint_layers, A, H, budget, at=at)
        kept = _measure(layers, x, set(got))
        assert kept <= budget, f"{fn}: checkpointing layers {got} keeps {kept} B (measured), over budget at {at}"
        best = _fewest(A, H, budget)
        assert len(got) == best, f"{fn}: checkpoints {len(got)} layers {got}, {best} are enough at {at}"


def check_predict_saved_bytes(m):
    fn = "predict_saved_bytes"
    # (batch, seq, width, expansion, layers, every, dtype): every third layer at new workloads, then the others
    cases = [(2, 3, 4, 4, 7, 3, torch.float32), (1, 5, 4, 3, 5, 3, torch.float64), (3, 2, 8, 2, 4, 3, torch.float32),
             (2, 2, 4, 4, 6, 1, torch.float32), (1, 3, 4, 2, 5, 2, torch.float64), (2, 1, 4, 3, 3, 0, torch.float32)]
    for b, t, c, e, n_layers, every, dtype in cases:
        at = (f"batch={b}, seq={t}, width={c}, expansion={e}, layers={n_layers}, every={every}, "
              f"{str(dtype)[6:]}")
        got = call(fn, m.predict_saved_bytes, b, t, c, e, n_layers, every, dtype.itemsize, at=at)
        assert_type(fn, "the prediction", got, int, at)
        layers = _stack([e] * n_layers, c).to(dtype)
        x = torch.randn(b, t, c, dtype=dtype, requires_grad=True)
        chosen = {i for i in range(n_layers) if every and i % every == 0}
        want = _measure(layers, x, chosen)
        assert got == want, (f"{fn}: predicted {got} B, counting-only saved_tensors_hooks measure {want} B "
                             f"(exact: a tracker's byte count; off by {got - want:+d} B) at {at}")


CHECKS = [check_CheckpointedBlock__contract, check_CheckpointedBlock__instances, check_count_forward_calls__contract,
          check_choose_checkpoint_layers, check_choose_checkpoint_layers__measured, check_predict_saved_bytes]
