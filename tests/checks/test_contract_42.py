"""Part 02 · 42: every property the ex42 contract checks hold is caught on a wrong solution that breaks
exactly it (mutants), and the variant's and the prediction's classic mistakes are caught too."""

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech.checks import ex42, ex42_contract

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


CONTRACT = [
    (_zeroes_original, "t was modified in place"), (_float_counters, "d2h_bytes is a float, expected an int"),
    (_swallows, "swallowed the KeyError"), (_never_exits, "they were not removed on exit"),
    (_resets_on_enter, "entering again must accumulate"),
]


@pytest.mark.parametrize("wrap, match", CONTRACT)
@pytest.mark.parametrize("cls", ["CountingOffload", "BudgetOffload"])
def test_contract_mutants_are_caught(cls, wrap, match):
    check = getattr(ex42_contract, f"check_{cls}__contract")
    try:
        with pytest.raises(AssertionError, match=match):
            check(mutant(NAME, **{cls: wrap(getattr(ANSWERS, cls))}))
    finally:
        _clear_hooks()


@pytest.mark.parametrize("cls, bad", [("CountingOffload", _SharedHostCopies), ("BudgetOffload", _SharedFates)])
def test_shared_state_is_caught(cls, bad):
    with pytest.raises(AssertionError, match="the instances share state"):
        getattr(ex42_contract, f"check_{cls}__contract")(mutant(NAME, **{cls: bad}))


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


class _ParamsUseBudget(Budget):
    def __init__(self, params, budget):
        super().__init__([], budget)


class _KeepsOriginal(Budget):
    def pack(self, t):
        out = super().pack(t)
        return out if isinstance(out, torch.Tensor) else (*out, t)  # t rides along: never freed

    def unpack(self, packed):
        return super().unpack(packed if isinstance(packed, torch.Tensor) else packed[:6])


@pytest.mark.parametrize("cls, check, match", [
    (_Strict, ex42_contract.check_BudgetOffload__rules, "1024 B storage under a 1024 B budget was moved"),
    (_StopsAtFirstOverflow, ex42_contract.check_BudgetOffload__rules, "the small one still fits"),
    (_PerTensor, ex42_contract.check_BudgetOffload__rules, "expected 16384"),
    (_ParamsUseBudget, ex42_contract.check_BudgetOffload__rules, "parameters use no budget"),
    (_KeepsOriginal, ex42_contract.check_BudgetOffload__rules, "keeps its storage alive"),
    (_PerTensor, ex42_contract.check_BudgetOffload, "the budget rule replayed"),
])
def test_budget_offload_mistakes_are_caught(cls, check, match):
    with pytest.raises(AssertionError, match=match):
        check(mutant(NAME, BudgetOffload=cls))


# --- the prediction: classic mistakes ---------------------------------------------------


def _predict(no_threshold=False, per_element=False, no_input=False, both_ways=False, as_float=False):
    def f(b, t, c, e, layers, min_bytes, nbytes):
        H = b * t * c * nbytes
        size = (lambda n: n // nbytes) if per_element else (lambda n: n)
        fits = (lambda n: True) if no_threshold else (lambda n: size(n) >= min_bytes)
        per_layer = (0 if no_input or not fits(H) else H) + (2 * e * H if fits(e * H) else 0)
        out = layers * per_layer * (2 if both_ways else 1)
        return float(out) if as_float else out
    return f


@pytest.mark.parametrize("kw, match", [
    ({"no_threshold": True}, "predicted"), ({"per_element": True}, "predicted"), ({"no_input": True}, "predicted"),
    ({"both_ways": True}, "predicted"), ({"as_float": True}, "the prediction is a float, expected an int")])
def test_predict_d2h_bytes_mistakes_are_caught(kw, match):
    with pytest.raises(AssertionError, match=match):
        ex42_contract.check_predict_d2h_bytes(mutant(NAME, predict_d2h_bytes=_predict(**kw)))


def test_every_ex42_check_passes_on_the_answers():
    for check in ex42.CHECKS:
        check(ANSWERS)
