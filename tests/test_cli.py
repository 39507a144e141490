"""The command line: records written and validated, and every kind of bad input answered
with one line on stderr and exit status 2 (never a traceback)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from bp_mech import ROOT
from bp_mech.cli import main
from conftest import gpu_suite_ids, one_error_line


@pytest.mark.parametrize("argv, needle", [
    (["run", "TRAIN-NOPE"], "unknown experiment ID"),
    (["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b2s99999"], "exceeds"),
    (["run", "TRAIN-LOCAL-BACKWARD", "--workload", "banana"], "cannot parse workload"),
    (["preflight", "--profile", "TRAIN-TPU"], "unknown profile"),
    (["conformance", "--all-part02", "--profile", "nope"], "unknown profile"),
    (["check", "99"], "unknown chapter"),
    (["run", "--suite", "tpu"], "unknown suite"),
    (["frobnicate"], "invalid choice"),
    # each command's typed request refuses bad input as it is made
    (["run"], "run needs an experiment ID or --suite gpu"),
    (["run", "TRAIN-LOCAL-BACKWARD", "--suite", "cpu"], "not both"),
    (["run", "--suite", "cpu", "--domain-text", "d.txt"], "--domain-text applies to one experiment, not a suite"),
    (["conformance", "--profile", "TRAIN-CPU"], "conformance needs --all-part02"),
    (["plan", "--workload", "tiny-b2s32", "--budget", "1GiB", "--seq", "long"], "--seq takes a positive number or max"),
])
def test_bad_input_gets_one_line_and_status_2(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


def test_real_gpu_without_cuda_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("bp_mech.experiments.runner.cuda_available", lambda: False)
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--mode", "real_gpu"]) == 2
    assert "needs CUDA" in one_error_line(capsys)


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
    assert files[0].name in one_error_line(capsys)


def test_dry_run_prints_what_would_run_and_touches_no_model(capsys):
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--mode", "dry_run", "--workload", "qwen05-b2s512"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["workload"] == "qwen05-b2s512" and "rmsnorm" in dry["candidates"]


def test_preflight_reports_json_status(capsys):
    rc = main(["preflight", "--profile", "TRAIN-CPU"])
    report = json.loads(capsys.readouterr().out)
    assert report["status"] in ("ok", "fail") and rc == (0 if report["status"] == "ok" else 1)
    names = [c["name"] for c in report["checks"]]
    assert {"python", "torch", "transformers", "accelerate", "pip check"} <= set(names)
    assert "cuda" not in names  # a CPU profile does not ask for CUDA
    assert "bf16" in [i["name"] for i in report["info"]]  # reported, fails nothing


def test_conformance_rows_pass_on_cpu(capsys):
    assert main(["conformance", "--all-part02", "--profile", "TRAIN-CPU", "--require-passed"]) == 0
    out = capsys.readouterr().out
    assert "PASS  Part 02 · 09" in out and " 0 failed" in out


def test_check_fails_on_stubs_and_passes_on_answers():
    run = lambda *a: subprocess.run([sys.executable, "-m", "bp_mech", "check", "09", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    stubs, answers = run(), run("--dir", "answers")
    assert stubs.returncode == 1 and "TODO linear_backward: not implemented yet" in stubs.stdout.splitlines()
    assert answers.returncode == 0, answers.stdout[-2000:]


def test_entry_point_error_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "bp_mech", "results", "validate", "/nonexistent/dir/x.json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_a_plan_is_flushed_whole_before_the_fast_exit():
    """``bp-mech plan`` skips the interpreter's teardown (``cli.entry``: ``os._exit``): its output, piped and
    block-buffered as it is without PYTHONUNBUFFERED, arrives whole, with the plan's status (1: nothing fits)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.run([sys.executable, "-m", "bp_mech", "plan", "--workload", "tiny-b2s32", "--budget", "1KiB",
                        "--strategies", "offload", "--workers", "1", "--json"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["recommended"] is None  # (a cut JSON would not parse)
    assert p.stderr.splitlines()[-1].startswith("bp-mech: no strategy fits"), p.stderr[-300:]


def test_a_corrupt_record_is_refused_naming_file_and_field(tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["run", "TRAIN-LOCAL-BACKWARD", "--workload", "tiny-b1s8", "--out", str(out)]) == 0
    f = sorted(out.glob("*.json"))[0]
    f.write_text(f.read_text().replace('"evidence_level": "cpu-mechanism"', '"evidence_level": "rumour"'))
    capsys.readouterr()
    assert main(["results", "validate", str(out)]) == 2
    line = one_error_line(capsys)
    assert f.name in line and "evidence_level" in line


