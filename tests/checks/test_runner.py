"""``bp-mech check NN``: one line per exercise function (bp_mech.checks.runner), ``-v`` and exit codes."""

import subprocess
import sys
import textwrap

import pytest
import torch

from bp_mech.checks import CHAPTERS
from bp_mech.checks import runner as check
from bp_mech.cli import main

CHAPTER_NUMBERS = [m.removeprefix("ch") for m, _, _ in CHAPTERS]  # "ch09" -> "09", "amp" -> "amp"


@pytest.mark.parametrize("chapter", CHAPTER_NUMBERS)
def test_untouched_stubs_are_all_todo(chapter):
    name, _ = check.chapter_checks(chapter)
    lines = check.check_chapter(chapter)
    assert [line.function for line in lines] == check.exercise_functions(name)
    assert {line.status for line in lines} == {"TODO"}
    # a stub's own NotImplementedError, or (for a function built on another stub) the one it needs
    assert all(line.message == "not implemented yet" or
               (line.message.startswith("needs ") and line.message.endswith(", not implemented yet"))
               for line in lines), [line.message for line in lines]
    assert check.exit_code(lines) == 1


@pytest.mark.parametrize("chapter", CHAPTER_NUMBERS)
def test_every_check_tests_one_exercise_function(chapter):
    """By its name (check_<function>[__<aspect>]) or, where the name follows no function, by the one
    exercise function it calls: every check lands on a function's line, none on a line of its own."""
    name, checks = check.chapter_checks(chapter)
    rows = check.mapping(chapter)
    assert [r[0] for r in rows] == [c.__name__ for c in checks]
    assert [r for r in rows if r[1] is None] == []
    assert {r[1] for r in rows} == set(check.exercise_functions(name))  # and every function has a check


@pytest.mark.parametrize("chapter", ["09", "12", "55"])
def test_answers_all_pass(chapter):
    lines = check.check_chapter(chapter, "answers")
    assert lines and all(line.status == "PASS" and line.message == "" for line in lines), check.format_report(lines)
    assert check.exit_code(lines) == 0
    assert check.format_report(lines).splitlines()[-1] == f"{len(lines)} of {len(lines)} functions pass, 0 not implemented yet, 0 failing"


ANSWERS_09 = f"exec(open({str(check.ROOT / 'answers' / 'ex09_local_backward.py')!r}).read())  # every other function right"

WRONG_SILU = f"""
    import torch
    {ANSWERS_09}


    def silu_backward(x, dy):
        return dy * torch.sigmoid(x)  # forgets the x * s * (1 - s) term
"""


def test_a_wrong_solution_fails_naming_function_and_mismatch(tmp_path):
    (tmp_path / "ex09_local_backward.py").write_text(textwrap.dedent(WRONG_SILU))
    lines = {line.function: line for line in check.check_chapter("09", tmp_path)}
    assert [f for f, line in lines.items() if line.status != "PASS"] == ["silu_backward"]
    bad = lines["silu_backward"]
    assert bad.status == "FAIL" and "dx" in bad.message and "float64 autograd" in bad.message
    assert not bad.message.startswith("silu_backward")  # the line names the function once
    report = check.format_report(list(lines.values()))
    assert f"FAIL silu_backward: {bad.message}" in report.splitlines()
    assert report.splitlines()[-1] == "6 of 7 functions pass, 0 not implemented yet, 1 failing"


CRASHING = f"""
    {ANSWERS_09}


    def rmsnorm_backward(x, w, dy, eps=1e-6):
        raise TypeError("my own bug")
"""


def test_an_exception_in_the_learners_code_names_its_type_and_line(tmp_path):
    (tmp_path / "ex09_local_backward.py").write_text(textwrap.dedent(CRASHING))
    line = {x.function: x for x in check.check_chapter("09", tmp_path)}["rmsnorm_backward"]
    assert line.status == "FAIL" and "TypeError" in line.message and "my own bug" in line.message
    assert line.message.endswith("(ex09_local_backward.py line 6)")


PARTLY_DONE = """
    import torch


    def global_grad_norm(grads):
        raise NotImplementedError


    def clip_coefficient(total_norm, max_norm, eps=1e-6):
        return torch.clamp(max_norm / (total_norm + eps), max=1.0)


    def clip_by_global_norm_(params, max_norm, eps=1e-6):
        params = [p for p in params if p.grad is not None]
        c = clip_coefficient(global_grad_norm([p.grad for p in params]), max_norm, eps)
        for p in params:
            p.grad.mul_(c)
        return c


    def update_ratio(before, after):
        raise NotImplementedError
"""


