"""Part 02 · 19: every property the ex19 contract checks hold is caught on a wrong solution that breaks
exactly it (mutants), and the variant's and the prediction's classic mistakes are caught too."""

import itertools

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech.checkpointing import CheckpointedBlock
from bp_mech.checks import ex19, ex19_contract
from checks.mutants import contiguous_only

pytestmark = pytest.mark.usefixtures("one_thread")  # hypothesis shrinks a failure over many tiny cases
_TOTAL = [0]  # the one counter of _SharedCounter

ANSWERS = load_solution(ROOT / "answers", "ex19_checkpointing")
NAME = "ex19_checkpointing"


class _ModifiesInput(CheckpointedBlock):
    def forward(self, x):
        y = super().forward(x)
        with torch.no_grad():
            x.mul_(1.5)  # the input reused as a buffer
        return y


class _FlagsInput(CheckpointedBlock):
    def forward(self, x):
        return super().forward(x.requires_grad_(True) if x.is_leaf else x)  # "the recompute needs it"


class _ContiguousOnly(CheckpointedBlock):
    forward = contiguous_only(CheckpointedBlock.forward)


class _StorageOrder(CheckpointedBlock):
    def forward(self, x):  # reads x in storage order: right only when x is contiguous
        return super().forward(x.as_strided(x.shape, x.contiguous().stride()) if not x.is_contiguous() else x)


class _FloatCalls(CheckpointedBlock):
    def _run(self, x):
        self.calls += 0.0  # an int that became a float
        return super()._run(x)


class _SharedCounter(CheckpointedBlock):
    def _run(self, x):
        _TOTAL[0] += 1  # one counter for every block
        self.calls = _TOTAL[0]
        return self.block(x)


class _Swallows(CheckpointedBlock):
    def forward(self, x):
        try:
            return super().forward(x)
        except Exception:  # noqa: BLE001
            return x  # "a failing block leaves its input as it was"


@pytest.mark.parametrize("cls, check, match", [
    (_ModifiesInput, ex19_contract.check_CheckpointedBlock__contract, "x was modified in place"),
    (_FlagsInput, ex19_contract.check_CheckpointedBlock__contract, "x.requires_grad was changed"),
    (_ContiguousOnly, ex19_contract.check_CheckpointedBlock__contract, "raised RuntimeError at x of shape"),
    (_StorageOrder, ex19_contract.check_CheckpointedBlock__contract, "output differs from the plain block"),
    (_FloatCalls, ex19_contract.check_CheckpointedBlock__contract, "calls is a float, expected an int"),
    (_SharedCounter, ex19_contract.check_CheckpointedBlock__instances, "the blocks share a counter"),
    (_Swallows, ex19_contract.check_CheckpointedBlock__instances, r"expected KeyError \(do not swallow it\)"),
])
def test_checkpointed_block_contract_mutants_are_caught(cls, check, match):
    with pytest.raises(AssertionError, match=match):
        check(mutant(NAME, CheckpointedBlock=cls))


def _tensor_counts(modules, step):
    return [torch.tensor(c) for c in ANSWERS.count_forward_calls(modules, step)]


def _tuple_counts(modules, step):
    return tuple(ANSWERS.count_forward_calls(modules, step))


def _swallowing_counts(modules, step):
    try:
        return ANSWERS.count_forward_calls(modules, step)
    except Exception:  # noqa: BLE001
        return [0] * len(modules)


@pytest.mark.parametrize("f, match", [(_tensor_counts, "count 0 is a int64 tensor"),
                                      (_tuple_counts, "the result is a tuple, expected a list"),
                                      (_swallowing_counts, r"expected KeyError \(do not swallow it\)")])
def test_count_forward_calls_contract_mutants_are_caught(f, match):
    with pytest.raises(AssertionError, match=match):
        ex19_contract.check_count_forward_calls__contract(mutant(NAME, count_forward_calls=f))


# --- the variant: classic mistakes of a budgeted policy ---------------------------------


def _first_layers(A, H, budget):  # checkpoints from the first layer on: fits, but not the fewest
    if sum(H) > budget:
        raise ValueError("nothing fits")
    chosen = []
    for i in range(len(A)):
        if sum(H[j] if j in chosen else a for j, a in enumerate(A)) <= budget:
            break
        chosen.append(i)
    return chosen


