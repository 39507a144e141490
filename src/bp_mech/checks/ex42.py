"""Checks of exercises/ex42_offload.py (never against the answer file).

References: plain float64 autograd (gradients to 1e-12, also over a second backward that unpacks
every saved tensor again); an independent counting-only ``saved_tensors_hooks`` pass written here
(distinct non-parameter storages of at least ``MIN_BYTES``, each counted once); and weak references
that tell whether a packed object still keeps the original storage alive. The parameters come as a
list and as a generator (``model.parameters()``); the size rule is tried exactly at ``min_bytes``, one
byte under it, at a non-default ``min_bytes``, at the constructor's default (1024: uint8 storages of 1024
and 1023 B), on a two-element view of a large storage, and in bfloat16 and float16 (bytes, not elements).
A storage is told apart from another by more than its address: one rewritten in place between two packs is
saved with its new values, a new storage at a freed one's address (``torch.frombuffer`` over one buffer, as
an allocator reuses freed memory) is copied and counted again, and the views of a storage whose version
counter is past 256 (a buffer rewritten many times; Python caches only small ints) share one copy.
"""

import array
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bp_mech.checks.common import assert_close, call
from bp_mech.checks.ex42_contract import (  # the toy model: one copy
    MIN_BYTES,
    toy_params,
    toy_loss,
)

TOL = 1e-12  # float64: offloading copies bytes, the arithmetic is unchanged
FN = "CountingOffload"


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
        toy_loss(x, *params, scale)
    return sum(storages.values()), per_tensor


def _grads_twice(m, seed, as_generator):
    params, scale, x = toy_params(seed)
    leaves = [x, *params, scale]
    want = torch.autograd.grad(toy_loss(x, *params, scale), leaves)
    hooks = call(FN, m.CountingOffload, (p for p in params) if as_generator else params, MIN_BYTES,
                 at="construction")
    at = f"the toy forward (float64), parameters as a {'generator' if as_generator else 'list'}"
    with hooks:
        loss = call(FN, toy_loss, x, *params, scale, at=at)
    first = call(FN, torch.autograd.grad, loss, leaves, retain_graph=True, at=at + ", first backward")
    second = call(FN, torch.autograd.grad, loss, leaves,
                  at=at + ", second backward (every saved tensor unpacked again)")
    return hooks, first, second, want, (params, scale, x), at


def check_CountingOffload(m):
    for seed, as_generator in ((0, False), (3, True)):
        _, first, second, want, _, at = _grads_twice(m, seed, as_generator)
        for which, got in (("first", first), ("second", second)):
            for name, a, b in zip(("dx", "dW1", "dW2", "db", "dscale"), got, want):
                assert_close(FN, f"{name} of the {which} backward", a, b, tol=TOL, ref="plain float64 autograd", at=at)


def check_CountingOffload__bytes(m):
    hooks, _, _, _, inputs, at = _grads_twice(m, 1, False)
    once, per_tensor = _reference_counts(*inputs)
    assert hooks.d2h_bytes == once, (
        f"{FN}: d2h_bytes is {hooks.d2h_bytes}, the distinct non-parameter storages of at least {MIN_BYTES} B "
        f"saved in this forward hold {once} B (every saved view counted separately: {per_tensor} B) at {at}")
    assert 2 * once <= hooks.h2d_bytes <= 2 * per_tensor, (
        f"{FN}: h2d_bytes is {hooks.h2d_bytes} after two backwards: every moved storage comes back at least once "
        f"per backward ({2 * once} B), at most once per saved tensor and backward ({2 * per_tensor} B) at {at}")


def check_CountingOffload__parameters(m):
    for as_generator in (False, True):
        params, _, _ = toy_params(2)
        params[2].requires_grad_(False)  # a frozen parameter is still a parameter
        at = f"parameters as a {'generator' if as_generator else 'list'}, one of them frozen"
        hooks = call(FN, m.CountingOffload, (p for p in params) if as_generator else params, MIN_BYTES, at=at)
        for i, W in enumerate(params):
            views = (("itself", W), ("detached", W.detach()), ("a flat view", W.view(-1)), ("transposed", W.t()))
            for kind, v in views:
                out = call(FN, lambda h=hooks, v=v: h.unpack(h.pack(v)), at=f"parameter {i} ({kind}), {at}")
                assert out is v, f"{FN}: parameter {i} ({kind}) came back as a copy, it must stay where it is at {at}"
        assert (hooks.d2h_bytes, hooks.h2d_bytes) == (0, 0), (
            f"{FN}: parameters counted as moved, d2h_bytes={hooks.d2h_bytes}, h2d_bytes={hooks.h2d_bytes} at {at}")


