"""``bp-mech``: run experiments, check exercises, validate records, preflight a profile.

Each command's flags are parsed into a typed request, checked when it is made (a frozen dataclass per
command: ``RunRequest``, ``ResultsRequest``, ``CheckRequest``, ``ConformanceRequest``, ``PlanRequest``,
``PreflightRequest``); the code below the command line takes the request, never the parser's namespace.

Bad input (unknown ID, profile or mode, a shape the model cannot take, ``real_gpu`` without
CUDA, a corrupt record, a pretrained model missing from the offline cache) prints one line on
stderr and exits with status 2. In a suite, a failing experiment prints its full traceback and
the next one runs; the exit status is then 1. ``plan`` exits 0 when a strategy fits the budget and 1
when none does (the plan is printed all the same, with what would fit instead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bp_mech import RESULTS_DIR, ROOT
from bp_mech.instruments.adamw import ADAMW_IMPLS
from bp_mech.bench.optimizer import OPTIMIZERS
from bp_mech.bench.timing import SMOKE_SCHEDULE
from bp_mech.instruments.workload import WorkloadError
from bp_mech.planner import ask
from bp_mech.planner.request import DTYPES, SHARDS, PlanRequest
from bp_mech.experiments import runner
from bp_mech.experiments.runner import RunRequest, UsageError, progress_bar
from bp_mech.records import provenance, registry, results
from bp_mech.records.environment import ProfileError, check_profile, preflight
from bp_mech.state_format import TrainingStateError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2
        raise UsageError(message)


@dataclass(frozen=True)
class ResultsRequest:
    """``bp-mech results``: list or validate cached records."""

    action: str  # "list" | "validate"
    dir: str | None = None  # a directory of records or one record file; None: book/results

    def __post_init__(self):
        if self.action not in ("list", "validate"):
            raise UsageError(f"unknown results action {self.action!r}; use list or validate")


@dataclass(frozen=True)
class CheckRequest:
    """``bp-mech check``: check a chapter's exercise solutions."""

    chapter: str  # e.g. "09", or "amp"
    dir: str | None = None  # the directory holding the solutions; None: exercises/
    verbose: bool = False  # pytest's full output instead of one line per function


@dataclass(frozen=True)
class ConformanceRequest:
    """``bp-mech conformance``: the framework-conformance rows of Part 02."""

    profile: str = "TRAIN-CPU"  # the environment profile (records.environment)
    all_part02: bool = False  # every chapter's row (required: the only scope there is)
    require_passed: bool = False  # exit 1 when a row fails or none ran

    def __post_init__(self):
        check_profile(self.profile)
        if not self.all_part02:
            raise UsageError("conformance needs --all-part02")


@dataclass(frozen=True)
class PreflightRequest:
    """``bp-mech preflight``: check a profile's environment."""

    profile: str  # the environment profile (records.environment)

    def __post_init__(self):
        check_profile(self.profile)


def fields_of(cls, a: argparse.Namespace) -> dict:
    """The parsed flags that are ``cls``'s fields (the parser's ``dest`` names are the fields' names).

    Args:
        cls: a request dataclass.
        a: the parser's namespace.

    Returns:
        ``{field: value}`` for every field of ``cls`` the namespace holds.

    Example:
        >>> fields_of(CheckRequest, argparse.Namespace(chapter="09", dir=None, verbose=False, cmd="check"))
        {'chapter': '09', 'dir': None, 'verbose': False}
    """
    return {f.name: vars(a)[f.name] for f in dataclasses.fields(cls) if f.name in vars(a)}


def plan_request(a: argparse.Namespace) -> PlanRequest:
    """``bp-mech plan``'s request from the parser's namespace ``a``: the flags' text read and checked
    (``PlanRequest.from_flags``; bad input raises a ``PlanError``, one line, exit 2).

    Example:
        >>> plan_request(build_parser().parse_args(["plan", "--workload", "tiny-b2s32", "--budget", "1GiB"])).budget
        1073741824
    """
    flags = vars(a)
    typed = {k: flags[k] for k in ("config", "workload", "device_name", "json", "workers", "keep_outputs", "optimizer",
                                   "optimizer_impl", "freeze", "lora_rank", "gpus", "shard", "full_depth")}
    return PlanRequest.from_flags(budget=flags["budget"], batch=flags["batch"], seq=flags["seq"], dtype=flags["dtype"],
                                  lora_targets=flags["lora_targets"], strategies=flags["strategies"], **typed)


def cmd_results(a: ResultsRequest) -> int:
    d = Path(a.dir) if a.dir else RESULTS_DIR
    if not d.exists():
        raise results.RecordError(f"{d}: no such file or directory")
    # validates every file; raises RecordError naming the first bad one
    items = [(d, results.load_record(d))] if d.is_file() else results.load_records(d)
    if a.action == "validate":
        groups: dict[tuple, list] = {}
        for p, r in items:
            groups.setdefault((r.semantic_id, r.run_label, r.workload_id), []).append((p, r))
        for g in groups.values():
            results.check_mergeable(g)
        print(f"{len(items)} record(s) valid in {d}")
        return 0
    for p, r in items:
        stale = provenance.is_stale(r, registry.get(r.semantic_id).module)
        print(f"{p.name}  {r.evidence_level}  {r.workload_id}  {r.candidate}{'  STALE' if stale else ''}")
    return 0


