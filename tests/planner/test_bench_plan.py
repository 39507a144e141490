"""``tools/bench_plan.py``, the bench the issue's speed goals are read from: a run is a plan timed (exit 0 or
1), and a run that fails is reported with its status and error line, never as a time; so is a question asked
next in a ``--ask`` session (the ``next`` arm), whose bad input the session forgets rather than exits on."""

import sys

from bp_mech import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import bench_plan as bench  # noqa: E402

QUESTION = ["--workload", "tiny-b2s32", "--budget", "1GiB", "--strategies", "offload", "--workers", "1"]
NONE_FITS = [*QUESTION[:2], "--budget", "1KiB", *QUESTION[4:]]
BAD = ["--workload", "nope", "--budget", "1GiB"]


def test_p95_is_the_nearest_rank():
    assert bench.p95([3, 1, 2]) == 3 and bench.p95([5]) == 5
    assert bench.p95(range(1, 21)) == 19 and bench.p95(range(1, 101)) == 95


def test_last_line_is_the_error_cut_to_fit():
    assert bench.last_line("progress\rbar\nbp-mech: error: x\n") == "bp-mech: error: x"
    assert bench.last_line("") == "" and len(bench.last_line("e" * 500)) == 160


def test_a_run_is_a_plan_timed_and_bad_input_its_error():
    wall, status, line = bench.time_run(QUESTION, 120)
    assert status == 0 and wall > 0, line
    assert bench.time_run(NONE_FITS, 120)[1] == 1  # nothing fits: a plan all the same
    _, status, line = bench.time_run(BAD, 120)
    assert status == 2 and line.startswith("bp-mech: error: cannot parse workload"), line


def test_the_next_arm_times_the_second_question_and_says_why_one_fails():
    wall, status, line = bench.time_next(QUESTION, NONE_FITS, 120)
    assert status == 1 and wall > 0 and line.startswith("bp-mech: no strategy fits"), line
    _, status, line = bench.time_next(QUESTION, BAD, 120)  # forgotten by the session, reported here
    assert status == 2 and "cannot parse workload" in line, line
    _, status, line = bench.time_next(BAD, QUESTION, 120)  # the first question: no session opens
    assert status == 2 and "cannot parse workload" in line, line
    _, status, line = bench.time_next(QUESTION, QUESTION, 0.01)
    assert status == -1 and line.startswith("no answer within"), line