def _moves(m, min_bytes, t, at):
    """Pack and unpack ``t``; True when it was moved (and then counted at its storage's size, values intact).
    ``min_bytes=None``: the constructor's default."""
    args = ([],) if min_bytes is None else ([], min_bytes)
    hooks = call(FN, m.CountingOffload, *args, at=at)
    packed = call(FN, hooks.pack, t, at=at)
    out = call(FN, hooks.unpack, packed, at=at)
    if out is t:
        assert (hooks.d2h_bytes, hooks.h2d_bytes) == (0, 0), (
            f"{FN}: kept the tensor but counted d2h_bytes={hooks.d2h_bytes}, h2d_bytes={hooks.h2d_bytes} at {at}")
        return False
    n = t.untyped_storage().nbytes()
    assert (hooks.d2h_bytes, hooks.h2d_bytes) == (n, n), (
        f"{FN}: d2h_bytes={hooks.d2h_bytes}, h2d_bytes={hooks.h2d_bytes}, the storage holds {n} B (counted once "
        f"each way, in bytes) at {at}")
    assert out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride(), (
        f"{FN}: unpack gave {out.dtype} {tuple(out.shape)} stride {out.stride()}, saved was {t.dtype} "
        f"{tuple(t.shape)} stride {t.stride()} at {at}")
    assert torch.equal(out, t), f"{FN}: unpack does not give back the saved values at {at}"
    return True


def check_CountingOffload__min_bytes(m):
    big = torch.randn(64, 64, dtype=torch.float64)  # 32 KiB
    cases = [  # (min_bytes, tensor, moves?, what)
        (MIN_BYTES, torch.randn(10, dtype=torch.float64), False, "an 80 B float64 tensor"),
        (MIN_BYTES, torch.randn(128, dtype=torch.float64), True, "a float64 tensor of exactly min_bytes (1024 B)"),
        (MIN_BYTES, torch.randn(127, dtype=torch.float64), False, "a float64 tensor 8 B under min_bytes"),
        (MIN_BYTES, torch.randn(512).bfloat16(), True, "a bfloat16 tensor of 512 elements = 1024 B"),
        (MIN_BYTES, torch.randn(511).half(), False, "a float16 tensor of 511 elements = 1022 B"),
        (MIN_BYTES, torch.randn(300).half(), False, "a float16 tensor of 600 B (300 elements)"),
        (MIN_BYTES, big[3, 5:7], True, "a 2-element view of a 32 KiB storage (the rule is per storage)"),
        (4096, torch.randn(256, dtype=torch.float64), False, "a 2 KiB tensor under min_bytes=4096"),
        (4096, torch.randn(2048).bfloat16(), True, "a 4 KiB bfloat16 tensor at min_bytes=4096"),
        (None, torch.randint(0, 256, (1024,), dtype=torch.uint8), True, "a uint8 tensor of 1024 B"),
        (None, torch.randint(0, 256, (1023,), dtype=torch.uint8), False, "a uint8 tensor of 1023 B"),
    ]
    for min_bytes, t, want, what in cases:
        shown = "the default (1024)" if min_bytes is None else min_bytes
        at = f"{what}, min_bytes={shown}"
        got = _moves(m, min_bytes, t, at)
        assert got == want, f"{FN}: {'moved' if got else 'kept'} {what}, expected it {'moved' if want else 'kept'} " \
                            f"(storage bytes < min_bytes stay) at min_bytes={shown}"


def check_CountingOffload__storage_freed(m):
    for dtype in (torch.float64, torch.bfloat16):
        hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
        big = (torch.randn(64, 64, dtype=torch.float64) * 2).to(dtype)  # a fresh storage of 32 or 8 KiB
        want = big.clone()
        n = want.untyped_storage().nbytes()
        at = f"a fresh {str(dtype)[6:]} tensor of {n} B"
        ref = StorageWeakRef(big.untyped_storage())
        packed = call(FN, hooks.pack, big, at=at)
        del big
        gc.collect()
        assert ref.expired(), f"{FN}: the packed object still keeps the original storage alive (nothing freed) at {at}"
        out = call(FN, hooks.unpack, packed, at=at)
        assert out.dtype == dtype and torch.equal(out, want), (
            f"{FN}: unpack does not give back the saved values at {at}")
        assert hooks.d2h_bytes == hooks.h2d_bytes == n, (
            f"{FN}: d2h_bytes={hooks.d2h_bytes}, h2d_bytes={hooks.h2d_bytes}, expected {n} each way at {at}")


def check_CountingOffload__views(m):
    for dtype in (torch.float64, torch.float16):
        hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
        base = (torch.randn(32, 64, dtype=torch.float64) + 1).to(dtype)
        views = [base[:, :32], base.view(-1), base.t(), base[5:]]
        n = base.untyped_storage().nbytes()
        at = f"four views of one {str(dtype)[6:]} storage of {n} B"
        packed = [call(FN, hooks.pack, v, at=at) for v in views]
        assert hooks.d2h_bytes == n, f"{FN}: d2h_bytes is {hooks.d2h_bytes}, expected {n} (a storage once) at {at}"
        for i, (v, p) in enumerate(zip(views, packed)):
            out = call(FN, hooks.unpack, p, at=at)
            assert out.dtype == v.dtype and out.shape == v.shape and out.stride() == v.stride(), (
                f"{FN}: view {i} came back as {out.dtype} {tuple(out.shape)} stride {out.stride()}, saved was "
                f"{v.dtype} {tuple(v.shape)} stride {v.stride()} at {at}")
            assert torch.equal(out, v), f"{FN}: view {i} does not come back with its values at {at}"