def _largest_saved_first(A, H, budget):  # sorts by A, not by what checkpointing saves (A - H)
    if sum(H) > budget:
        raise ValueError("nothing fits")
    chosen = []
    for i in sorted(range(len(A)), key=lambda i: A[i], reverse=True):
        if sum(H[j] if j in chosen else a for j, a in enumerate(A)) <= budget:
            break
        chosen.append(i)
    return sorted(chosen)


def _empty_when_nothing_fits(A, H, budget):
    return [] if sum(H) > budget else ANSWERS.choose_checkpoint_layers(A, H, budget)


def _strict(A, H, budget):  # "< budget": a step exactly at the budget is taken for one over it
    return ANSWERS.choose_checkpoint_layers(A, H, budget - 1) if sum(H) <= budget - 1 else list(range(len(A)))


def _float_sums(A, H, budget):  # float arithmetic: rounds byte counts above 2**53
    if float(sum(map(float, H))) > budget:
        raise ValueError("nothing fits")
    need, chosen = float(sum(map(float, A))) - budget, []
    for i in sorted(range(len(A)), key=lambda i: float(A[i]) - float(H[i]), reverse=True):
        if need <= 0:
            break
        chosen.append(i)
        need -= float(A[i]) - float(H[i])
    return sorted(chosen)


def _sorts_in_place(A, H, budget):
    out = ANSWERS.choose_checkpoint_layers(A, H, budget)
    A.sort()
    return out


def _unsorted(A, H, budget):
    return sorted(ANSWERS.choose_checkpoint_layers(A, H, budget), reverse=True)


def _as_tuple(A, H, budget):
    return tuple(ANSWERS.choose_checkpoint_layers(A, H, budget))


@pytest.mark.parametrize("f, match", [
    (_first_layers, "are enough"), (_largest_saved_first, "are enough"),
    (_empty_when_nothing_fits, "expected ValueError"), (_strict, "are enough"),
    (_float_sums, "over the budget|are enough"), (_sorts_in_place, r"saved_bytes(\[\d\])? was modified in place"),
    (_unsorted, "ascending"), (_as_tuple, "the result is a tuple, expected a list"),
])
def test_choose_checkpoint_layers_mistakes_are_caught(f, match):
    with pytest.raises(AssertionError, match=match):
        ex19_contract.check_choose_checkpoint_layers(mutant(NAME, choose_checkpoint_layers=f))


def test_the_measured_check_catches_an_over_budget_policy():
    with pytest.raises(AssertionError, match="over budget"):
        ex19_contract.check_choose_checkpoint_layers__measured(
            mutant(NAME, choose_checkpoint_layers=lambda A, H, b: ANSWERS.choose_checkpoint_layers(A, H, b)[1:]))


def test_brute_force_agrees_with_the_answer_on_every_small_instance():
    for A in itertools.product((0, 3, 7), repeat=3):
        H = [a // 2 for a in A]
        for budget in range(sum(H), sum(A) + 1):
            assert len(ANSWERS.choose_checkpoint_layers(list(A), H, budget)) == ex19_contract._fewest(A, H, budget)


# --- the prediction: classic mistakes ---------------------------------------------------


def _predict(off_by_one=False, no_input=False, four_bytes=False, as_float=False):
    def f(b, t, c, e, layers, every, nbytes):
        H = b * t * c * (4 if four_bytes else nbytes)
        A = (0 if no_input else H) + 2 * e * H
        ck = sum(1 for i in range(layers) if every and i % every == (every - 1 if off_by_one else 0))
        out = ck * H + (layers - ck) * A
        return float(out) if as_float else out
    return f


@pytest.mark.parametrize("kw, match", [({"off_by_one": True}, "predicted"), ({"no_input": True}, "predicted"),
                                       ({"four_bytes": True}, "predicted"),
                                       ({"as_float": True}, "the prediction is a float, expected an int")])
def test_predict_saved_bytes_mistakes_are_caught(kw, match):
    with pytest.raises(AssertionError, match=match):
        ex19_contract.check_predict_saved_bytes(mutant(NAME, predict_saved_bytes=_predict(**kw)))


def test_every_ex19_check_passes_on_the_answers():
    for check in ex19.CHECKS:
        check(ANSWERS)
