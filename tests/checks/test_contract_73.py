"""Project 73: every property the exercise checks hold is broken by one mutant (an otherwise right
solution), and the check rejects it with its message."""

import pytest
import torch
from conftest import ROOT, load_solution, mutant

from bp_mech.checks import ex73
from bp_mech.projects.baseline_loss import loss_divisor, shard_rows
from checks.mutants import leaks

A = load_solution(ROOT / "answers", "ex73_baseline")


def _solution(**over):
    return mutant("ex73_baseline", **over)


# --- shard_rows -------------------------------------------------------------------------------------

def _shard_modifies(batch, rank, P):
    out = {k: v.clone() for k, v in shard_rows(batch, rank, P).items()}
    next(iter(batch.values())).zero_()
    return out


def _shard_flattens(batch, rank, P):  # view(-1): fails on a non-contiguous tensor
    E = next(iter(batch.values())).shape[0]
    if P < 1 or E % P or not 0 <= rank < P:
        raise ValueError("uneven")
    b = E // P
    return {k: v.view(-1).view(E, *v.shape[1:])[rank * b:(rank + 1) * b] for k, v in batch.items()}


def _shard_2d_only(batch, rank, P):  # written for (E, T) tensors: other trailing shapes come back flattened
    return {k: v.reshape(v.shape[0], -1) for k, v in shard_rows(batch, rank, P).items()}


def _shard_zero_division(batch, rank, P):
    E = next(iter(batch.values())).shape[0]
    if E % P or not 0 <= rank < P:  # ZeroDivisionError at P = 0
        raise ValueError("uneven")
    return shard_rows(batch, rank, P)


@pytest.mark.parametrize("bad, needle", [
    (_shard_modifies, r"shard_rows: batch\['input_ids'\] was modified in place"),
    (_shard_flattens, r"shard_rows: raised RuntimeError at .*views"),
    (_shard_2d_only, r"shard_rows: the shard\['(weights|hidden)'\] has shape"),
    (_shard_zero_division,
     r"shard_rows: raised ZeroDivisionError for rank 0 of 0 processes over \d+ rows, expected ValueError"),
], ids=["modifies-batch", "flattens", "two-dims-only", "zero-processes"])
def test_shard_rows_contract_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex73.check_shard_rows(_solution(shard_rows=bad))


# --- loss_divisor -------------------------------------------------------------------------------------

def _div_modifies(counts, P, all_reduce):
    out = loss_divisor(counts, P, all_reduce)
    counts[0].add_(1)
    return out


def _div_per_micro_batch(counts, P, all_reduce):  # one all-reduce per micro-batch: right value, k collectives
    return sum(all_reduce(torch.as_tensor(c)) for c in counts) / P


def _div_swallows(counts, P, all_reduce):
    try:
        return loss_divisor(counts, P, all_reduce)
    except Exception:  # noqa: BLE001
        return torch.stack(list(counts)).sum().double()


