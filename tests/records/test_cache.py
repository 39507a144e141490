"""``records.cache``: an experiment's records grouped by run label, the stale labels (against the current
code hash, or not looked at), the GPU groups and the sentence a chapter shows, on records copied into
tmp_path. The provenance box over them: ``tests/book/test_report.py``."""

import dataclasses

import pytest

from bp_mech import RESULTS_DIR
from bp_mech.records import cache, provenance, registry, results

SID = "TRAIN-CHECKPOINT"


def _records(tmp_path, labels_and_hashes, **changes):
    """One copy of each cached CPU record of SID per (run label, code hash), saved into tmp_path."""
    cpu = [r for _, r in results.load_records(RESULTS_DIR, SID)][:2]
    for label, code_hash in labels_and_hashes:
        for r in cpu:
            results.save_record(dataclasses.replace(r, run_label=label, code_hash=code_hash, **changes), tmp_path)
    return len(cpu)


def test_records_group_by_run_label_and_a_label_with_an_old_hash_is_stale(tmp_path):
    now = provenance.code_hash(registry.get(SID).module)
    n = _records(tmp_path, [("current", now), ("old", "0" * 16)])
    c = cache.cached(SID, tmp_path)
    assert {k: len(v) for k, v in c.groups.items()} == {"current": n, "old": n} and c.stale == {"old"}
    assert cache.cached(SID, tmp_path, check_stale=False).stale == set()


def test_without_a_gpu_record_the_note_says_the_page_shows_the_cpu_run(tmp_path):
    _records(tmp_path, [("cpu", "0" * 16)])
    c = cache.cached(SID, tmp_path)
    assert c.gpu() == {} and c.note().startswith(f"No GPU record of {SID} is cached")


def test_a_stale_gpu_group_is_named_stale_in_the_note(tmp_path):
    _records(tmp_path, [("gpu-run", "0" * 16)], evidence_level="gpu-measured", memory_source="cuda-allocator",
             device_name="NVIDIA H200", cuda="12.8", torch="2.11.0")
    c = cache.cached(SID, tmp_path)
    assert list(c.gpu()) == ["gpu-run"]
    assert c.note().startswith("Cached GPU records (gpu-measured): run label gpu-run: NVIDIA H200, CUDA 12.8, "
                               "torch 2.11.0") and c.note().endswith("STALE: the code changed since this run.")


def test_records_of_two_workloads_under_one_label_are_refused(tmp_path):
    cpu = next(r for _, r in results.load_records(RESULTS_DIR, SID))
    results.save_record(dataclasses.replace(cpu, run_label="x", candidate="a"), tmp_path)
    results.save_record(dataclasses.replace(cpu, run_label="x", candidate="b", workload_id="tiny-b4s64"), tmp_path)
    with pytest.raises(results.RecordError, match="field 'workload_id'"):
        cache.cached(SID, tmp_path)
