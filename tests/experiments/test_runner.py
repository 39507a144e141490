"""The suite runner (``bp_mech.experiments.runner``) through ``bp-mech run --suite``: the GPU suite's
dry run (every experiment, its estimate, the total), records saved as they are made, a failing
experiment reported and the rest run on; the command's typed request (``RunRequest``)."""

import json
import re
from pathlib import Path

import pytest

from bp_mech.cli import main
from bp_mech.experiments import runner
from bp_mech.experiments.runner import RunRequest, UsageError
from conftest import gpu_suite_ids, one_error_line

# --- the GPU suite: workload, dry-run totals, records saved as made, failures ----------------

def test_suite_dry_run_covers_every_experiment_at_the_given_workload_with_a_total(capsys):
    assert main(["run", "--suite", "gpu", "--mode", "dry_run", "--workload", "qwen05-b1s128"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    dry_runs, summary = doc["dry_runs"], doc["summary"]
    assert [p["semantic_id"] for p in dry_runs] == gpu_suite_ids()
    assert {p["workload"] for p in dry_runs} == {"qwen05-b1s128"}
    per = {p["semantic_id"]: p["modes"]["real_gpu"]["estimated_seconds"] for p in dry_runs}
    assert summary["estimated_seconds"] == per and summary["no_estimate"] == [] and summary["no_dry_run"] == []
    assert summary["total_estimated_seconds"] == pytest.approx(sum(per.values()), abs=0.051)
    assert f"estimated {summary['total_estimated_seconds']:.0f} s" in cap.err.strip().splitlines()[-1]


def _suite_total(capsys, *args) -> tuple[float, list]:
    assert main(["run", "--suite", "gpu", "--mode", "dry_run", *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    return doc["summary"]["total_estimated_seconds"], doc["dry_runs"]


def test_the_smoke_matrix_is_estimated_at_about_two_minutes_and_the_full_one_at_about_six(capsys):
    """The GPU machine is lent for 15 minutes, each call at most 10: the smoke phase (every code path
    once, few steps; nine experiments, each building its model at least once) must be estimated within about
    two minutes, the full matrix within about six and a half, well within one call, leaving time for
    the machine's start and one targeted rerun."""
    from bp_mech.bench.timing import SMOKE_SCHEDULE

    smoke, dry_runs = _suite_total(capsys, "--workload", "qwen05-b1s128", "--smoke")
    full, _ = _suite_total(capsys)
    assert smoke < 150 and full <= 400 and full > 2 * smoke
    ck = next(p for p in dry_runs if p["semantic_id"] == "TRAIN-CHECKPOINT")["modes"]["real_gpu"]
    assert (ck["timed_rounds"], ck["warmup_rounds"]) == SMOKE_SCHEDULE


def test_suite_dry_run_goes_on_past_one_that_cannot_be_made(capsys, monkeypatch):
    from bp_mech.records import registry

    ids, real_dry_run = gpu_suite_ids(), registry.dry_run
    bad, bare = ids[0], ids[1]

    def dry_run(ctx):
        if ctx.experiment.semantic_id == bad:
            raise ValueError("cannot derive a sequence length\nsecond line")
        p = real_dry_run(ctx)
        return {k: v for k, v in p.items() if k != "modes"} if ctx.experiment.semantic_id == bare else p

    monkeypatch.setattr(registry, "dry_run", dry_run)
    assert main(["run", "--suite", "gpu", "--mode", "dry_run", "--workload", "qwen05-b1s64"]) == 1
    cap = capsys.readouterr()
    summary = json.loads(cap.out)["summary"]
    assert [u["semantic_id"] for u in summary["no_dry_run"]] == [bad] and summary["no_estimate"] == [bare]
    assert set(summary["estimated_seconds"]) == set(ids) - {bad, bare}
    err = cap.err.strip().splitlines()
    assert err[0] == f"bp-mech: {bad}: no dry run at qwen05-b1s64: ValueError: cannot derive a sequence length"
    assert len(err) == 2 and "Traceback" not in cap.err and f"no estimate: {bare}" in err[1]


def test_suite_bad_workload_is_one_line_before_anything_runs(capsys, monkeypatch):
    from bp_mech.records import registry

    monkeypatch.setattr(registry, "run", lambda ctx: pytest.fail("ran an experiment"))
    assert main(["run", "--suite", "gpu", "--mode", "cpu", "--workload", "qwen05-b1s99999"]) == 2
    assert "exceeds" in one_error_line(capsys)


def test_suite_saves_records_as_made_prints_tracebacks_and_goes_on(tmp_path, capsys, monkeypatch):
    """One experiment fails after making a record: that record is already on disk, its full
    traceback is printed, the next experiment runs; every record is saved exactly once."""
    import dataclasses

    from bp_mech.records import registry, results

    ids = gpu_suite_ids()[:3]
    monkeypatch.setattr(registry, "gpu_suite", lambda: [registry.get(i) for i in ids])
    out = tmp_path / "rec"
    on_disk_when_made = []

    def run(ctx):
        rec = ctx.record("a", decision="accept")
        on_disk_when_made.append((out / rec.filename).exists())
        if ctx.experiment.semantic_id == ids[1]:
            raise RuntimeError("boom in the middle")
        extra = dataclasses.replace(rec, candidate="b")  # not made by ctx.record: saved at the end
        return [rec, extra]

    monkeypatch.setattr(registry, "run", run)
    rc = main(["run", "--suite", "gpu", "--mode", "cpu", "--workload", "tiny-b1s8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and on_disk_when_made == [True, True, True]
    assert f"bp-mech: {ids[1]} failed:" in err and "Traceback (most recent call last)" in err
    assert "RuntimeError: boom in the middle" in err and 'in run\n    raise RuntimeError' in err
    assert err.strip().splitlines()[-1] == f"bp-mech: 1 of 3 experiment(s) failed: {ids[1]}"
    names = sorted(p.name for p in out.glob("*.json"))
    assert len(names) == 5 and err.count("saved ") == 5  # 2 + 1 (the failed one's) + 2, none twice
    assert all(r.workload_id == "tiny-b1s8" for _, r in results.load_records(out))


def test_run_one_saves_each_record_before_the_next_is_made(tmp_path, capsys, monkeypatch):
    from bp_mech.records import registry

    out, seen = tmp_path / "rec", []

    def run(ctx):
        recs = []
        for c in ("x", "y", "z"):
            seen.append(sorted(p.name for p in out.glob("*.json")) if out.exists() else [])
            recs.append(ctx.record(c))
        return recs

    monkeypatch.setattr(registry, "run", run)
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b1s8", "--out", str(out)]) == 0
    assert [len(s) for s in seen] == [0, 1, 2]
    assert capsys.readouterr().err.count("saved ") == 3


def test_an_invalid_record_is_refused_once_and_the_rest_are_saved(tmp_path, capsys, monkeypatch):
    from bp_mech.records import registry

    out = tmp_path / "rec"
    monkeypatch.setattr(registry, "run", lambda ctx: [ctx.record("bad", evidence_level="rumour"), ctx.record("good")])
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b1s8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("bp-mech: not saved:") == 1 and "evidence_level" in err and err.count("saved ") == 1
    assert [p.name.split("__")[-1] for p in out.glob("*.json")] == ["good.json"]


# --- the pretrained path: resolved once, a missing cache is one line ----------------------


@pytest.mark.parametrize("fields, message", [
    (dict(), "run needs an experiment ID or --suite gpu"),
    (dict(suite="tpu"), "unknown suite 'tpu'"),
    (dict(suite="gpu", id="TRAIN-OFFLOAD"), "either an experiment ID or --suite, not both"),
    (dict(suite="cpu", state_dir=Path("s"), resume_from=Path("r")), "--state-dir, --resume-from applies to one"),
])
def test_a_run_request_refuses_bad_input_when_it_is_made(fields, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        RunRequest(**fields)


def test_a_run_request_has_its_mode_source_and_options():
    r = RunRequest(id="TRAIN-CONTINUAL-PRETRAIN", domain_text=Path("d.txt"), local_files_only=True)
    assert (r.mode_or_default, r.options) == ("cpu", dict(domain_text=Path("d.txt")))
    assert r.source == dict(source="config", model_id=None, revision="main", local_files_only=True)
    assert RunRequest(suite="gpu").mode_or_default == "real_gpu" and RunRequest(id="X", mode="dry_run").source is None


def test_the_command_hands_run_its_request(monkeypatch):
    got = []
    monkeypatch.setattr(runner, "run_one", lambda *a: got.append(a) or 0)
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b1s8", "--run-label", "x", "--smoke"]) == 0
    assert got == [("TRAIN-LOCAL-BACKWARD", "cpu", "tiny-b1s8", None, "x", None, True, {})]
