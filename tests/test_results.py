import dataclasses
import json

import jsonschema
import pytest

from bp_mech import results
from bp_mech.registry import make_context
from bp_mech.results import FIELDS, Record, RecordError, check_mergeable, load_record, load_records, save_record


def _record(**kw):
    ctx = make_context("TRAIN-LOCAL-BACKWARD", "cpu", "tiny-b1s8")
    return ctx.record(kw.pop("candidate", "linear"), **kw)


def test_schema_covers_exactly_the_record_fields():
    s = results.schema()
    assert list(s["properties"]) == list(FIELDS) and s["required"] == list(FIELDS)
    assert s["additionalProperties"] is False


def test_saved_record_has_every_field_and_validates_against_the_shipped_schema(tmp_path):
    r = _record(output_error=1e-16, grad_error=2e-16, all_finite=True)
    path = save_record(r, tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == set(FIELDS)
    jsonschema.Draft202012Validator(results.schema()).validate(data)
    assert load_record(path) == r
    assert data["evidence_level"] == "cpu-mechanism" and data["code_hash"] and data["created_at"]
    assert data["peak_allocated"] is None  # null where not applicable, never missing
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic write left no temp file


def test_missing_field_is_refused_naming_file_and_field(tmp_path):
    path = save_record(_record(), tmp_path)
    data = json.loads(path.read_text())
    del data["model_commit"]
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"linear\.json.*model_commit"):
        load_record(path)


def test_wrong_type_and_bad_enum_are_refused(tmp_path):
    with pytest.raises(RecordError, match="peak_allocated"):
        results.validate(dataclasses.replace(_record(), peak_allocated=-5).to_dict())
    with pytest.raises(RecordError, match="decision"):
        results.validate(dataclasses.replace(_record(), decision="maybe").to_dict())
    with pytest.raises(RecordError):  # gpu-measured without device and CUDA
        results.validate(dataclasses.replace(_record(), evidence_level="gpu-measured", memory_source=None).to_dict())


def test_truncated_and_corrupt_records_are_refused_naming_the_file(tmp_path):
    path = save_record(_record(), tmp_path)
    path.write_text(path.read_text()[:100])
    with pytest.raises(RecordError, match="not valid JSON") as e:
        load_record(path)
    assert path.name in str(e.value)
    path.write_text("[1, 2]")
    with pytest.raises(RecordError, match="JSON object"):
        load_record(path)


def test_records_of_different_commits_or_workloads_never_merge(tmp_path):
    a = save_record(_record(candidate="linear"), tmp_path)
    b = save_record(dataclasses.replace(_record(candidate="silu"), model_commit="config-other"), tmp_path)
    items = load_records(tmp_path)
    with pytest.raises(RecordError, match=r"silu\.json.*model_commit"):
        check_mergeable(items)
    c = dataclasses.replace(_record(candidate="gelu"), workload_id="tiny-b2s8")
    with pytest.raises(RecordError, match="workload_id"):
        check_mergeable([(a, load_record(a)), (tmp_path / c.filename, c)])
    check_mergeable([(a, load_record(a))])
    assert b.exists()


def test_stale_code_hash_is_detected():
    r = _record()
    assert not results.is_stale(r, "bp_mech.local_backward")
    assert results.is_stale(dataclasses.replace(r, code_hash="0" * 16), "bp_mech.local_backward")


def test_record_filename_is_one_file_per_candidate_and_run():
    r = _record()
    assert r.filename == "TRAIN-LOCAL-BACKWARD__tiny-b1s8__cpu-default__linear.json"
    assert isinstance(r, Record)


def test_every_cached_record_in_the_book_validates_and_merges():
    from bp_mech.report import RESULTS_DIR, cached
    from bp_mech.registry import EXPERIMENTS

    items = load_records(RESULTS_DIR)  # raises RecordError naming the first invalid file
    for sid in {r.semantic_id for _, r in items}:
        assert sid in EXPERIMENTS
        cached(sid)  # refuses mixed workloads / commits within a run label


@pytest.mark.parametrize("change", [
    {}, {"peak_allocated": -5}, {"decision": "maybe"}, {"input_shape": [2, "x"]}, {"seed": True},
    {"evidence_level": "gpu-measured"}, {"semantic_id": "LOCAL"}, {"transfer_bytes": {"d2h": 1}},
    {"memory_source": "tracked-cpu", "evidence_level": "estimated"}, {"extra_field": 1}, {"run_label": ""},
])
def test_builtin_validator_agrees_with_jsonschema(change):
    """The GPU machine may lack jsonschema; the fallback must accept and refuse the same records."""
    data = dict(_record().to_dict(), **change)
    ours = results.schema_errors(results.schema(), data)
    theirs = list(jsonschema.Draft202012Validator(results.schema()).iter_errors(data))
    assert bool(ours) == bool(theirs), (ours, [e.message for e in theirs])
    data.pop("model_commit")
    assert results.schema_errors(results.schema(), data)