def test_a_function_that_calls_an_unwritten_one_says_which(tmp_path):
    (tmp_path / "ex55_update_dynamics.py").write_text(textwrap.dedent(PARTLY_DONE))
    lines = {x.function: x for x in check.check_chapter("55", tmp_path)}
    assert lines["global_grad_norm"].message == "not implemented yet"
    assert lines["clip_coefficient"].status == "PASS"
    assert (lines["clip_by_global_norm_"].status, lines["clip_by_global_norm_"].message) == (
        "TODO", "needs global_grad_norm, not implemented yet")
    assert check.exit_code(list(lines.values())) == 1


def test_a_missing_function_is_named(tmp_path):
    (tmp_path / "ex12_scheduler_clock.py").write_text("from bp_mech.scheduler import wsd_lr  # noqa: F401\n")
    lines = {x.function: x for x in check.check_chapter("12", tmp_path)}
    assert lines["wsd_lr"].status == "PASS"
    assert (lines["UpdateClock"].status, lines["UpdateClock"].message) == (
        "FAIL", "ex12_scheduler_clock.py defines no UpdateClock")


def test_a_file_that_does_not_import_fails_every_function(tmp_path):
    (tmp_path / "ex12_scheduler_clock.py").write_text("def wsd_lr(update, cfg)\n    return 1.0\n")
    lines = check.check_chapter("12", tmp_path)
    assert [x.function for x in lines] == ["wsd_lr", "UpdateClock", "cosine_restarts_lr", "predict_decay_entry"]
    assert all(x.status == "FAIL" and "SyntaxError" in x.message and "(line 1)" in x.message for x in lines)


def test_checks_leave_the_callers_random_state_alone():
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    check.check_chapter("19", "answers")  # its checks call torch.manual_seed
    assert torch.equal(torch.rand(3), want)


def test_sample_output_is_the_command_and_the_stub_report():
    out = check.sample_output("12")
    assert out.splitlines() == ["$ bp-mech check 12", "TODO wsd_lr: not implemented yet",
                                "TODO UpdateClock: not implemented yet",
                                "TODO cosine_restarts_lr: not implemented yet",
                                "TODO predict_decay_entry: not implemented yet",
                                "0 of 4 functions pass, 4 not implemented yet, 0 failing"]


def test_cli_lines_and_exit_codes(tmp_path, capsys):
    assert main(["check", "12"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "TODO wsd_lr: not implemented yet"
    assert main(["check", "12", "--dir", "answers"]) == 0
    assert capsys.readouterr().out.splitlines() == ["PASS wsd_lr", "PASS UpdateClock", "PASS cosine_restarts_lr",
                                                    "PASS predict_decay_entry",
                                                    "4 of 4 functions pass, 0 not implemented yet, 0 failing"]
    (tmp_path / "ex09_local_backward.py").write_text(textwrap.dedent(WRONG_SILU))
    assert main(["check", "09", "--dir", str(tmp_path)]) == 1
    assert "FAIL silu_backward: " in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["check", "99"], "unknown chapter"),
    (["check", "09", "--dir", "/nonexistent/dir"], "no such directory"),
    (["check", "12", "--dir", "."], "ex12_scheduler_clock.py does not exist"),
])
def test_cli_bad_input_is_one_line_and_status_2(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_verbose_shows_pytest_output():
    run = lambda *a: subprocess.run([sys.executable, "-m", "bp_mech", "check", "12", "-v", *a],
                                    capture_output=True, text=True, timeout=300)
    stubs, answers = run(), run("--dir", "answers")
    assert stubs.returncode == 1 and "NotImplementedError" in stubs.stdout and "FAILED" in stubs.stdout
    assert answers.returncode == 0 and "PASSED" in answers.stdout and " passed" in answers.stdout


def test_checking_a_chapter_imports_its_checks_only():
    """A page runs its own chapter's checks while the book builds: importing every chapter's references (peft
    through transformers' WSD schedule, among them) cost each page seconds. In a fresh interpreter, checking
    chapter 19 imports its own checks modules (ex19 and its variant's), no other chapter's, and not peft."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from bp_mech.checks.runner import chapter_checks; chapter_checks('19'); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('bp_mech.checks.ex') or m == 'peft')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    imported = json.loads(out)
    assert "bp_mech.checks.ex19" in imported and all(m.startswith("bp_mech.checks.ex19") for m in imported), out
