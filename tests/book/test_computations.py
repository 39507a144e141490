"""``book.computations``: each page value comes from its computed record under its own key, with the GPU
records it reads (not the CPU runs') among the plan's inputs; ``records.computed.cached`` stood in for."""

import os

import pytest

from bp_mech.book import computations


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(computations, "cached", lambda key, fn, *a, **kw: seen.append((key, fn, a, kw)) or key)
    return seen


def test_a_plan_is_keyed_by_its_name_and_reads_the_gpu_records(calls):
    assert computations.plan("ch19", "config", 2, 512, budget=8) == "plan__ch19"
    key, fn, args, kw = calls[0]
    assert fn is computations.planner.plan and args == ("config", 2, 512) and kw["budget"] == 8
    assert kw["inputs"] == computations.gpu_record_files() and kw["workers"] >= 1


def test_the_gpu_record_files_leave_the_cpu_runs_out():
    files = computations.gpu_record_files()
    assert files == sorted(files) and not any("__cpu-" in p.name for p in files)
    assert all(p.suffix == ".json" and p.parent == computations.RESULTS_DIR for p in files)


def test_a_reference_gap_under_every_definition_and_the_sweep(calls):
    assert computations.reference_gap_of("TRAIN-OFFLOAD") == "reference-gap__TRAIN-OFFLOAD"
    assert calls[0][2] == ("TRAIN-OFFLOAD", list(computations.DEFINITIONS))
    assert computations.sweep_outcomes() == computations.SWEEP and calls[1][1] is computations.sweep.sweep


def test_a_calculator_table_is_read_never_traced_by_a_page(monkeypatch):
    monkeypatch.setenv(computations.REFRESH_ENV, "refresh")  # make records runs the pages so
    seen = []
    monkeypatch.setattr(computations, "cached",
                        lambda key, fn, *a, **kw: seen.append(os.environ.get(computations.REFRESH_ENV)) or key)
    assert computations.calculator_table("tiny") == "calculator__tiny" and seen == [None]
    assert os.environ[computations.REFRESH_ENV] == "refresh"
    assert computations.calculator_record("qwen05") == "calculator__qwen05"
