"""Checks of exercises/ex42_offload.py beyond the value: the contract of the hooks, the variant and the
prediction (never against the answer file).

* ``CountingOffload`` and ``BudgetOffload``: ``pack`` leaves its tensor as it was, the counters are ``int``,
  two instances share nothing, the ``with`` block removes the hooks on exit and lets an exception through,
  and entering again accumulates the counters (``BudgetOffload``: a new budget per forward);
* ``BudgetOffload`` (variant): gradients against plain float64 autograd over two backwards, bytes against
  an independent counting pass that replays the budget rule on the storages the forward saves, in order;
* ``predict_d2h_bytes`` (predict, then measure): against the D2H bytes the package's ``ActivationOffload``
  counts on a small MLP stack, exactly (the hooks count bytes: tolerance 0).
"""

import gc

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.checks.common import assert_close, call
from bp_mech.checks.properties import assert_type, call_unmodified
from bp_mech.offload import ActivationOffload, OffloadConfig

TOL = 1e-12
MIN_BYTES = 1024  # CountingOffload's threshold in every ex42 check


def toy_params(seed):
    """The toy model of every ex42 check: saved storages of several sizes, views sharing one storage.

    Args:
        seed: the generator's seed.

    Returns:
        (x, W1, W2, b, scale), float64 tensors that require grad: ``toy_loss``'s arguments.
    """
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5).requires_grad_()
    W1, W2, b = r(32, 128), r(64, 32), r(32)
    scale = torch.full((1,), 0.7, dtype=torch.float64, requires_grad=True)  # 8 bytes: stays resident
    x = torch.randn(4, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    return [W1, W2, b], scale, x


def toy_loss(x, W1, W2, b, scale):
    """The toy model's loss; what each operation saves for backward is said beside it.

    Args:
        x, W1, W2, b, scale: ``toy_params``'s tensors.

    Returns:
        The scalar loss.
    """
    h = x @ W1  # (B, T, 128); saves x and W1
    a, gate = h.chunk(2, -1)  # two views of h's storage
    y = torch.sigmoid(a) * gate  # sigmoid saves its output; mul saves it and `gate`, a view of h
    z = (y @ W2 + b).tanh() * scale  # saves y, W2, tanh's output, scale
    return z.pow(2).sum()  # saves z


def _make(m, cls):
    return (lambda p: getattr(m, cls)(p, MIN_BYTES)) if cls == "CountingOffload" else \
        (lambda p: getattr(m, cls)(p, 2048))


def _contract(m, cls):
    fn, make = cls, _make(m, cls)
    big = torch.randn(64, 64, dtype=torch.float64)
    at = "a fresh 32 KiB float64 tensor"
    hooks = call(fn, make, [], at="construction")
    call_unmodified(fn, hooks.pack, big, names=("t",), at=at)
    a, b = make([]), make([])
    t = torch.randn(64, 64, dtype=torch.float64)
    call(fn, a.pack, t, at=at)
    call(fn, b.pack, t, at=at + ", packed by a second instance")
    assert (a.d2h_bytes, b.d2h_bytes) == (32768, 32768), (
        f"{fn}: two instances that each packed one 32 KiB storage count d2h_bytes {a.d2h_bytes} and {b.d2h_bytes} "
        f"(want 32768 each): the instances share state")
    params, scale, x = toy_params(4)
    hooks = make(params)
    at = "two forwards of the toy model under one instance"
    for _ in range(2):
        with hooks:
            loss = call(fn, toy_loss, x, *params, scale, at=at)
        call(fn, loss.backward, at=at)
    once = make(params)
    with once:
        loss = toy_loss(x, *params, scale)
    loss.backward()
    for name in ("d2h_bytes", "h2d_bytes"):
        assert_type(fn, name, getattr(hooks, name), int, at)
    assert (hooks.d2h_bytes, hooks.h2d_bytes) == (2 * once.d2h_bytes, 2 * once.h2d_bytes), (
        f"{fn}: after two forwards d2h_bytes={hooks.d2h_bytes}, h2d_bytes={hooks.h2d_bytes}, one forward of a "
        f"fresh instance counts {once.d2h_bytes} and {once.h2d_bytes}: entering again must accumulate at {at}")
    at = "a with block whose body raises KeyError"
    before = hooks.d2h_bytes
    try:
        with hooks:
            raise KeyError("the forward failed")
    except KeyError:
        pass
    except Exception as e:
        raise AssertionError(f"{fn}: {type(e).__name__} came out of the with block instead of KeyError at {at}") from e
    else:
        raise AssertionError(f"{fn}: the with block swallowed the KeyError at {at}")
    toy_loss(x, *params, scale).backward()  # outside any with block: plain autograd
    assert hooks.d2h_bytes == before, (
        f"{fn}: a forward after the with block still went through the hooks (d2h_bytes {before} -> "
        f"{hooks.d2h_bytes}): they were not removed on exit at {at}")


def check_CountingOffload__contract(m):
    _contract(m, "CountingOffload")


def check_BudgetOffload__contract(m):
    _contract(m, "BudgetOffload")


def _replay(inputs, budget):
    """(d2h bytes, resident bytes): the budget rule replayed on the storages saved by one toy forward."""
    params, scale, x = inputs
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    order, kept = [], []

    def pack(t):
        st = t.untyped_storage()
        kept.append(t)  # alive: no address is reused while counting
        if st.data_ptr() not in ptrs and st.data_ptr() not in [p for p, _ in order]:
            order.append((st.data_ptr(), st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        toy_loss(x, *params, scale)
    resident = moved = 0
    for _, n in order:
        if resident + n <= budget:
            resident += n
        else:
            moved += n
    return moved, resident, sum(n for _, n in order)


def check_BudgetOffload(m):
    fn = "BudgetOffload"
    for seed, budget in ((0, 0), (1, 20000)):  # everything moves; some stays, the rest moves
        params, scale, x = toy_params(seed)
        leaves = [x, *params, scale]
        want = torch.autograd.grad(toy_loss(x, *params, scale), leaves)
        hooks = call(fn, m.BudgetOffload, (p for p in params), budget, at=f"budget={budget}")
        moved, resident, total = _replay((params, scale, x), budget)
        at = f"the toy forward (float64) at budget={budget} B, {total} B of saved activations"
        with hooks:
            loss = call(fn, toy_loss, x, *params, scale, at=at)
        for which in ("first", "second"):
            got = call(fn, torch.autograd.grad, loss, leaves, retain_graph=which == "first", at=f"{at}, {which} backward")
            for name, a, b in zip(("dx", "dW1", "dW2", "db", "dscale"), got, want):
                assert_close(fn, f"{name} of the {which} backward", a, b, tol=TOL, ref="plain float64 autograd", at=at)
        assert (hooks.d2h_bytes, hooks.resident_bytes) == (moved, resident), (
            f"{fn}: d2h_bytes={hooks.d2h_bytes}, resident_bytes={hooks.resident_bytes}; the budget rule replayed on "
            f"the saved storages gives {moved} and {resident} at {at}")
        assert_type(fn, "resident_bytes", hooks.resident_bytes, int, at)
        assert hooks.h2d_bytes >= 2 * moved, (
            f"{fn}: h2d_bytes is {hooks.h2d_bytes} after two backwards, every moved storage comes back at least "
            f"once per backward ({2 * moved} B) at {at}")


def check_BudgetOffload__rules(m):
    fn = "BudgetOffload"
    W = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    big = torch.randn(32, 64, dtype=torch.float64)  # 16 KiB
    small = torch.randn(128, dtype=torch.float64)  # 1 KiB
    at = "budget 2048 B: a 16 KiB storage, then a 1 KiB one, then two views of the first, then a parameter"
    hooks = call(fn, m.BudgetOffload, [W], 2048, at=at)
    packed = [call(fn, hooks.pack, t, at=at) for t in (big, small, big[:, :8], big.t(), W.t())]
    assert (hooks.d2h_bytes, hooks.resident_bytes) == (16384, 1024), (
        f"{fn}: d2h_bytes={hooks.d2h_bytes}, resident_bytes={hooks.resident_bytes}, expected 16384 (the large "
        f"storage once, its views sharing the copy) and 1024 (the small one still fits; parameters use no budget) "
        f"at {at}")
    for t, p in zip((big, small, big[:, :8], big.t(), W.t()), packed):
        out = call(fn, hooks.unpack, p, at=at)
        assert out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride() and torch.equal(out, t), (
            f"{fn}: unpack gave {out.dtype} {tuple(out.shape)} stride {out.stride()}, saved was {t.dtype} "
            f"{tuple(t.shape)} stride {t.stride()} (or other values) at {at}")
    exact = m.BudgetOffload([], 1024)
    exact.pack(small)
    assert exact.resident_bytes == 1024 and exact.d2h_bytes == 0, (
        f"{fn}: a 1024 B storage under a 1024 B budget was moved (resident + n <= budget stays)")
    fresh = torch.randn(64, 64, dtype=torch.float64)
    ref, keep = StorageWeakRef(fresh.untyped_storage()), fresh.clone()
    gone = m.BudgetOffload([], 0)
    p = gone.pack(fresh)
    del fresh
    gc.collect()
    assert ref.expired(), f"{fn}: the packed object of a moved tensor keeps its storage alive (nothing freed)"
    first = gone.unpack(p)
    assert torch.equal(first, keep), f"{fn}: unpack does not give back the saved values of a moved tensor"
    first.mul_(-3.0)  # backward may write into what it unpacked: the next unpack needs a fresh copy
    assert torch.equal(gone.unpack(p), keep), (
        f"{fn}: a second unpack of a moved tensor, after the first one's result was written in place, does not give "
        f"back the saved values (each unpack copies the host bytes back, to a fresh storage)")
    assert gone.h2d_bytes == 2 * 32768, (
        f"{fn}: h2d_bytes is {gone.h2d_bytes} after two unpacks of a moved 32 KiB storage, expected {2 * 32768}")


def check_predict_d2h_bytes(m):
    fn = "predict_d2h_bytes"
    # (batch, seq, width, expansion, layers, min_bytes, dtype): below, at and above the threshold; the last two
    # (a block input of 96 B, an inner tensor of 288 B) have the input above the threshold and the inner tensor at
    # it, and sizes whose bits overlap (96 + 576 is not 96 | 576)
    cases = [(2, 3, 4, 4, 3, 256, torch.float32), (1, 5, 8, 2, 4, 400, torch.float64),
             (2, 2, 4, 3, 2, 64, torch.float32), (2, 4, 4, 2, 3, 128, torch.float32),
             (1, 2, 4, 2, 2, 10**6, torch.float32), (2, 3, 4, 3, 2, 64, torch.float32),
             (1, 3, 4, 3, 2, 288, torch.float64)]
    for b, t, c, e, n_layers, min_bytes, dtype in cases:
        at = (f"batch={b}, seq={t}, width={c}, expansion={e}, layers={n_layers}, min_bytes={min_bytes}, "
              f"{str(dtype)[6:]}")
        got = call(fn, m.predict_d2h_bytes, b, t, c, e, n_layers, min_bytes, dtype.itemsize, at=at)
        assert_type(fn, "the prediction", got, int, at)
        g = torch.Generator().manual_seed(b * 100 + c)
        layers = nn.ModuleList(nn.Sequential(nn.Linear(c, e * c), nn.SiLU(), nn.Linear(e * c, c))
                               for _ in range(n_layers)).to(dtype)
        x = torch.randn(b, t, c, generator=g, dtype=dtype, requires_grad=True)
        hooks = ActivationOffload(list(layers.parameters()), OffloadConfig(min_bytes=min_bytes), device="cpu")
        with hooks:
            h = x
            for layer in layers:
                h = layer(h)
        h.sum().backward()
        want = hooks.d2h_bytes
        assert got == want, (f"{fn}: predicted {got} B, the offload hooks moved {want} B (exact: the hooks count "
                             f"bytes; off by {got - want:+d} B) at {at}")


CHECKS = [check_CountingOffload__contract, check_BudgetOffload, check_BudgetOffload__rules,
          check_BudgetOffload__contract, check_predict_d2h_bytes]