def check_CountingOffload__unpacked_twice(m):
    hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
    t = torch.randn(32, 32, dtype=torch.float64)
    want, n = t.clone(), t.untyped_storage().nbytes()
    at = f"one {n} B tensor packed once, unpacked twice (a retained graph's second backward)"
    packed = call(FN, hooks.pack, t, at=at)
    first = call(FN, hooks.unpack, packed, at=at)
    first.mul_(-3.0)  # backward may write into what it unpacked: the next unpack needs a fresh copy
    second = call(FN, hooks.unpack, packed, at=at)
    assert torch.equal(second, want), f"{FN}: the second unpack does not give back the saved values at {at}"
    assert hooks.h2d_bytes == 2 * n, (
        f"{FN}: h2d_bytes is {hooks.h2d_bytes}, expected {2 * n} (each unpack copies the storage back) at {at}")


def check_CountingOffload__storages(m):
    # a storage rewritten in place between two packs: each pack saves the values it saw
    hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
    t = torch.randn(32, 32, dtype=torch.float64)
    at = "one 8 KiB tensor packed, rewritten in place (t.mul_(-3)), packed again"
    call(FN, hooks.pack, t, at=at)
    t.mul_(-3.0)
    second = call(FN, hooks.pack, t, at=at)
    assert torch.equal(call(FN, hooks.unpack, second, at=at), t), (
        f"{FN}: the second pack does not give back the rewritten values (a storage rewritten since its host copy "
        f"needs a new one: compare t._version) at {at}")

    # a new storage at the address of a freed one (an allocator reuses freed memory): a new storage
    hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
    buf = bytearray(4096)
    at = "a 4 KiB storage packed and freed, then a new storage with other values at the same address"
    buf[:] = array.array("d", [1.0] * 512).tobytes()
    old = torch.frombuffer(buf, dtype=torch.float64)
    first = call(FN, hooks.pack, old, at=at)
    ref = StorageWeakRef(old.untyped_storage())
    del old
    gc.collect()
    assert ref.expired(), f"{FN}: the packed object still keeps the original storage alive (nothing freed) at {at}"
    buf[:] = array.array("d", [2.0] * 512).tobytes()
    new = torch.frombuffer(buf, dtype=torch.float64)
    second = call(FN, hooks.pack, new, at=at)
    assert torch.equal(call(FN, hooks.unpack, second, at=at), torch.full((512,), 2.0, dtype=torch.float64)), (
        f"{FN}: the new storage comes back with the freed one's values (its host copy was reused: the address "
        f"alone does not tell a storage; is the storage it was copied from still alive?) at {at}")
    assert torch.equal(call(FN, hooks.unpack, first, at=at), torch.ones(512, dtype=torch.float64)), (
        f"{FN}: the freed storage no longer comes back with its own values at {at}")
    assert hooks.d2h_bytes == 2 * 4096, (
        f"{FN}: d2h_bytes is {hooks.d2h_bytes}, expected {2 * 4096} (two storages, each copied once) at {at}")

    # views of a storage whose version counter is past Python's small-int cache: still one storage
    hooks = call(FN, m.CountingOffload, [], MIN_BYTES, at="construction")
    t = torch.zeros(32, 32, dtype=torch.float64)
    for _ in range(300):
        t.add_(1.0)
    n = t.untyped_storage().nbytes()
    at = f"three views of one {n} B storage rewritten in place 300 times (t._version = {t._version})"
    views = [t, t.view(-1), t[3:]]
    packed = [call(FN, hooks.pack, v, at=at) for v in views]
    assert hooks.d2h_bytes == n, (
        f"{FN}: d2h_bytes is {hooks.d2h_bytes}, expected {n} (one storage, one copy; versions are ints, compare "
        f"them with ==) at {at}")
    for i, (v, p) in enumerate(zip(views, packed)):
        assert torch.equal(call(FN, hooks.unpack, p, at=at), v), f"{FN}: view {i} does not come back at {at}"


from bp_mech.checks import ex42_contract  # noqa: E402

# then the contract, the variant and the prediction (ex42_contract.py)
CHECKS = [check_CountingOffload, check_CountingOffload__bytes, check_CountingOffload__parameters,
          check_CountingOffload__min_bytes, check_CountingOffload__storage_freed, check_CountingOffload__views,
          check_CountingOffload__unpacked_twice, check_CountingOffload__storages, *ex42_contract.CHECKS]