def test_pretrained_snapshot_is_resolved_once_per_process(monkeypatch, tmp_path):
    import huggingface_hub

    from bp_mech.instruments.workload import Workload, model_commit, resolve_pretrained

    snap, calls = tmp_path / "snapshots" / ("ab" * 20), []
    snap.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda model_id, revision, local_files_only: calls.append(model_id) or str(snap))
    w = Workload(arch="tiny", batch=1, seq=8, source="pretrained", model_id="bp-mech/resolve-once-test",
                 revision="v1", local_files_only=True)
    assert model_commit(w) == model_commit(w) == "ab" * 20
    assert resolve_pretrained("bp-mech/resolve-once-test", "v1", True) == (str(snap), "ab" * 20)
    assert calls == ["bp-mech/resolve-once-test"]


def test_missing_pretrained_cache_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr("bp_mech.records.registry.run", lambda ctx: pytest.fail("ran an experiment"))
    argv = ["run", "TRAIN-LOCAL-BACKWARD", "--workload", "qwen05-b1s8", "--model-source", "pretrained",
            "--model-id", "bp-mech/not-cached", "--revision", "r1", "--local-files-only"]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "'bp-mech/not-cached' revision 'r1' is not in the local Hugging Face cache" in line


def test_suite_with_missing_pretrained_cache_offline_stops_with_one_line(tmp_path):
    """HF_HUB_OFFLINE=1 (as tools/gpu_suite.sh sets) and an empty HF_HOME: exit 2 before any
    experiment, one line naming the model and revision."""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "bp_mech", "run", "--suite", "gpu", "--mode", "cpu", "--workload",
                        "qwen05-b1s8", "--model-source", "pretrained", "--model-id", "Qwen/Qwen2.5-0.5B"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "'Qwen/Qwen2.5-0.5B' revision 'main' is not in the local Hugging Face cache" in p.stderr
    assert not (tmp_path / "hf" / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots").exists()


# --- tools/gpu_suite.sh, dry-run form (no CUDA, no experiment runs) -------------------------

STUB_PYTHON = """#!/usr/bin/env bash
# preflight answered by FAKE_PREFLIGHT (ok|fail); a real run refused; the rest by the real python
if [ "$2" = bp_mech ] && [ "$3" = preflight ]; then
  echo "{\\"status\\": \\"$FAKE_PREFLIGHT\\"}"; [ "$FAKE_PREFLIGHT" = ok ]; exit
fi
case " $* " in *" --mode real_gpu "*|*" --mode cpu "*) echo "stub: refused to run an experiment" >&2; exit 99 ;; esac
exec "$REAL_PYTHON" "$@"
"""


def _gpu_suite(tmp_path, preflight: str, *args, script=ROOT / "tools" / "gpu_suite.sh"):
    stub = tmp_path / "python-stub"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), REAL_PYTHON=sys.executable, FAKE_PREFLIGHT=preflight,
               BP_MECH_SUITE_MODE="dry_run")
    env.pop("PHASES", None)
    return subprocess.run(["bash", str(script), str(tmp_path / "out"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_gpu_suite_script_dry_run_writes_dry_runs_logs_and_phase_times(tmp_path):
    p = _gpu_suite(tmp_path, "ok", "--phases", "smoke", "--smoke-workload", "qwen05-b1s64")
    out = tmp_path / "out"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "mode dry_run" in p.stdout.splitlines()[0]
    assert json.loads((out / "preflight.json").read_text()) == {"status": "ok"}
    dry = json.loads((out / "dry-run-smoke.json").read_text())
    assert [q["semantic_id"] for q in dry["dry_runs"]] == gpu_suite_ids()
    assert {q["workload"] for q in dry["dry_runs"]} == {"qwen05-b1s64"}
    log = (out / "smoke.log").read_text()
    assert "== phase smoke: start" in log and "0 record(s) valid" in log and "stub: refused" not in log
    assert (out / "records" / "smoke").is_dir() and not (out / "dry-run-full.json").exists()
    phases = (out / "phases.txt").read_text().splitlines()
    assert len(phases) == 1 and phases[0].startswith("== phase smoke: dry run rc 0, rc 0, validate rc 0, 0 record(s)")


def test_gpu_suite_script_stops_on_a_failed_preflight(tmp_path):
    """Run from a copy of the tree that is no git checkout: the commit comes from GIT_COMMIT."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu_suite.sh", repo / "tools" / "gpu_suite.sh")
    (repo / "src").symlink_to(ROOT / "src")
    (repo / "GIT_COMMIT").write_text("feedc0de\n")
    p = _gpu_suite(tmp_path, "fail", "--full", script=repo / "tools" / "gpu_suite.sh")
    out = tmp_path / "out"
    assert p.returncode == 2 and "preflight failed" in p.stderr
    assert "commit feedc0de" in p.stdout.splitlines()[0]
    assert json.loads((out / "preflight.json").read_text()) == {"status": "fail"}
    assert sorted(f.name for f in out.iterdir()) == ["preflight.json"]
