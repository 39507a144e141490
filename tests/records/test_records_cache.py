"""Every cached record in book/results/ says true things about itself.

One test per (property, record file), so a failure names the file. The staleness check is its
own test, ``test_STALE_record_matches_the_current_code``: ``pytest -k STALE`` lists exactly the
records whose code changed since they were made (``make records`` refreshes the CPU ones).
"""

import json
from pathlib import Path

import pytest

from bp_mech import RESULTS_DIR
from bp_mech.records import provenance, registry, results

RESULTS = RESULTS_DIR
FILES = sorted(RESULTS.glob("*.json"))
NO_OPTIMIZER = ("TRAIN-LOCAL-BACKWARD", "TRAIN-ATTENTION-BACKWARD")  # their runs never call an optimizer


def _raw(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _applied(metrics: dict) -> list | None:
    """The per-optimizer-call 'applied' flags a record traces, where it keeps them."""
    trace = metrics.get("trace")
    if isinstance(trace, dict) and isinstance(trace.get("applied"), list):
        return trace["applied"]
    for key in ("applied_per_step", "applied_per_call"):
        if isinstance(metrics.get(key), list):
            return metrics[key]
    return None


records = pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])


def test_there_are_cached_records():
    assert FILES, f"no records in {RESULTS}"


@records
def test_record_validates(path):
    results.load_record(path)


@records
def test_STALE_record_matches_the_current_code(path):
    data = _raw(path)
    module = registry.get(data["semantic_id"]).module
    current = provenance.code_hash(module)
    assert data["code_hash"] == current, (
        f"STALE: {path.name} has code_hash {data['code_hash']}, the code now hashes to {current} "
        f"({', '.join(provenance.code_modules(module))}); rerun {data['semantic_id']}")


@records
def test_experiments_without_an_optimizer_record_no_updates(path):
    data = _raw(path)
    if data["semantic_id"] in NO_OPTIMIZER:
        assert data["updates"] is None and data["skipped_updates"] is None, (data["updates"], data["skipped_updates"])


@records
def test_tune_and_reject_say_what_to_do_next(path):
    data = _raw(path)
    if data["decision"] in ("tune", "reject"):
        assert isinstance(data["next_step"], str) and data["next_step"].strip(), data["next_step"]


@records
def test_skipped_updates_come_with_updates(path):
    data = _raw(path)
    if data["skipped_updates"] is not None:
        assert data["updates"] is not None


@records
def test_updates_count_the_steps_that_ran(path):
    """Where a record traces its optimizer calls: ``updates`` = calls that applied,
    ``updates + skipped_updates`` = all calls. Every AMP record counts its updates."""
    data = _raw(path)
    applied = _applied(data["metrics"])
    if data["semantic_id"] == "TRAIN-AMP-BACKWARD" and data["failure"] is None:
        assert data["updates"] is not None and data["skipped_updates"] is not None
    if applied is None:
        return
    assert data["updates"] == sum(bool(a) for a in applied), (data["updates"], applied)
    assert data["updates"] + (data["skipped_updates"] or 0) == len(applied)


@records
def test_a_failed_record_decides_nothing(path):
    data = _raw(path)
    if data["failure"] is not None:
        assert data["decision"] is None, (data["failure"], data["decision"])
