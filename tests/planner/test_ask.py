"""``bp-mech plan --ask`` (``bp_mech.planner.ask``): each next question is the last one's flags with the line's
after them, or a new one after ``plan``; bad input is answered with its one line and forgotten; an empty
line, ``quit`` or the end of the input stops; and, run as the command, each answer is the plan that
``bp-mech plan`` prints for the same flags on its own."""

import io
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bp_mech import ROOT, cli
from bp_mech.planner import ask

FIRST = ["--workload", "tiny-b2s32", "--budget", "1GiB", "--strategies", "checkpoint-all", "--workers", "1"]


def asked(lines, answers=None, status=0, first=FIRST):
    """The flags each question was answered with, the session's status and what went to stderr."""
    seen, err = [], io.StringIO()

    def answer(flags):
        seen.append(flags)
        return (answers or {}).get(len(seen), 0)

    lines = iter([*lines])
    out = ask.session(list(first), answer, status, read=lambda: next(lines, ""), err=err)
    return seen, out, err.getvalue()


def test_a_line_of_flags_changes_the_last_question():
    seen, status, _ = asked(["--batch 4\n", "--seq 16 --dtype bf16\n", "--batch 8\n"])
    assert seen == [FIRST + ["--batch", "4"], FIRST + ["--batch", "4", "--seq", "16", "--dtype", "bf16"],
                    FIRST + ["--seq", "16", "--dtype", "bf16", "--batch", "8"]]  # (the last --batch only)
    assert status == 0


# words of plan's flags: options with a value (written whole, with '=', or abbreviated) and switches
OPTIONS = st.sampled_from([
    ["--batch", "2"], ["--batch", "max"], ["--batch=8"], ["--bat", "4"], ["--seq", "16"], ["--seq=32"],
    ["--budget", "1GiB"], ["--budget", "8GiB"], ["--workload", "tiny-b2s32"], ["--workload=qwen05-b2s512"],
    ["--dtype", "bf16"], ["--dtype", "float32"], ["--lora-rank", "4"], ["--freeze", "layers\\.0\\."],
    ["--strategies", "offload,fp16"], ["--keep-outputs"], ["--json"], ["--full-depth"], ["--ask"]])


@settings(max_examples=300, deadline=None)
@given(st.lists(OPTIONS, max_size=8), st.lists(OPTIONS, max_size=6))
def test_merged_flags_read_as_the_flags_and_the_line_one_after_the_other(first, line):
    # the contract: the command reads the merged question as it reads the last one's flags and the line's after
    flags, words = ["--budget", "2GiB", *(w for o in first for w in o)], [w for o in line for w in o]
    parser = cli.build_parser()
    assert vars(parser.parse_args(["plan", *ask.merged(flags, words)])) == \
        vars(parser.parse_args(["plan", *flags, *words]))
    # and an option given once is written once
    names = [w.split("=")[0] for w in ask.merged(flags, words) if w.startswith("--")]
    assert len(names) == len(set(names))


def test_plan_starts_a_new_question_and_quoting_is_the_shells():
    seen, _, err = asked(["plan --config c.json --batch 2 --seq 8 --budget 1GiB\n", "--freeze 'embed|lm_head'\n"])
    new = ["--config", "c.json", "--batch", "2", "--seq", "8", "--budget", "1GiB"]
    assert seen == [new, new + ["--freeze", "embed|lm_head"]]
    # each question echoed as the one command that asks it
    assert "bp-mech plan --config c.json --batch 2 --seq 8 --budget 1GiB --freeze 'embed|lm_head'\n" in err
    seen, _, err = asked(["--batch 4 --ask\n"], first=[*FIRST, "--ask"])  # (--ask: the session is open)
    assert seen == [FIRST + ["--batch", "4"]] and "--ask" not in err


def test_bad_input_is_forgotten_and_the_status_is_the_last_answered_questions():
    # the second question is bad input (status 2): the third changes the first's, not the second's
    seen, status, _ = asked(["--batch 4\n", "--workload nope\n", "--seq 16\n"], answers={1: 1, 2: 2, 3: 0})
    assert seen[2] == FIRST + ["--batch", "4", "--seq", "16"]
    assert status == 0
    _, status, _ = asked(["--batch 4\n", "--workload nope\n"], answers={1: 1, 2: 2})
    assert status == 1  # the last question answered did not fit; the bad one after it does not count
    _, status, _ = asked([], status=1)
    assert status == 1  # nothing asked after the first: its status


