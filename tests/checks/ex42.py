"""Checks of exercises/ex42_offload.py (never against the answer file).

References: plain float64 autograd (gradients to 1e-12); an independent counting-only
``saved_tensors_hooks`` pass written here (distinct non-parameter storages of at least
``MIN_BYTES``, each counted once); and weak references that tell whether a packed object still
keeps the original storage alive.
"""

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

TOL = 1e-12  # float64: offloading copies bytes, the arithmetic is unchanged
MIN_BYTES = 1024


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5).requires_grad_()  # noqa: E731
    W1, W2, b = r(32, 128), r(64, 32), r(32)
    scale = torch.full((1,), 0.7, dtype=torch.float64, requires_grad=True)  # 8 bytes: stays resident
    x = torch.randn(4, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    return [W1, W2, b], scale, x


def _toy(x, W1, W2, b, scale):
    h = x @ W1  # (B, T, 128); saves x and W1
    a, gate = h.chunk(2, -1)  # two views of h's storage
    y = torch.sigmoid(a) * gate  # sigmoid saves its output; mul saves it and `gate`, a view of h
    z = (y @ W2 + b).tanh() * scale  # saves y, W2, tanh's output, scale
    return z.pow(2).sum()  # saves z


def _reference_counts(params, scale, x):
    """(distinct non-parameter storage bytes >= MIN_BYTES, the same summed per saved tensor)."""
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages, per_tensor = {}, 0

    def pack(t):
        nonlocal per_tensor
        st = t.untyped_storage()
        if st.data_ptr() not in ptrs and st.nbytes() >= MIN_BYTES:
            storages[st.data_ptr()] = st.nbytes()
            per_tensor += st.nbytes()
        return t  # kept alive: no address is reused while counting

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _toy(x, *params, scale)
    return sum(storages.values()), per_tensor


def _run(m, seed):
    params, scale, x = _params(seed)
    leaves = [x, *params, scale]
    want = torch.autograd.grad(_toy(x, *params, scale), leaves)
    hooks = m.CountingOffload(params, MIN_BYTES)
    with hooks:
        loss = _toy(x, *params, scale)
    got = torch.autograd.grad(loss, leaves)
    return hooks, got, want, (params, scale, x)


def check_gradients_unchanged(m):
    _, got, want, _ = _run(m, 0)
    for name, a, b in zip(("dx", "dW1", "dW2", "db", "dscale"), got, want):
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:g} against plain autograd"


def check_bytes_counted_once(m):
    hooks, _, _, inputs = _run(m, 1)
    once, per_tensor = _reference_counts(*inputs)
    assert hooks.d2h_bytes == once, (
        f"d2h_bytes = {hooks.d2h_bytes}, but the distinct non-parameter storages of at least {MIN_BYTES} B saved "
        f"in this forward hold {once} B (counting every saved view separately gives {per_tensor} B)")
    assert once <= hooks.h2d_bytes <= per_tensor, (
        f"h2d_bytes = {hooks.h2d_bytes}: every moved storage comes back at least once ({once} B), at most once "
        f"per saved tensor ({per_tensor} B)")


def check_parameters_stay(m):
    params, _, _ = _params(2)
    hooks = m.CountingOffload(params, MIN_BYTES)
    for W in params:
        for v in (W, W.detach(), W.view(-1)):  # the parameter and views of its storage
            out = hooks.unpack(hooks.pack(v))
            assert out is v, "a parameter (or a view of one) was copied: parameters stay where they are"
    assert (hooks.d2h_bytes, hooks.h2d_bytes) == (0, 0), (
        f"parameters were counted as moved: d2h={hooks.d2h_bytes}, h2d={hooks.h2d_bytes}")


def check_tiny_stay(m):
    hooks = m.CountingOffload([], MIN_BYTES)
    small = torch.randn(10, dtype=torch.float64)  # 80 B
    assert hooks.unpack(hooks.pack(small)) is small, "a tensor under min_bytes was copied"
    assert hooks.d2h_bytes == 0, f"a tensor under min_bytes was counted: d2h={hooks.d2h_bytes}"


def check_storage_freed(m):
    hooks = m.CountingOffload([], MIN_BYTES)
    big = torch.randn(64, 64, dtype=torch.float64) * 2  # 32 KiB, a fresh storage
    want = big.clone()
    ref = StorageWeakRef(big.untyped_storage())
    packed = hooks.pack(big)
    del big
    gc.collect()
    assert ref.expired(), "the packed object still keeps the original storage alive: nothing is freed by offloading"
    out = hooks.unpack(packed)
    assert torch.equal(out, want), "unpack does not give back the saved values"
    assert hooks.d2h_bytes == hooks.h2d_bytes == want.untyped_storage().nbytes(), (
        f"one 32 KiB tensor moved out and back: d2h={hooks.d2h_bytes}, h2d={hooks.h2d_bytes}")


def check_views_share_one_copy(m):
    hooks = m.CountingOffload([], MIN_BYTES)
    base = torch.randn(32, 64, dtype=torch.float64) + 1  # 16 KiB
    views = [base[:, :32], base.view(-1), base.t(), base[5:]]
    packed = [hooks.pack(v) for v in views]
    n = base.untyped_storage().nbytes()
    assert hooks.d2h_bytes == n, f"four views of one {n} B storage counted as d2h={hooks.d2h_bytes}: count a storage once"
    for v, p in zip(views, packed):
        out = hooks.unpack(p)
        assert out.shape == v.shape and out.stride() == v.stride(), "unpack lost the view's shape or stride"
        assert torch.equal(out, v), "unpack of a view does not give back its values"


CHECKS = [check_gradients_unchanged, check_bytes_counted_once, check_parameters_stay, check_tiny_stay,
          check_storage_freed, check_views_share_one_copy]
