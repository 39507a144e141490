"""The sample of ``bp-mech check`` a chapter prints: a typical slip and the line the reader gets for it,
run on a variant at build time (not the untouched stubs' TODO list, not typed text)."""

from types import SimpleNamespace

import torch

from bp_mech.book.check_sample import FACTOR, exercise_file, mistake_sample, off_by_a_factor, variant_text
from bp_mech.checks.runner import check_chapter


def test_the_slip_scales_floats_and_counts_and_leaves_the_rest():
    wrong = off_by_a_factor(lambda: (torch.ones(2), 2.0, 128, True, "x", {"a": 1.0}))
    t, f, n, b, s, d = wrong()
    assert torch.equal(t, torch.full((2,), FACTOR)) and f == 2.0 * FACTOR and n == 130
    assert b is True and s == "x" and d == {"a": FACTOR}


def test_the_variant_is_the_stubs_with_one_function_replaced():
    stub = exercise_file("09")
    text = variant_text(stub, "silu_backward")
    assert text.startswith(stub.read_text()) and "silu_backward = _off_by_a_factor(_answer.silu_backward)" in text


def test_the_sample_is_a_failing_check_of_the_slip_not_the_stubs_todo_list():
    out = mistake_sample("09", check_chapter)
    lines = out.splitlines()
    assert lines[0].startswith("$ bp-mech check 09") and len(lines) == 2
    assert lines[1].startswith("FAIL ") and "TODO" not in out


def test_a_check_that_the_slip_does_not_fail_moves_on_to_the_next_function():
    calls = []

    def fake(chapter, directory):
        calls.append(chapter)
        fn = ["linear_backward", "silu_backward"][len(calls) - 1]
        status = "FAIL" if len(calls) == 2 else "PASS"
        return [SimpleNamespace(function=fn, status=status)]

    out = mistake_sample("09", fake)
    assert len(calls) == 2 and "silu_backward" in out.splitlines()[0]
