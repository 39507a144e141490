"""``planner.pool``: forked workers give the same results, in the order asked for (or as each is done, with
its index), as the calling process; they inherit the parent's state (nothing but the tasks and results is
pickled); the quiet settings hold in a worker and are undone here."""

import os
import time

import torch

from bp_mech.planner import pool


def test_forked_results_come_back_in_order_and_equal_the_calling_process():
    state = {"offset": 7}  # inherited by the forked workers, never pickled
    fn = lambda x: (x + state["offset"], os.getpid())  # noqa: E731 (a lambda: pool.forked_map forks it)
    here = list(pool.forked_map(fn, range(6), workers=1))
    forked = list(pool.forked_map(fn, range(6), workers=2, cost=lambda x: x % 3))
    assert [r for r, _ in forked] == [r for r, _ in here] == [x + 7 for x in range(6)]
    assert {pid for _, pid in here} == {os.getpid()} and os.getpid() not in {pid for _, pid in forked}


def test_unordered_results_come_as_each_task_is_done_with_its_index():
    # task 0 is slow: the others, done by the second worker meanwhile, come back first (a bar counts them)
    slow = lambda x: (time.sleep(1.0 if x == 0 else 0), x * 10)[1]  # noqa: E731
    got = list(pool.forked_map(slow, range(4), workers=2, ordered=False))
    assert sorted(got) == [(0, 0), (1, 10), (2, 20), (3, 30)] and got[-1] == (0, 0)
    assert list(pool.forked_map(slow, range(3), workers=1, ordered=False)) == [(0, 0), (1, 10), (2, 20)]


def test_a_worker_runs_quiet_and_the_calling_process_is_left_as_it_was():
    threads = torch.get_num_threads()
    assert list(pool.forked_map(lambda _: torch.get_num_threads(), [0, 1], workers=2)) == [1, 1]
    assert list(pool.forked_map(lambda _: torch.get_num_threads(), [0], workers=2)) == [1]  # one task: here
    assert torch.get_num_threads() == threads and pool._WORK is None


def test_default_workers_is_the_cpus_this_process_may_use_at_most_four():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert pool.default_workers() == max(1, min(4, cpus))