@pytest.mark.parametrize("bad, needle", [
    (_div_modifies, r"loss_divisor: local_counts\[0\]\[0\] was modified in place"),
    (lambda c, P, ar: ar(torch.stack(list(c)).sum()) // P, r"loss_divisor: rank 0 returned .*expected a 0-dim float"),
    (lambda c, P, ar: ar(torch.stack(list(c)).sum()).item() / P, r"expected a 0-dim floating-point tensor"),
    (lambda c, P, ar: (ar(torch.stack(list(c)).sum()), torch.stack(list(c)).sum().double())[1],
     r"loss_divisor: D per rank\[\d\] differs from N / P"),
    (_div_per_micro_batch, r"loss_divisor: all_reduce calls per rank\[0\] is [2-9]"),
    (_div_swallows, r"let the collective's exception propagate"),
], ids=["modifies-counts", "integer-division", "python-float", "per-rank-mean", "one-all-reduce-per-micro-batch",
        "swallows-collective-error"])
def test_loss_divisor_contract_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex73.check_loss_divisor(_solution(loss_divisor=bad))


# --- sequence_weights ---------------------------------------------------------------------------------

def _seq_token_mean(local, P, all_reduce):  # the token mean's weights: another objective
    n = all_reduce(torch.tensor(sum(int((y[:, 1:] != -100).sum()) for y in local)))
    return [torch.full((len(y),), P / float(n), dtype=torch.float64) for y in local]


def _seq_all_rows(local, P, all_reduce):  # R counts the rows without target too
    counts = [(y[:, 1:] != -100).sum(1) for y in local]
    R = int(all_reduce(torch.tensor(sum(len(y) for y in local))))
    return [torch.where(n > 0, P / (R * n.clamp(min=1).double()), torch.zeros((), dtype=torch.float64))
            for n in counts]


def _seq_local_R(local, P, all_reduce):  # no all-reduce: this rank's rows times P
    counts = [(y[:, 1:] != -100).sum(1) for y in local]
    all_reduce(torch.tensor(0))
    R = P * sum(int((n > 0).sum()) for n in counts)
    return [torch.where(n > 0, P / (R * n.clamp(min=1).double()), torch.zeros((), dtype=torch.float64))
            for n in counts]


def _seq_nan_rows(local, P, all_reduce):  # 1 / n without the guard: inf weights on rows without target
    counts = [(y[:, 1:] != -100).sum(1) for y in local]
    R = int(all_reduce(torch.tensor(sum(int((n > 0).sum()) for n in counts))))
    return [P / (R * n.double()) for n in counts]


def _seq_modifies(local, P, all_reduce):
    out = A.sequence_weights(local, P, all_reduce)
    local[0][:, 0] = 0
    return out


def _seq_flattens(local, P, all_reduce):
    return A.sequence_weights([y.view(-1).view(y.shape) for y in local], P, all_reduce)


@pytest.mark.parametrize("bad, needle", [
    (_seq_token_mean, r"sequence_weights: the ranks' averaged gradient\[\d\] differs"),
    (_seq_all_rows, r"sequence_weights: the ranks' averaged gradient\[\d\] differs"),
    (_seq_local_R, r"sequence_weights: the ranks' averaged gradient\[\d\] differs"),
    (_seq_nan_rows, r"sequence_weights: the weights of rows without a target\[\d+\] differs .* max rel error inf"),
    (lambda *a: [w.float() for w in A.sequence_weights(*a)], "expected a list of .* float64 tensors"),
    (_seq_modifies, r"sequence_weights: local_labels\[0\]\[0\] was modified in place"),
    (_seq_flattens, "sequence_weights: raised RuntimeError at .*non-contiguous"),
], ids=["token-mean", "empty-rows-counted", "no-all-reduce", "inf-on-empty-rows", "float32", "modifies-labels",
        "contiguous-only"])
def test_sequence_weights_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex73.check_sequence_weights(_solution(sequence_weights=bad))


def test_sequence_weights_without_any_target_must_raise():
    def no_check(local, P, all_reduce):
        all_reduce(torch.tensor(0))
        return [torch.zeros(len(y), dtype=torch.float64) for y in local]
    with pytest.raises(AssertionError, match=r"for no row of any rank has a target \(R = 0\), expected ValueError"):
        ex73.check_sequence_weights(_solution(sequence_weights=lambda local, P, ar: (
            no_check(local, P, ar) if all((y == -100).all() for y in local) else A.sequence_weights(local, P, ar))))


# --- predict_rank_tokens ------------------------------------------------------------------------------

MEASURED = r"the prediction\[\d\] is .* the count after Accelerate's sharding gives"


@pytest.mark.parametrize("bad, needle", [
    (lambda pads, T, P: [sum(T - p for p in pads[r * (len(pads) // P):(r + 1) * (len(pads) // P)])
                         for r in range(P)], MEASURED),  # no shift: the first token counted
    (lambda pads, T, P: [sum(max(0, T - 1 - p) for p in pads[r::P]) for r in range(P)], MEASURED),
    (lambda pads, T, P: [sum(T - 1 - p for p in pads[r * (len(pads) // P):(r + 1) * (len(pads) // P)])
                         for r in range(P)], MEASURED),  # a fully padded row counts -1
    (lambda pads, T, P: [float(x) for x in A.predict_rank_tokens(pads, T, P)],
     r"the prediction\[0\] is a float, expected an int"),
], ids=["no-shift", "interleaved", "negative-for-fully-padded", "float"])
def test_predict_rank_tokens_rejects(bad, needle):
    with pytest.raises(AssertionError, match=needle):
        ex73.check_predict_rank_tokens(_solution(predict_rank_tokens=bad))


# --- the properties the engine derives (ex73's declarations), and an outsider's wrong solutions ---------------




def _shard_wraps_rank(batch, rank, P):  # rank P taken as rank 0, -1 as the last (Python's modulo)
    E = next(iter(batch.values())).shape[0]
    if P < 1 or E % P:
        raise ValueError("uneven")
    return shard_rows(batch, rank % P, P)


def _seq_twice(local, P, all_reduce):  # R all-reduced once more "to be sure": two collectives
    all_reduce(torch.tensor(0))
    return A.sequence_weights(local, P, all_reduce)


def _seq_no_P(local, P, all_reduce):  # w = 1 / (R n): forgets that DDP divides the ranks' sum by P
    return [w / P for w in A.sequence_weights(local, P, all_reduce)]


def _div_local_only(counts, P, all_reduce):  # n_r P: right only when the ranks hold the same count
    all_reduce(torch.tensor(0))
    return torch.stack(list(counts)).sum().double() * P


def _shard_past_the_last_rank(batch, rank, P):  # `rank != P` for `rank < P`: a rank past P gets no rows
    E = next(iter(batch.values())).shape[0]
    if P < 1 or E % P or rank < 0 or rank == P:
        raise ValueError("bad rank")
    return {k: v[rank * (E // P):(rank + 1) * (E // P)] for k, v in batch.items()}


def _seq_one_target_rows_dropped(local, P, all_reduce):  # n > 1 for n > 0: rows with one target weigh 0
    counts = [(y[:, 1:] != -100).sum(1) for y in local]
    R = int(all_reduce(torch.tensor(sum(int((n > 1).sum()) for n in counts))))
    if R == 0:
        raise ValueError("no row")
    return [torch.where(n > 1, P / (R * n.clamp(min=1).double()), torch.zeros((), dtype=torch.float64))
            for n in counts]


DERIVED = {
    "shard: rank past P accepted": (ex73.check_shard_rows, {"shard_rows": _shard_past_the_last_rank},
                                    "returned a dict for rank 5 of 4 processes over 4 rows, expected ValueError"),
    "weights: rows with one target dropped": (ex73.check_sequence_weights, {
        "sequence_weights": _seq_one_target_rows_dropped}, r"the ranks' averaged gradient\[\d\] differs"),
    "shard: float64 out": (ex73.check_shard_rows, {"shard_rows": lambda b, r, P: {
        k: v.double() if v.is_floating_point() else v for k, v in shard_rows(b, r, P).items()}},
        "has dtype torch.float64, expected torch.float32"),
    "shard: a list of the tensors": (ex73.check_shard_rows, {"shard_rows": lambda b, r, P: list(
        shard_rows(b, r, P).values())}, "the shard is a list, expected a dict"),
    "shard: rank wraps around": (ex73.check_shard_rows, {"shard_rows": _shard_wraps_rank}, "expected ValueError"),
    "shard: grad mode left off": (ex73.check_shard_rows, {"shard_rows": leaks(
        shard_rows, lambda: torch.set_grad_enabled(False))}, "left the grad mode changed"),
    "divisor: floor of N / P": (ex73.check_loss_divisor, {"loss_divisor": lambda c, P, ar: (
        ar(torch.stack(list(c)).sum()) // P).double()}, r"D per rank\[\d\] differs from N / P"),
    "divisor: own count times P": (ex73.check_loss_divisor, {"loss_divisor": _div_local_only},
                                   r"D per rank\[\d\] differs from N / P"),
    "divisor: reseeds torch": (ex73.check_loss_divisor, {"loss_divisor": leaks(
        loss_divisor, lambda: torch.manual_seed(0))}, "left the torch RNG state changed"),
    "weights: two all-reduces": (ex73.check_sequence_weights, {"sequence_weights": _seq_twice},
                                 r"all_reduce calls per rank\[0\] is 2"),
    "weights: no P": (ex73.check_sequence_weights, {"sequence_weights": _seq_no_P},
                      r"the ranks' averaged gradient\[\d\] differs"),
    "weights: a tuple": (ex73.check_sequence_weights, {"sequence_weights": lambda *a: tuple(
        A.sequence_weights(*a))}, "returned a tuple, expected a list of"),
    "predict: a tuple": (ex73.check_predict_rank_tokens, {"predict_rank_tokens": lambda *a: tuple(
        A.predict_rank_tokens(*a))}, "the prediction is a tuple, expected a list"),
    "predict: per row, not per rank": (ex73.check_predict_rank_tokens, {"predict_rank_tokens": lambda pads, T, P: [
        max(0, T - 1 - p) for p in pads]}, r"the prediction has \d+ entries"),
}


@pytest.mark.parametrize("name", list(DERIVED))
def test_the_derived_properties_and_an_outsider_s_mistakes_are_rejected(name):
    check, over, message = DERIVED[name]
    with pytest.raises(AssertionError, match=f"^{next(iter(over))}: .*{message}"):
        check(_solution(**over))
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32  # put back for the next test
