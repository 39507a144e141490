"""``bp-mech plan``'s typed request (``bp_mech.planner.request``): the flags read into typed fields, bad input
refused when the request is made (one line, exit 2 through the command), nothing under ``bp_mech.planner``
reading the parser's namespace; and a strategy whose step cannot be traced is a ``bench.oom.Failed`` (one
failure type), left out of the plan with its reason."""

import ast
import inspect
import re
from pathlib import Path

import pytest

from bp_mech import cli
from bp_mech.bench.oom import Failed
from bp_mech.bench.strategy import LowPrecision, parse
from bp_mech.planner import plan, report, trace
from bp_mech.planner.inputs import PlanError
from bp_mech.planner.request import DTYPES, PlanRequest, shape_arg

PLANNER = Path(plan.__file__).parent


def test_the_flags_become_typed_fields():
    r = PlanRequest.from_flags(budget="8GiB", config="c.json", batch="4", seq="max", dtype="fp16",
                               lora_rank=8, lora_targets="q_proj, v_proj", optimizer_impl="fused")
    assert (r.budget, r.batch, r.seq, r.weights) == (8 * 2**30, 4, "max", LowPrecision.FP16)
    assert r.lora_targets == ("q_proj", "v_proj") and r.finetune.name == "lora-r8[q_proj,v_proj]"
    assert (r.options.optimizer, r.options.adamw, r.impl) == ("adamw", "fused", "fused")
    assert PlanRequest.from_flags(budget="1GB", workload="tiny-b2s32", dtype="float32").weights is None
    # the --dtype words are the strategies' own: no table maps them
    assert DTYPES == ("float32", "fp16", "bf16") and all(parse(w).amp.word == w for w in DTYPES[1:])


