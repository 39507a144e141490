"""Checkpointing (Part 02 · 19) and offload (Part 02 · 42) on a real GPU: equality with the resident
run within the CUDA tolerance, D2H = H2D bytes at a size where offload really moves tensors, and
records of the full experiments. Skipped without CUDA."""

import pytest
import torch

from bp_mech import checkpointing, offload
from bp_mech.bench.compare import EXACT_TOL, compare
from bp_mech.bench.step import probe
from bp_mech.bench.strategy import Entered, Strategy, configured, parse
from bp_mech.experiments.dry_run import schedule
from bp_mech.experiments.offload import count_saved
from bp_mech.records import registry
from bp_mech.records.results import load_record, save_record
from bp_mech.instruments.workload import build_model, make_batches, parse_workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKLOAD = "tiny-b4s512"  # activations of 128 KiB to 1.4 MiB per storage: above MIN_BYTES, so they move
MIN_BYTES = 64 * 2**10  # the offload threshold of these tests (OffloadConfig.min_bytes is configurable)


@pytest.fixture(scope="module")
def gpu_model():
    w = parse_workload(WORKLOAD)
    return build_model(w, "cuda"), make_batches(w, 2, device="cuda")


def _equal(ref, got):
    c = compare(ref, got)
    return got.finite and c.within(EXACT_TOL["cuda"]), c


@pytest.mark.parametrize("setup", ["plain", "checkpoint-all"])
def test_offload_on_cuda_moves_tensors_and_leaves_the_step_equal(gpu_model, setup):
    model, batches = gpu_model
    ref = probe(model, batches[0])
    counted = count_saved(model, batches[0], setup)
    off = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=MIN_BYTES), "cuda")
    assert off.pool.pin and off.stream is not None
    s = Strategy(checkpoint=setup, offload=True)
    for _ in range(3):  # the host pool is reused from the second step on
        with configured(model, s):
            got = probe(model, batches[0], s, entered=Entered(model, s, "cuda", hooks=off))
        ok, c = _equal(ref, got)
        assert ok, c
        assert off.d2h_bytes == off.h2d_bytes == counted.bytes_at_least(MIN_BYTES) > 0
    assert off.pool.allocations == len([b for b in counted.storages.values() if b >= MIN_BYTES])


def test_checkpointing_on_cuda_is_equal_within_the_stated_tolerance(gpu_model):
    model, batches = gpu_model
    ref = probe(model, batches[0])
    for name in checkpointing.CONFIGURATIONS[1:]:
        s = parse(name)
        with configured(model, s):
            got = probe(model, batches[0], s)
        ok, c = _equal(ref, got)
        assert ok and got.recomputes > 0, (name, c)


@pytest.mark.parametrize("sid", ["TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"])
def test_the_experiments_run_on_cuda_and_write_gpu_records(tmp_path, sid):
    ctx = registry.make_context(sid, "real_gpu", WORKLOAD)
    recs = registry.run(ctx)
    for r in recs:
        back = load_record(save_record(r, tmp_path))
        assert back.evidence_level == "gpu-measured" and back.memory_source == "cuda-allocator", back.failure
        assert back.failure is None and back.all_finite and back.peak_allocated > 0
        assert back.threads is None and back.updates == sum(schedule("cuda")) + 1 and back.step_clock == "wall"
        if back.candidate != "plain":
            assert back.metrics["equal"], back.metrics
        if back.transfer_bytes:
            assert back.transfer_bytes["d2h"] == back.transfer_bytes["h2d"] > 0
