"""Part 02 · 42's exercise checks: the package's offload passes them, and each classic mistake (a mutant of
the answer, or a hand-written wrong offload) is caught."""

import pytest
import torch
from conftest import ROOT, load_solution

from bp_mech import offload
from bp_mech.checks import ex42

# --- the package's offload passes the exercise checks; the checks catch the mistakes ------


class _PackageOffload(offload.ActivationOffload):
    def __init__(self, params, min_bytes=1024):
        super().__init__(params, offload.OffloadConfig(min_bytes=min_bytes))
        self.pack, self.unpack = self._pack, self._unpack


# the package's offload stands for CountingOffload, but its counters cover the last forward only (it
# resets them on entry), where CountingOffload's accumulate: the __contract check is not its contract
PACKAGE_CHECKS = [c for c in ex42.CHECKS if c.__name__.startswith("check_CountingOffload")
                  and not c.__name__.endswith("__contract")]


@pytest.mark.parametrize("check", PACKAGE_CHECKS, ids=lambda c: c.__name__)
def test_package_offload_passes_the_ex42_checks(check):
    check(type("Sol", (), {"CountingOffload": _PackageOffload}))


class _Base(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, params, min_bytes=1024):
        self.params, self.min_bytes, self.d2h_bytes, self.h2d_bytes = list(params), min_bytes, 0, 0
        super().__init__(self.pack, self.unpack)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, meta = packed
        self.h2d_bytes += host.untyped_storage().nbytes()
        dev = host.clone()
        return torch.empty(0, dtype=meta[0]).set_(dev.untyped_storage(), *meta[1:])

    def _move(self, t):
        self.d2h_bytes += t.untyped_storage().nbytes()
        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()
        return raw, (t.dtype, t.storage_offset(), t.size(), t.stride())


class _OffloadsParameters(_Base):  # no parameter rule
    def pack(self, t):
        return t if t.untyped_storage().nbytes() < self.min_bytes else self._move(t)


class _CountsViewsTwice(_Base):  # one copy per saved tensor, views of one storage included
    def pack(self, t):
        ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        if t.untyped_storage().data_ptr() in ptrs or t.untyped_storage().nbytes() < self.min_bytes:
            return t
        return self._move(t)


class _KeepsTheOriginal(_Base):  # counts and copies, but the packed object holds t too
    def pack(self, t):
        ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        if t.untyped_storage().data_ptr() in ptrs or t.untyped_storage().nbytes() < self.min_bytes:
            return t
        self.d2h_bytes += t.untyped_storage().nbytes()
        return t

    def unpack(self, packed):
        self.h2d_bytes += 0 if packed.untyped_storage().nbytes() < self.min_bytes else packed.untyped_storage().nbytes()
        return packed


_ANSWER = load_solution(ROOT / "answers", "ex42_offload").CountingOffload  # right; each mutant breaks one rule


class _LazyParams(_ANSWER):  # keeps the iterable it was given: a generator is empty from the second pack on
    def __init__(self, params, min_bytes=1024):
        super().__init__([], min_bytes)
        self.params = params

    def pack(self, t):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        return super().pack(t)


class _KeepsAtTheLimit(_ANSWER):  # <= instead of <: a storage of exactly min_bytes stays
    def pack(self, t):
        return t if t.untyped_storage().nbytes() <= self.min_bytes else super().pack(t)


class _SizeOfTheView(_ANSWER):  # the view's bytes decide, not its storage's: a small view of a big storage stays
    def pack(self, t):
        return t if t.numel() * t.element_size() < self.min_bytes else super().pack(t)


class _EightBytesPerElement(_ANSWER):  # elements times 8 for the size and the count: right for float64 only
    def pack(self, t):
        n = t.untyped_storage().nbytes()
        if n // t.element_size() * 8 < self.min_bytes:
            return t
        before = self.d2h_bytes
        out = super().pack(t)
        if self.d2h_bytes > before:
            self.d2h_bytes += n // t.element_size() * 8 - n
        return out


class _RebuildsAsFloat64(_ANSWER):  # the dtype of the development run, typed into unpack
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, _, offset, size, stride, device = packed
        return super().unpack((host, torch.float64, offset, size, stride, device))


class _FreesHostOnUnpack(_ANSWER):  # drops the host copy at the first unpack: a second one has nothing
    def pack(self, t):
        out = super().pack(t)
        return out if isinstance(out, torch.Tensor) else [out]

    def unpack(self, packed):
        return packed if isinstance(packed, torch.Tensor) else super().unpack(packed.pop())


class _HandsOutTheHostCopy(_ANSWER):  # no copy back: backward writes into the host copy itself
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, offset, size, stride, _device = packed
        self.h2d_bytes += host.numel()
        return torch.empty(0, dtype=dtype).set_(host.untyped_storage(), offset, size, stride)


@pytest.mark.parametrize("cls,check", [
    (_OffloadsParameters, ex42.check_CountingOffload__parameters),
    (_OffloadsParameters, ex42.check_CountingOffload),
    (_CountsViewsTwice, ex42.check_CountingOffload__views),
    (_CountsViewsTwice, ex42.check_CountingOffload),
    (_KeepsTheOriginal, ex42.check_CountingOffload__storage_freed),
    (_LazyParams, ex42.check_CountingOffload__parameters),
    (_KeepsAtTheLimit, ex42.check_CountingOffload__min_bytes),
    (_SizeOfTheView, ex42.check_CountingOffload__min_bytes),
    (_EightBytesPerElement, ex42.check_CountingOffload__min_bytes),
    (_RebuildsAsFloat64, ex42.check_CountingOffload__views),
    (_FreesHostOnUnpack, ex42.check_CountingOffload__unpacked_twice),
    (_FreesHostOnUnpack, ex42.check_CountingOffload),
    (_HandsOutTheHostCopy, ex42.check_CountingOffload__unpacked_twice),
])
def test_ex42_checks_catch_offload_mistakes(cls, check):
    with pytest.raises(AssertionError, match="^CountingOffload: "):
        check(type("Sol", (), {"CountingOffload": cls}))