def test_the_commands_help_is_printed_and_forgotten():
    seen = []

    def answer(flags):
        seen.append(flags)
        if "--help" in flags:
            raise SystemExit(0)  # (argparse, after printing the help)
        return 0

    lines = iter(["--help\n", "--batch 4\n"])
    assert ask.session(list(FIRST), answer, 1, read=lambda: next(lines, ""), err=io.StringIO()) == 0
    assert seen[-1] == FIRST + ["--batch", "4"]


def test_unclosed_quotes_and_help_are_answered_on_stderr_without_a_plan():
    seen, _, err = asked(['--freeze "embed\n', "help\n", "?\n", "--batch 4\n"])
    assert seen == [FIRST + ["--batch", "4"]]
    assert "bp-mech: error: No closing quotation" in err
    assert err.count(ask.HELP) == 3 and err.count(ask.PROMPT) == 5  # the first help, then asked twice


@pytest.mark.parametrize("stop", ["\n", "   \n", "quit\n", "Q\n", "exit\n", ""])
def test_an_empty_line_quit_or_the_end_of_the_input_stops(stop):
    seen, _, err = asked([stop, "--batch 4\n"])
    assert seen == [] and err.count(ask.PROMPT) == 1


def test_ctrl_c_at_the_prompt_stops_with_the_last_status():
    def read():
        raise KeyboardInterrupt

    assert ask.session(list(FIRST), lambda flags: pytest.fail("asked"), 1, read=read, err=io.StringIO()) == 1


def plans(text: str) -> list[str]:
    """The plans printed, one per question, without the trace's wall time (which differs run to run)."""
    return [re.sub(r"\(\d+ strateg(y|ies) traced in [\d.]+ s\)", "", p) for p in text.split("bp-mech plan: ")[1:]]


def test_the_command_answers_each_question_as_the_command_on_its_own(capsys):
    # what a plan sets up (peft's adapters, FSDP2's fake ranks) must not leak into the next question's plan
    questions = [FIRST, FIRST + ["--batch", "4"], FIRST + ["--batch", "4", "--lora-rank", "4"],
                 FIRST + ["--gpus", "2", "--shard", "fsdp2"], FIRST,
                 ["--workload", "tiny-b2s32", "--budget", "1KiB", "--strategies", "offload", "--workers", "1"]]
    lines = ["--batch 4", "--lora-rank 4", "--workload nope",
             *(f"plan {' '.join(questions[k])}" for k in (3, 4, 5))]  # (FSDP2, the first again, nothing fits)
    run = subprocess.run([sys.executable, "-m", "bp_mech", "plan", *FIRST, "--ask"], input="\n".join(lines) + "\n",
                         text=True, capture_output=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 1, run.stderr  # the last question: nothing fits 1 KiB
    alone = []
    for flags in questions:
        cli.main(["plan", *flags])
        alone += plans(capsys.readouterr().out)
    assert len(alone) == len(questions) and plans(run.stdout) == alone
    assert "cannot parse workload 'nope'" in run.stderr and run.stderr.count(ask.PROMPT) == len(lines) + 1


def test_at_a_terminal_the_up_arrow_brings_the_last_question_back():
    pty = pytest.importorskip("pty")
    try:
        pid, fd = pty.fork()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal here: {e}")
    if pid == 0:  # the child: the command at a terminal (stdin, stdout and stderr the pty)
        try:
            os.environ.update(HF_HUB_OFFLINE="1")
            os.execv(sys.executable, [sys.executable, "-m", "bp_mech", "plan", *FIRST, "--ask"])
        finally:
            os._exit(127)  # (never back into pytest)
    out, quit_at = b"", None

    def shown(text: bytes, count: int = 1) -> bool:
        nonlocal out
        deadline = time.monotonic() + 60
        while out.count(text) < count and time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # the child is gone
                    break
        return out.count(text) >= count

    try:
        assert shown(ask.PROMPT.encode())
        os.write(fd, b"--batch 4\n")
        assert shown(b"batch 4 x seq 32") and shown(ask.PROMPT.encode(), 2)
        os.write(fd, b"\x1b[A\x7f8\n")  # up arrow: "--batch 4" back; its 4 deleted, 8 typed
        assert shown(b"batch 8 x seq 32") and shown(ask.PROMPT.encode(), 3)
        os.write(fd, b"quit\n")
        quit_at = time.monotonic()
    finally:
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if quit_at is None or time.monotonic() > quit_at + 60:  # a step failed, or it does not end
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
