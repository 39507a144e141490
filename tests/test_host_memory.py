"""``host_memory``: the pool's buckets and counters against a replay by hand, and the link's bandwidth on a
GPU (against the copy's own wall time)."""

import contextlib
import random
import time

import pytest
import torch

from bp_mech.host_memory import HostPool, measure_bandwidth


def test_a_random_take_give_trace_matches_a_replay_by_hand():
    rng, pool = random.Random(0), HostPool(pin=False)
    idle, out = {}, []  # the replay: idle buffers per size, handed-out sizes
    allocated = allocations = high = 0
    for _ in range(200):
        if out and rng.random() < 0.45:
            buf = out.pop(rng.randrange(len(out)))
            pool.give(buf)
            idle[buf.numel()] = idle.get(buf.numel(), 0) + 1
        else:
            n = rng.choice([16, 64, 1000])
            out.append(pool.take(n))
            if idle.get(n):
                idle[n] -= 1
            else:
                allocated, allocations = allocated + n, allocations + 1
        in_use = sum(b.numel() for b in out)
        high = max(high, in_use)
        assert (pool.allocated, pool.allocations, pool.in_use, pool.high_water) == (allocated, allocations, in_use, high)
    assert {n: len(v) for n, v in pool.idle.items() if v} == {n: k for n, k in idle.items() if k}


def test_a_buffer_handed_out_is_never_handed_out_twice():
    pool = HostPool(pin=False)
    a, b = pool.take(32), pool.take(32)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    assert pool.take(32).data_ptr() == a.data_ptr() and pool.take(8).numel() == 8


def test_only_new_buffers_are_allocated_inside_the_host_region():
    entered = []

    @contextlib.contextmanager
    def region():
        entered.append(1)
        yield

    pool = HostPool(pin=False, host_region=region)
    pool.give(pool.take(100))
    pool.take(100)
    pool.take(50)
    assert len(entered) == 2 == pool.allocations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_bandwidth_is_the_bytes_over_the_copy_time():
    n = 64 * 2**20
    bw = measure_bandwidth("cuda", nbytes=n, reps=3)
    host, dev = torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(host)
    torch.cuda.synchronize()
    wall = n / (time.perf_counter() - t)  # a synchronous copy's wall time includes the launch: a lower bound
    assert set(bw) == {"h2d", "d2h"} and bw["h2d"] >= 0.5 * wall and 1e8 < bw["d2h"] < 1e13
