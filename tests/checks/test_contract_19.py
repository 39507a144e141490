"""Part 02 · 19: every property the ex19 checks hold (``ex19``'s declarations, derived by ``checks.engine``) is
caught on a wrong solution that breaks exactly it (mutants), and the variant's and the prediction's classic
mistakes are caught too."""

import itertools

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech.checkpointing import CheckpointedBlock
from bp_mech.checks import ex19, ex19_variant
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


class _LeavesGradModeOff(CheckpointedBlock):
    def forward(self, x):
        y = super().forward(x)
        torch.set_grad_enabled(False)  # "no graph needed after the forward": a global switch left flipped
        return y


class _SetsEval(CheckpointedBlock):
    def forward(self, x):
        self.block.eval()  # "the recompute must not be stochastic": the caller's train flags changed
        return super().forward(x)


class _Reseeds(CheckpointedBlock):
    def forward(self, x):
        torch.manual_seed(0)  # "the recompute must draw the same dropout masks": the caller's RNG reset
        return super().forward(x)


@pytest.mark.parametrize("cls, check, match", [
    (_ModifiesInput, ex19.check_CheckpointedBlock, "x was modified in place"),
    (_FlagsInput, ex19.check_CheckpointedBlock, "x.requires_grad after the forward is True, .* gives False"),
    (_ContiguousOnly, ex19.check_CheckpointedBlock, "raised RuntimeError at x, dy as non-contiguous"),
    (_StorageOrder, ex19.check_CheckpointedBlock, "y differs from a plain run of the block"),
    (_FloatCalls, ex19.check_CheckpointedBlock, "calls after a forward is a float, expected an int"),
    (_SharedCounter, ex19.check_CheckpointedBlock, r"calls .* is \d+, .* gives \d+"),
    (_Swallows, ex19.check_CheckpointedBlock__block_raises, "returned a float64 tensor .* expected KeyError"),
    (_LeavesGradModeOff, ex19.check_CheckpointedBlock, "left the grad mode changed"),
    (_SetsEval, ex19.check_CheckpointedBlock, r"left the block(\.\d)?\.training changed"),
    (_Reseeds, ex19.check_CheckpointedBlock, "left the torch RNG state changed"),
])
def test_checkpointed_block_contract_mutants_are_caught(cls, check, match):
    with pytest.raises(AssertionError, match=f"^CheckpointedBlock: .*{match}"):
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


def _hooks_kept_on_error(modules, step):  # removes its hooks only when step returns
    counts = [0] * len(modules)
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, m in enumerate(modules)]
    step()
    for h in handles:
        h.remove()
    return counts


def _reseeds(modules, step):
    torch.manual_seed(0)  # "the step draws dropout masks": the caller's RNG reset
    return ANSWERS.count_forward_calls(modules, step)


def _ran_or_not(modules, step):  # a set of the modules that ran: whether, not how often
    ran = set()
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: ran.add(i)) for i, m in enumerate(modules)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return [int(i in ran) for i in range(len(modules))]


@pytest.mark.parametrize("f, check, match", [
    (_tensor_counts, ex19.check_count_forward_calls, r"the counts\[0\] is a int64 tensor"),
    (_tuple_counts, ex19.check_count_forward_calls, "the counts is a tuple, expected a list"),
    (_swallowing_counts, ex19.check_count_forward_calls__step_raises, "returned a list .* expected KeyError"),
    (_hooks_kept_on_error, ex19.check_count_forward_calls__step_raises,
     "forward pre hooks changed .* also when raising"),
    (_reseeds, ex19.check_count_forward_calls, "left the torch RNG state changed"),
    (_ran_or_not, ex19.check_count_forward_calls, r"the counts\[\d\] is 1, each module's own counter gives 2"),
])
def test_count_forward_calls_contract_mutants_are_caught(f, check, match):
    with pytest.raises(AssertionError, match=f"^count_forward_calls: .*{match}"):
        check(mutant(NAME, count_forward_calls=f))


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


def _xor_savings(A, H, budget):  # A ^ H for A - H: the same where H's bits are A's, more elsewhere
    if sum(H) > budget:
        raise ValueError("nothing fits")
    need, chosen = sum(A) - budget, []
    for i in sorted(range(len(A)), key=lambda i: A[i] - H[i], reverse=True):
        if need <= 0:
            break
        chosen.append(i)
        need -= A[i] ^ H[i]
    return sorted(chosen)


def _reseeds_choice(A, H, budget):
    torch.manual_seed(0)
    return ANSWERS.choose_checkpoint_layers(A, H, budget)


@pytest.mark.parametrize("f, match", [
    (_first_layers, "layers checkpointed is"), (_largest_saved_first, "layers checkpointed is"),
    (_empty_when_nothing_fits, "returned a list for a budget no set fits .* expected ValueError"),
    (_strict, "layers checkpointed is"), (_float_sums, "bytes over the budget is|layers checkpointed is"),
    (_sorts_in_place, r"saved_bytes(\[\d\])? was modified in place"), (_unsorted, "the layers' order is '\\[2, 1\\]'"),
    (_as_tuple, "the result is 'a tuple'"), (_reseeds_choice, "left the torch RNG state changed"),
    (_xor_savings, "bytes over the budget is 2, .* both needed"),
])
def test_choose_checkpoint_layers_mistakes_are_caught(f, match):
    with pytest.raises(AssertionError, match=f"^choose_checkpoint_layers: .*{match}"):
        ex19.check_choose_checkpoint_layers(mutant(NAME, choose_checkpoint_layers=f))


def test_the_measured_check_catches_an_over_budget_policy():
    with pytest.raises(AssertionError, match="bytes over the budget is .* the bytes kept"):
        ex19.check_choose_checkpoint_layers__measured(
            mutant(NAME, choose_checkpoint_layers=lambda A, H, b: ANSWERS.choose_checkpoint_layers(A, H, b)[1:]))


def test_brute_force_agrees_with_the_answer_on_every_small_instance():
    for A in itertools.product((0, 3, 7), repeat=3):
        H = [a // 2 for a in A]
        for budget in range(sum(H), sum(A) + 1):
            assert len(ANSWERS.choose_checkpoint_layers(list(A), H, budget)) == ex19_variant.fewest(A, H, budget)


# --- the prediction: classic mistakes ---------------------------------------------------


def _predict(off_by_one=False, no_input=False, four_bytes=False, as_float=False, nonzero_every=False):
    def f(b, t, c, e, layers, every, nbytes):
        H = b * t * c * (4 if four_bytes else nbytes)
        A = (0 if no_input else H) + 2 * e * H
        on = every != 0 if nonzero_every else every > 0  # every != 0: a negative every checkpoints every layer
        ck = sum(1 for i in range(layers) if on and i % every == (every - 1 if off_by_one else 0))
        out = ck * H + (layers - ck) * A
        return float(out) if as_float else out
    return f


PREDICTED = "the prediction is .* counting-only saved_tensors_hooks gives"


@pytest.mark.parametrize("kw, match", [({"off_by_one": True}, PREDICTED), ({"no_input": True}, PREDICTED),
                                       ({"four_bytes": True}, PREDICTED), ({"nonzero_every": True}, PREDICTED),
                                       ({"as_float": True}, "the prediction is a float, expected an int")])
def test_predict_saved_bytes_mistakes_are_caught(kw, match):
    with pytest.raises(AssertionError, match=f"^predict_saved_bytes: {match}"):
        ex19.check_predict_saved_bytes(mutant(NAME, predict_saved_bytes=_predict(**kw)))


def test_every_ex19_check_passes_on_the_answers():
    for check in ex19.CHECKS:
        check(ANSWERS)
