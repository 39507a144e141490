"""The command line: records written and validated, and every kind of bad input answered
with one line on stderr and exit status 2 (never a traceback)."""

import json
import subprocess
import sys

import pytest

from bp_mech.cli import main


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize("argv, needle", [
    (["run", "TRAIN-NOPE"], "unknown experiment ID"),
    (["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b2s99999"], "exceeds"),
    (["run", "TRAIN-LOCAL-BACKWARD", "--workload", "banana"], "cannot parse workload"),
    (["preflight", "--profile", "TRAIN-TPU"], "unknown profile"),
    (["conformance", "--all-part02", "--profile", "nope"], "unknown profile"),
    (["check", "99"], "unknown chapter"),
    (["run", "--suite", "tpu"], "unknown suite"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_gets_one_line_and_status_2(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in _err_line(capsys)


def test_real_gpu_without_cuda_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("bp_mech.cli.cuda_available", lambda: False)
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--mode", "real_gpu"]) == 2
    assert "needs CUDA" in _err_line(capsys)


def test_run_cpu_writes_valid_records_and_validate_catches_truncation(tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--mode", "cpu", "--workload", "tiny-b1s16", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "rmsnorm" in table and "accept" in table
    files = sorted(out.glob("*.json"))
    assert len(files) == 7
    assert main(["results", "validate", str(out)]) == 0
    assert "7 record(s) valid" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / files[0].name).write_text(files[0].read_text()[:-40])  # a truncated copy
    assert main(["results", "validate", str(bad)]) == 2
    assert files[0].name in _err_line(capsys)


def test_dry_run_prints_the_plan_and_touches_no_model(capsys):
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--mode", "dry_run", "--workload", "qwen05-b2s512"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workload"] == "qwen05-b2s512" and "rmsnorm" in plan["candidates"]


def test_preflight_reports_json_status(capsys):
    rc = main(["preflight", "--profile", "TRAIN-CPU"])
    report = json.loads(capsys.readouterr().out)
    assert report["status"] in ("ok", "fail") and rc == (0 if report["status"] == "ok" else 1)
    names = [c["name"] for c in report["checks"]]
    assert {"python", "torch", "cuda", "bf16", "pip check"} <= set(names)


def test_conformance_rows_pass_on_cpu(capsys):
    assert main(["conformance", "--all-part02", "--profile", "TRAIN-CPU", "--require-passed"]) == 0
    out = capsys.readouterr().out
    assert "PASS  Part 02 · 09" in out and " 0 failed" in out


def test_check_fails_on_stubs_and_passes_on_answers():
    run = lambda *a: subprocess.run([sys.executable, "-m", "bp_mech", "check", "09", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    stubs, answers = run(), run("--dir", "answers")
    assert stubs.returncode != 0 and "NotImplementedError" in stubs.stdout
    assert answers.returncode == 0, answers.stdout[-2000:]


def test_entry_point_error_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "bp_mech", "results", "validate", "/nonexistent/dir/x.json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_a_corrupt_record_is_refused_naming_file_and_field(tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b1s8", "--out", str(out)]) == 0
    f = sorted(out.glob("*.json"))[0]
    f.write_text(f.read_text().replace('"evidence_level": "cpu-mechanism"', '"evidence_level": "rumour"'))
    capsys.readouterr()
    assert main(["results", "validate", str(out)]) == 2
    line = _err_line(capsys)
    assert f.name in line and "evidence_level" in line