def cmd_check(a: CheckRequest) -> int:
    """One line per exercise function and a summary (bp_mech.checks.runner); ``-v``: pytest's full output."""
    from bp_mech.checks import runner as check

    try:
        if a.verbose:
            cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "checks" / "test_exercises.py"), "-m",
                   check.marker(a.chapter), f"--impl={check.solutions_dir(a.dir)}", "-v", "-p", "no:cacheprovider"]
            return subprocess.call(cmd, cwd=ROOT)
        lines = check.check_chapter(a.chapter, a.dir)
    except check.CheckError as e:
        raise UsageError(str(e)) from None
    print(check.format_report(lines))
    return check.exit_code(lines)


def cmd_conformance(a: ConformanceRequest) -> int:
    rows = [mod.conformance() for e in registry.EXPERIMENTS.values() if hasattr(mod := e.load(), "conformance")]
    for r in rows:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.page:<26} {r.semantic_id:<28} vs {r.reference}: {r.detail}")
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if (a.require_passed and (failed or not rows)) else 0


def cmd_preflight(a: PreflightRequest) -> int:
    report = preflight(a.profile)
    print(json.dumps(report, indent=1))
    return 0 if report["status"] == "ok" else 1


def cmd_plan(r: PlanRequest) -> int:
    from bp_mech.planner import report as plan_report

    plan_report.model_classes()
    try:
        return plan_report.run(r, progress=progress_bar)
    finally:  # the fake model is garbage now: no later collection scans it (--ask's next plans; a Python caller's exit)
        gc.freeze()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bp-mech", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run one experiment (all candidates) or the GPU suite")
    r.add_argument("id", nargs="?", help="experiment ID, e.g. TRAIN-LOCAL-BACKWARD")
    r.add_argument("--suite", help="'gpu': every GPU experiment, numeric paths first; 'cpu': every implemented experiment on the CPU")
    r.add_argument("--workload", help="e.g. tiny-b2s64, qwen05-b2s512 (with --suite: every experiment at it)")
    r.add_argument("--smoke", action="store_true",
                   help=f"every code path once with few steps (SMOKE_SCHEDULE {SMOKE_SCHEDULE}): its records check "
                        "that the run works; they are not evidence (give them their own --run-label)")
    r.add_argument("--mode", choices=registry.MODES)
    r.add_argument("--out", type=Path, help="directory to save the records in (each one as soon as it is made)")
    r.add_argument("--run-label", help="run label (a shrunken matrix needs its own)")
    r.add_argument("--model-source", choices=("config", "pretrained"), default="config",
                   help="random init from the config (default) or downloaded weights")
    r.add_argument("--model-id", help="hub id or local directory of a pretrained model")
    r.add_argument("--revision", default="main", help="hub revision, resolved to a commit")
    r.add_argument("--local-files-only", action="store_true", help="pretrained: never touch the network")
    r.add_argument("--domain-text", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: your domain text file (UTF-8)")
    r.add_argument("--holdout-text", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: your holdout (retention) text file")
    r.add_argument("--state-dir", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: keep the saved training states here")
    r.add_argument("--resume-from", type=Path, help="TRAIN-CONTINUAL-PRETRAIN: resume the 'resumed' candidate from this "
                   "saved training state (a step directory, or a --state-dir whose 'latest' names one)")
    r.set_defaults(fn=runner.run, request=lambda a: RunRequest(**fields_of(RunRequest, a)))
    s = sub.add_parser("results", help="list or validate cached records")
    s.add_argument("action", choices=("list", "validate"))
    s.add_argument("dir", nargs="?", help="default: book/results")
    s.set_defaults(fn=cmd_results, request=lambda a: ResultsRequest(**fields_of(ResultsRequest, a)))
    c = sub.add_parser("check", help="check your solutions of a chapter's exercises")
    c.add_argument("chapter", help="chapter number, e.g. 09 (or 'amp')")
    c.add_argument("--dir", help="directory holding your exNN_*.py (default: exercises/)")
    c.add_argument("-v", "--verbose", action="store_true", help="pytest's full output instead of one line per function")
    c.set_defaults(fn=cmd_check, request=lambda a: CheckRequest(**fields_of(CheckRequest, a)))
    f = sub.add_parser("conformance", help="framework-conformance rows of Part 02")
    f.add_argument("--all-part02", action="store_true")
    f.add_argument("--profile", default="TRAIN-CPU")
    f.add_argument("--require-passed", action="store_true")
    f.set_defaults(fn=cmd_conformance, request=lambda a: ConformanceRequest(**fields_of(ConformanceRequest, a)))
    pl = sub.add_parser("plan", help="which memory strategies fit a budget: a fake-tensor step per strategy",
                        epilog="exit status: 0 when a strategy fits the budget; 1 when none does (the plan is "
                               "printed all the same, with what would fit instead); 2 for bad input")
    pl.add_argument("--config", help="a Hugging Face causal-LM config.json (or its directory)")
    pl.add_argument("--workload", help="or a workload ID, e.g. qwen05-b2s512 (its batch and seq unless given)")
    pl.add_argument("--batch", help="sequences per step, or max: per strategy the largest batch that fits")
    pl.add_argument("--seq", help="tokens per sequence, or max: per strategy the largest sequence that fits")
    pl.add_argument("--budget", required=True, help="device memory, e.g. 8GiB, 80GB")
    pl.add_argument("--device-name", help="use cached GPU records of this device only (e.g. H200)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--strategies", metavar="A,B,C", help="plan only these candidates (plain always), e.g. "
                    "checkpoint-all,offload; default: every candidate")
    pl.add_argument("--workers", type=int, help="processes tracing the strategies (default: CPUs, at most 4)")
    pl.add_argument("--ask", action="store_true", help="after the plan, ask the next questions in this process: "
                    "flags that change the last one (--batch 8), each answered without the imports' seconds")
    pl.add_argument("--full-depth", action="store_true",
                    help="trace every decoder block of each step (slower, the same plan) instead of extrapolating "
                         "from three shallow copies of the stack")
    pl.add_argument("--keep-outputs", action="store_true",
                    help="plan the hand-written loop whose outputs (the logits) stay alive through backward "
                         "(out = model(**batch); out.loss.backward()); default: dropped before it, as Trainer does")
    pl.add_argument("--optimizer-impl", choices=("default", *ADAMW_IMPLS), default="default",
                    help="the optimizer's implementation: default (what PyTorch picks on CUDA: foreach), foreach, "
                         "fused (AdamW, SGD), or for-loop (foreach=False, fused=False)")
    # how the model is fine-tuned (planner.finetune) and with which optimizer
    pl.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the weights' dtype, and so their gradients' and the optimizer state's: bf16 or fp16 without "
                         "a float32 master copy (default float32)")
    pl.add_argument("--freeze", metavar="PATTERN",
                    help="freeze the parameters whose names match this regular expression (e.g. 'embed|layers\\.0\\.')")
    pl.add_argument("--lora-rank", type=int, metavar="R", help="LoRA adapters of rank R through peft (the base frozen)")
    pl.add_argument("--lora-targets", metavar="A,B,C",
                    help="the modules LoRA adapts, e.g. q_proj,v_proj (default: peft's for the model type)")
    pl.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                    help="adamw (default), sgd (momentum 0.9), adafactor (torch.optim.Adafactor) or adamw8bit "
                         "(bitsandbytes' AdamW8bit)")
    # several GPUs (planner.shard): rank 0's plan, traced in this process
    pl.add_argument("--gpus", type=int, default=1, metavar="N", help="devices the step is spread over (default 1); "
                    "--batch is then the batch per device")
    pl.add_argument("--shard", choices=SHARDS,
                    help="with --gpus N: fully_shard on each decoder block and the root (fsdp2), or full replicas "
                         "with gradient buckets (ddp)")
    pl.set_defaults(fn=cmd_plan, request=plan_request)
    q = sub.add_parser("preflight", help="check a profile's environment")
    q.add_argument("--profile", required=True)
    q.set_defaults(fn=cmd_preflight, request=lambda a: PreflightRequest(**fields_of(PreflightRequest, a)))
    return p


def command(argv: list[str]) -> tuple[argparse.Namespace | None, int]:
    """One command: its parsed flags (None where bad input stopped it) and its exit status."""
    try:
        a = build_parser().parse_args(argv)
        return a, a.fn(a.request(a))  # the command's typed request, checked as it is made
    except (UsageError, registry.RegistryError, WorkloadError, results.RecordError, ProfileError, TrainingStateError) as e:
        print(f"bp-mech: error: {e}", file=sys.stderr)
        return None, 2


def main(argv: list[str] | None = None) -> int:
    a, status = command(argv := sys.argv[1:] if argv is None else list(argv))
    if getattr(a, "ask", False):  # bp-mech plan --ask: the next questions, in this process (planner.ask)
        status = ask.session(argv[1:], lambda flags: command(["plan", *flags])[1], status)
    return status


def entry() -> None:
    """``bp-mech`` and ``python -m bp_mech``: ``main``'s status. A plan leaves no file open and nothing to clean up, so
    once its output is flushed it skips the teardown (``os._exit``), which frees its fake objects one by one (0.2 s)."""
    status = main()
    if sys.argv[1:2] == ["plan"]:
        with contextlib.suppress(OSError, ValueError):  # (a reader that closed the pipe early)
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
