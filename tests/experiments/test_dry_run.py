"""``experiments.dry_run``: the schedule per device and the same-weights estimate by hand from the assumed
rates. ``own_weights_modes``: ``tests/experiments/test_harness.py``."""

import pytest

from bp_mech.bench.rates import ASSUMED_BUILD_S, ASSUMED_FLOPS, ASSUMED_PASS_S
from bp_mech.bench.timing import SMOKE_SCHEDULE
from bp_mech.experiments import dry_run
from bp_mech.instruments.workload import param_count, parse_workload


def test_the_schedule_per_device_and_for_a_smoke_run():
    assert dry_run.schedule("cpu") == (60, 3) and dry_run.schedule("cuda:0") == (20, 3)
    assert dry_run.schedule("cuda", smoke=True) == SMOKE_SCHEDULE
    assert dry_run.steps_per_arm(20, 3) == 24  # the tracked step, the warm-up, the timed ones


def test_same_weights_seconds_by_hand():
    w, dev = parse_workload("tiny-b2s64"), "cuda"
    n, tokens = param_count("tiny"), 2 * 64

    def one_pass(passes):
        return passes * (6 * n * tokens / ASSUMED_FLOPS[dev]["float32"] + ASSUMED_PASS_S[dev])

    passes = 1 + 3 + 20 + 1  # tracked, warm-up, timed and the probe
    probe_copy = 4 * n / dry_run.PROBE_BYTES_S
    want = ASSUMED_BUILD_S[dev] + one_pass(1) + sum(one_pass(f * passes) + probe_copy for f in (1.0, 1.5))
    assert dry_run.same_weights_seconds(w, [1.0, 1.5], dev) == pytest.approx(round(want, 1), abs=1e-9)


def test_same_weights_modes_add_the_protocol_and_the_experiment_s_fields():
    w = parse_workload("tiny-b2s64")
    plan = dry_run.same_weights_modes(w, [1.0], smoke=True, device=lambda dev: dev.upper())
    assert list(plan) == ["cpu", "real_gpu"]
    cpu, gpu = plan["cpu"], plan["real_gpu"]
    assert (cpu["timed_rounds"], cpu["warmup_rounds"]) == SMOKE_SCHEDULE and cpu["interleaved"] and gpu["interleaved"]
    assert (cpu["threads"], gpu["threads"], cpu["device"], gpu["device"]) == (1, None, "CPU", "CUDA")
    assert gpu["estimated_seconds"] == dry_run.same_weights_seconds(w, [1.0], "cuda", smoke=True)
