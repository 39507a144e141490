"""``projects.baseline_loss``: the all-reduce among threads and its runner (each rank's exception handed
back, a failing rank breaking the barrier for the others), the divisors by hand, the rows of a rank. The
simulated ranks against the full batch and the per-rank mean: ``tests/projects/test_baseline.py``."""

import threading

import pytest
import torch

from bp_mech.projects.baseline_loss import ThreadAllReduce, divisors, loss_divisor, per_rank_divisor, shard_rows


def test_every_rank_reads_the_sum_of_every_call():
    group, got = ThreadAllReduce(3, timeout_s=5.0), [None] * 3

    def rank_main(r):
        op = group.op(r)
        got[r] = [op(torch.tensor(float(r + 1))).item(), op(torch.tensor(10.0 * r)).item()]

    assert group.run(rank_main) == [None, None, None]
    assert got == [[6.0, 30.0]] * 3  # 1 + 2 + 3, then 0 + 10 + 20: a second call never reads the first's slots


def test_a_failing_rank_hands_back_its_error_and_the_others_stop_waiting():
    group = ThreadAllReduce(3, timeout_s=30.0)

    def rank_main(r):
        if r == 1:
            raise KeyError("rank 1")
        group.op(r)(torch.ones(1))  # would wait for rank 1 forever but for the broken barrier

    errors = group.run(rank_main)
    assert isinstance(errors[1], KeyError)
    assert all(isinstance(errors[r], threading.BrokenBarrierError) for r in (0, 2))


def test_the_divisor_is_the_global_target_count_over_the_ranks():
    counts = [[torch.tensor(3), torch.tensor(5)], [torch.tensor(0), torch.tensor(2)]]  # N = 10 over P = 2
    assert [d.item() for d in divisors(counts)] == [5.0, 5.0]
    assert [d.item() for d in divisors(counts, per_rank_divisor)] == [8.0, 2.0]  # each rank's own count
    assert loss_divisor([torch.tensor(4)], 1, lambda t: t).item() == 4.0


def test_a_rank_s_error_is_raised_in_the_caller_s_thread():
    def bad(local, P, all_reduce):
        if int(local[0]) == 0:
            raise ValueError("no targets")
        return all_reduce(local[0])

    with pytest.raises(ValueError, match="no targets"):
        divisors([[torch.tensor(0)], [torch.tensor(1)]], bad)


def test_a_rank_s_rows_are_its_contiguous_block():
    batch = {"x": torch.arange(12).view(6, 2)}
    assert [shard_rows(batch, r, 3)["x"][:, 0].tolist() for r in range(3)] == [[0, 2], [4, 6], [8, 10]]