@pytest.mark.parametrize("flags, message", [
    (dict(budget="1GiB"), "exactly one of --config"),
    (dict(budget="1GiB", config="c.json", workload="tiny-b2s32"), "exactly one of --config"),
    (dict(budget="1GiB", config="c.json", batch="2"), "--config needs --batch and --seq"),
    (dict(budget="1GiB", workload="tiny-b2s32", batch="max", seq="max"), "together: give one of them a number"),
    (dict(budget="1GiB", workload="tiny-b2s32", batch="two"), "--batch takes a positive number or max, got 'two'"),
    # 0 is not "not given": the workload's own batch planned in its place, exit 0, was the answer to --batch 0
    (dict(budget="1GiB", workload="tiny-b2s32", batch="0"), "--batch takes a positive number or max, got '0'"),
    (dict(budget="1GiB", workload="tiny-b2s32", seq="-64"), "--seq takes a positive number or max, got '-64'"),
    (dict(budget="1GiB", workload="tiny-b2s32", workers=0), "--workers must be >= 1, got 0"),
    # an empty list names no candidate (every candidate, 17 times the work asked for, was the answer)
    (dict(budget="1GiB", workload="tiny-b2s32", strategies=""), "--strategies names no candidate; name one or more"),
    (dict(budget="1GiB", workload="tiny-b2s32", strategies=" , "), "--strategies names no candidate"),
    (dict(budget="lots", workload="tiny-b2s32"), "cannot read the budget 'lots'"),
    (dict(budget="1GiB", workload="tiny-b2s32", dtype="int8"), "unknown --dtype 'int8'"),
    (dict(budget="1GiB", workload="tiny-b2s32", gpus=2), "go together"),
    (dict(budget="1GiB", workload="tiny-b2s32", gpus=0, shard="ddp"), "--gpus must be >= 1, got 0"),
    (dict(budget="1GiB", workload="tiny-b2s32", shard="zero3", gpus=2), "unknown --shard 'zero3'"),
    (dict(budget="1GiB", workload="tiny-b2s32", optimizer="adafactor", optimizer_impl="fused"), "adafactor has no fused"),
    (dict(budget="1GiB", workload="tiny-b2s32", lora_rank=0), "LoRA rank must be >= 1"),
])
def test_bad_input_is_refused_when_the_request_is_made(flags, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        PlanRequest.from_flags(**flags)


@pytest.mark.parametrize("args, message", [
    (("--batch", "two"), "--batch takes a positive number or max"),
    (("--batch", "0"), "--batch takes a positive number or max, got '0'"),
    (("--workers", "0"), "--workers must be >= 1, got 0"),
    (("--strategies", ""), "--strategies names no candidate"),
    (("--batch", "max", "--seq", "max"), "give one of them a number"),
    (("--config", "c.json"), "exactly one of --config"),
    (("--dtype", "fp8"), "invalid choice: 'fp8'"),
])
def test_the_command_refuses_bad_input_in_one_line_with_status_2(capsys, monkeypatch, args, message):
    monkeypatch.setattr(report, "run", lambda *a, **k: pytest.fail("planned a bad request"))
    rc = cli.main(["plan", "--workload", "tiny-b2s32", "--budget", "1GiB", *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("bp-mech: error: ") and message in err[0], err


def test_the_command_hands_the_plan_its_request(capsys, monkeypatch):
    got = []
    monkeypatch.setattr(report, "run", lambda r, progress=None: got.append(r) or 0)
    assert cli.main(["plan", "--workload", "tiny-b2s32", "--budget", "2GiB", "--dtype", "bf16", "--gpus", "2",
                     "--shard", "ddp", "--keep-outputs"]) == 0
    assert got == [PlanRequest(budget=2 * 2**30, workload="tiny-b2s32", weights=LowPrecision.BF16, gpus=2, shard="ddp",
                               keep_outputs=True)]


def test_shape_arg():
    assert (shape_arg("16", "--seq"), shape_arg(" Max ", "--seq"), shape_arg(None, "--seq")) == (16, "max", None)


def _namespace_reads(path: Path) -> list[str]:
    """``getattr(x, ...)`` calls on a name the code treats as parsed arguments, and any use of argparse."""
    tree, out = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in ("a", "args", "ns", "namespace", "flags"):
            out.append(f"{path.name}:{node.lineno} getattr({node.args[0].id}, ...)")
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "argparse" in ast.unparse(node):
            out.append(f"{path.name}:{node.lineno} imports argparse")
        if isinstance(node, ast.Name) and node.id == "Namespace":
            out.append(f"{path.name}:{node.lineno} Namespace")
    return out


def test_nothing_under_the_planner_reads_the_parsers_namespace():
    reads = [r for p in sorted(PLANNER.glob("*.py")) for r in _namespace_reads(p)]
    assert not reads, reads
    assert inspect.signature(report.run).parameters["r"].annotation in (PlanRequest, "PlanRequest")


def test_the_namespace_check_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\n\ndef run(a):\n    return getattr(a, 'dtype', None)\n")
    assert _namespace_reads(bad) == ["bad.py:1 imports argparse", "bad.py:4 getattr(a, ...)"]


def test_a_step_that_cannot_be_traced_is_a_failed_with_its_reason():
    def broken(sess, s, d):
        raise RuntimeError("an op the fake trace cannot run\nmore")

    out = trace.traced(None, broken, parse("offload"))
    assert out == Failed("RuntimeError: an op the fake trace cannot run", "offload") and not isinstance(out, Exception)
    assert list(trace.ledgers(None, [parse("plain"), parse("fp16")], 1, lambda sess, s, d: s.name if s.amp else 1 / 0)) \
        == [Failed("ZeroDivisionError: division by zero", "plain"), "fp16"]


# --- --strategies: the named candidates only, plain always; their rows as in the full plan, to the byte -----

def test_strategies_names_the_candidates_plain_always():
    from bp_mech.planner.request import NAMES

    r = PlanRequest.from_flags(budget="1GiB", workload="tiny-b2s32", strategies="offload, checkpoint-all")
    assert [s.name for s in r.candidates] == ["plain", "checkpoint-all", "offload"]
    assert [s.name for s in PlanRequest.from_flags(budget="1GiB", workload="tiny-b2s32").candidates] == list(NAMES)
    with pytest.raises(PlanError, match=r"unknown --strategies 'nope'; valid: plain, checkpoint-all"):
        PlanRequest.from_flags(budget="1GiB", workload="tiny-b2s32", strategies="offload,nope")


def test_unknown_strategies_exit_2_with_one_line(capsys):
    rc = cli.main(["plan", "--workload", "tiny-b2s32", "--budget", "1GiB", "--strategies", "offlaod"])
    _, err = capsys.readouterr()
    said = [line for line in re.split(r"[\r\n]", err) if line.strip()]
    assert rc == 2 and len(said) == 1 and "unknown --strategies 'offlaod'; valid: " in said[0], err


@pytest.mark.usefixtures("one_thread")
def test_the_named_subsets_rows_equal_the_full_plans_rows():
    from tests.planner.test_plan import CPU, tiny_config

    config = tiny_config("llama")
    full = plan.plan(config, 2, 32, 2**30, options=CPU)
    r = PlanRequest.from_flags(budget="1GiB", workload="tiny-b2s32", strategies="checkpoint-mlp,offload+fp16+chunked-loss")
    some = plan.plan(config, 2, 32, 2**30, options=CPU, candidates=r.candidates)
    rows = {x.strategy: x for x in full.rows}
    assert [x.strategy for x in some.rows] == ["plain", "checkpoint-mlp", "offload+fp16+chunked-loss"]
    assert all(x == rows[x.strategy] for x in some.rows)  # every field: peaks, stages, ledger, cost
    assert some.outputs_saving == full.outputs_saving
    assert "(3 strategies traced in " in report.format_text(some)
    alone = plan.plan(config, 2, 32, 2**30, options=CPU, candidates=PlanRequest.from_flags(
        budget="1GiB", workload="tiny-b2s32", strategies="plain").candidates)
    assert "(1 strategy traced in " in report.format_text(alone)
