"""Part 02 · 42: every property the ex42 checks hold (``ex42``'s declarations, graded by scenarios on
``checks.engine``) is caught on a wrong solution that breaks exactly it (mutants), and the variant's and the
prediction's classic mistakes are caught too."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from conftest import ROOT, load_solution, mutant

from bp_mech.checks import ex42

pytestmark = pytest.mark.usefixtures("one_thread")
_HOST, _FATE = {}, {}  # one host map for every instance of the shared-state mutants

ANSWERS = load_solution(ROOT / "answers", "ex42_offload")
NAME = "ex42_offload"
Counting, Budget = ANSWERS.CountingOffload, ANSWERS.BudgetOffload


def _clear_hooks():
    """Pop whatever saved-tensor hooks a mutant left installed (it must not leak into other tests)."""
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _zeroes_original(base):
    class M(base):
        def pack(self, t):
            out = super().pack(t)
            if not isinstance(out, torch.Tensor):
                with torch.no_grad():
                    t.zero_()  # "free" the device copy by overwriting it: the forward still reads it
            return out
    return M


def _float_counters(base):
    class M(base):
        def pack(self, t):
            out = super().pack(t)
            self.d2h_bytes = float(self.d2h_bytes)
            return out
    return M


def _swallows(base):
    class M(base):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            return True  # the forward's exception disappears
    return M


def _never_exits(base):
    class M(base):
        def __exit__(self, *exc):
            return None  # the hooks stay installed
    return M


def _resets_on_enter(base):
    class M(base):
        def __enter__(self):
            self.d2h_bytes = self.h2d_bytes = 0  # "the last forward only": not what the docstring says
            return super().__enter__()
    return M


class _SharedHostCopies(Counting):
    def __init__(self, params, min_bytes=1024):
        super().__init__(params, min_bytes)
        self._host = _HOST


class _SharedFates(Budget):
    def __init__(self, params, budget):
        super().__init__(params, budget)
        self._fate = _FATE


def _reseeds(base):
    class M(base):
        def pack(self, t):
            torch.manual_seed(0)  # "the same host buffers every run": the caller's RNG reset
            return super().pack(t)
    return M


def _grad_mode_off(base):
    class M(base):
        def __exit__(self, *exc):
            torch.set_grad_enabled(False)  # "backward needs no new graph": a global switch left flipped
            return super().__exit__(*exc)
    return M


CONTRACT = [
    (_zeroes_original, r"given\['t'\] was modified in place"),
    (_float_counters, r"d2h_bytes of two instances .*\[0\] is a float, expected an int"),
    (_swallows, "with block whose body raises KeyError'\\] is 'nothing: it was swallowed'"),
    (_never_exits, r"d2h_bytes moved by a forward after the with block .* is [1-9]"),
    (_resets_on_enter, r"d2h_bytes after two forwards'\] is \d+, .* gives \d+"),
    (_reseeds, "left the torch RNG state changed"), (_grad_mode_off, "left the grad mode changed"),
]


@pytest.mark.parametrize("wrap, match", CONTRACT)
@pytest.mark.parametrize("cls", ["CountingOffload", "BudgetOffload"])
def test_contract_mutants_are_caught(cls, wrap, match):
    check = getattr(ex42, f"check_{cls}__contract")
    try:
        with pytest.raises(AssertionError, match=f"^{cls}: .*{match}"):
            check(mutant(NAME, **{cls: wrap(getattr(ANSWERS, cls))}))
    finally:
        _clear_hooks()


@pytest.mark.parametrize("cls, bad", [("CountingOffload", _SharedHostCopies), ("BudgetOffload", _SharedFates)])
def test_shared_state_is_caught(cls, bad):
    with pytest.raises(AssertionError, match=r"d2h_bytes of two instances that each packed one 32 KiB storage'\]\[1\]"):
        getattr(ex42, f"check_{cls}__contract")(mutant(NAME, **{cls: bad}))


# --- telling storages apart: the address is not enough ------------------------------------


def _counting_keyed(stale):
    """CountingOffload whose host copy of a storage is reused while ``stale(entry, st, t)`` is False."""
    class M(Counting):
        def pack(self, t):
            st = t.untyped_storage()
            if st.data_ptr() in self._param_ptrs or st.nbytes() < self.min_bytes:
                return t
            entry = self._host.get(st.data_ptr())
            if entry is None or stale(entry, st, t):
                host = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st).to("cpu", copy=True)
                self.d2h_bytes += st.nbytes()
                entry = self._host[st.data_ptr()] = (StorageWeakRef(st), t._version, host)
            return entry[2], t.dtype, t.storage_offset(), t.size(), t.stride(), t.device
    return M


class _DefaultMinBytes1023(Counting):
    def __init__(self, params, min_bytes=1023):
        super().__init__(params, min_bytes)


@pytest.mark.parametrize("bad, check, match", [
    (_counting_keyed(lambda e, st, t: False), ex42.check_CountingOffload__storages,
     r"the second pack, unpacked'\] differs"),
    (_counting_keyed(lambda e, st, t: e[1] != t._version), ex42.check_CountingOffload__storages,
     r"the new storage, unpacked'\] differs"),
    (_counting_keyed(lambda e, st, t: e[0].expired() or e[1] is not t._version),
     ex42.check_CountingOffload__storages, r"d2h_bytes'\] is 24576, .* gives 8192 .*'old version'"),
    (_DefaultMinBytes1023, ex42.check_CountingOffload__min_bytes, r"moved'\] is True, .* uint8 tensor of 1023 B"),
])
def test_storage_identity_mistakes_are_caught(bad, check, match):
    with pytest.raises(AssertionError, match=f"^CountingOffload: .*{match}"):
        check(mutant(NAME, CountingOffload=bad))


# --- the variant: classic mistakes of a budgeted offload --------------------------------


class _Strict(Budget):  # "< budget": a storage that exactly fills the budget is moved
    def __init__(self, params, budget):
        super().__init__(params, budget - 1)


class _StopsAtFirstOverflow(Budget):  # once one storage moved, every later one moves too
    def pack(self, t):
        if self.d2h_bytes:
            self.budget = self.resident_bytes
        return super().pack(t)


class _PerTensor(Budget):  # forgets the storages it saw: each view is a new storage
    def pack(self, t):
        self._fate = {}
        return super().pack(t)


class _KeepsResidentBytes(Budget):  # a new forward forgets the storages it saw, but not the budget they used
    def __enter__(self):
        resident = self.resident_bytes
        out = super().__enter__()
        self.resident_bytes = resident
        return out


class _ParamsUseBudget(Budget):
    def __init__(self, params, budget):
        super().__init__([], budget)


class _KeepsOriginal(Budget):
    def pack(self, t):
        out = super().pack(t)
        return out if isinstance(out, torch.Tensor) else (*out, t)  # t rides along: never freed

    def unpack(self, packed):
        return super().unpack(packed if isinstance(packed, torch.Tensor) else packed[:6])


class _UnpacksIntoHostCopy(Budget):  # the host copy itself comes back: backward may write into it
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, offset, size, stride, device = packed
        self.h2d_bytes += host.numel()
        return torch.empty(0, dtype=dtype, device=device).set_(host.untyped_storage(), offset, size, stride)


@pytest.mark.parametrize("cls, check, match", [
    (_Strict, ex42.check_BudgetOffload__rules, r"of a 1024 B storage under a 1024 B budget'\]\[0\] is 0"),
    (_UnpacksIntoHostCopy, ex42.check_BudgetOffload__rules,
     r"the run\[.a second unpack, after the first one's result was written in place.\] differs"),
    (_StopsAtFirstOverflow, ex42.check_BudgetOffload__rules, r"d2h_bytes'\] is 17408, .* gives 16384"),
    (_PerTensor, ex42.check_BudgetOffload__rules, r"d2h_bytes'\] is \d+, .* gives 16384"),
    (_ParamsUseBudget, ex42.check_BudgetOffload__rules, r"d2h_bytes'\] is 32768, .* gives 16384"),
    (_KeepsOriginal, ex42.check_BudgetOffload__rules,
     r"the run\[.a moved tensor's storage freed after pack.\] is False"),
    (_PerTensor, ex42.check_BudgetOffload, r"(d2h|resident)_bytes'\] is \d+, .* the budget rule replayed"),
    (_KeepsResidentBytes, ex42.check_BudgetOffload__contract, r"d2h_bytes after two forwards'\] is 344064"),
])
def test_budget_offload_mistakes_are_caught(cls, check, match):
    with pytest.raises(AssertionError, match=f"^BudgetOffload: .*{match}"):
        check(mutant(NAME, BudgetOffload=cls))


# --- the prediction: classic mistakes ---------------------------------------------------


def _predict(no_threshold=False, per_element=False, no_input=False, both_ways=False, as_float=False, strict=False,
             bitwise_or=False):
    def f(b, t, c, e, layers, min_bytes, nbytes):
        H = b * t * c * nbytes
        size = (lambda n: n // nbytes) if per_element else (lambda n: n)
        fits = (lambda n: True) if no_threshold else (lambda n: size(n) > min_bytes) if strict else \
            (lambda n: size(n) >= min_bytes)
        add = (lambda u, v: u | v) if bitwise_or else (lambda u, v: u + v)
        per_layer = add(0 if no_input or not fits(H) else H, 2 * e * H if fits(e * H) else 0)
        out = layers * per_layer * (2 if both_ways else 1)
        return float(out) if as_float else out
    return f


PREDICTED = "the prediction is .* the offload hooks' count gives"


@pytest.mark.parametrize("kw, match", [
    ({"no_threshold": True}, PREDICTED), ({"per_element": True}, PREDICTED), ({"no_input": True}, PREDICTED),
    ({"both_ways": True}, PREDICTED), ({"as_float": True}, "the prediction is a float, expected an int"),
    ({"strict": True}, PREDICTED), ({"bitwise_or": True}, PREDICTED)])
def test_predict_d2h_bytes_mistakes_are_caught(kw, match):
    with pytest.raises(AssertionError, match=f"^predict_d2h_bytes: {match}"):
        ex42.check_predict_d2h_bytes(mutant(NAME, predict_d2h_bytes=_predict(**kw)))


def test_every_ex42_check_passes_on_the_answers():
    for check in ex42.CHECKS:
        check(ANSWERS)
