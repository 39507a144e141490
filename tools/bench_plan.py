#!/usr/bin/env python
"""Time ``bp-mech plan`` end to end (the real command, in a subprocess) against the issue's speed targets.

    tools/bench_plan.py [--rows tiny,05b,7b,70b] [--repeats 3] [--workers N] [--before "FLAGS"] [--after "FLAGS"]
                        [--before-src DIR]

Each row times three arms side by side, interleaved run by run (before, after, next, before, ...) so that the
shared machine's load falls on all alike: ``before`` is the command with ``--before``'s flags (default
``--full-depth``: every candidate traced at full depth, the command before ``planner.depth``); ``after`` is the
command with ``--after``'s (default none: every candidate, extrapolated in depth), the path the issue's
targets are for; ``next`` is the same question as ``after`` asked next in a ``bp-mech plan --ask`` session
(``planner.ask``), whose first question (the row's at batch 3) is answered untimed: from the line sent to
the prompt to the next prompt, the interpreter's start and the imports already paid. ``--before-src DIR``: the
before arm runs the source tree ``DIR/src`` instead of this one, e.g. a worktree of the previous commit
(``git worktree add /tmp/prev <commit>``; then pass ``--before ""`` for that commit's command as it was, or
``--before=--full-depth``: a value that starts with ``--`` needs the ``=``). Reported per arm: the median and
P95 of its runs, and the ratio of its median to before's.

Rows (issue 20, "speed on two cores"; issue 30: the tiny row):

* ``tiny``: ``--workload tiny-b2s64 --budget 1GiB``, every candidate: <= 3 s;

* ``05b``: Qwen2.5-0.5B, ``--workload qwen05-b2s512 --budget 16GiB``, every candidate: <= 5 s (issue 30; issue 20 asked 20 s);
* ``7b``: the Qwen2.5-7B architecture (its public config.json shape, written to a temporary directory),
  batch 2 x seq 512, ``--budget 80GiB``, every candidate: <= 10 s (issue 30; was 60 s);
* ``70b``: Llama-3-70B's public shape, batch 1 x seq 4096, ``--budget 80GiB --gpus 8 --shard fsdp2``:
  <= 20 s (issue 30; was 120 s). Where ``bp-mech plan --help`` offers no ``--gpus``/``--shard`` yet, the row runs on one
  device and the table says so.

Each row runs ``--repeats`` times, one after the other (the machine is shared: the median is reported,
every run beside it). A run's wall time is the whole command's: interpreter start, imports, the config
read, the traces and the printed plan. The command's exit status 0 (something fits) and 1 (nothing
fits, the plan printed all the same) are both a plan; anything else is an error.

Prints one table (workload, arm, flags, median and P95 wall seconds, the runs, target, pass/fail, the
ratio; last, the floor: the interpreter's start and the imports every plan makes, timed alone) and exits 1 when
the after or the next arm misses its target or a run failed, else 0. Environment: HF_HUB_OFFLINE=1 and
PYTHONPATH=src (this source tree) for the command; it runs with this interpreter (``python -m bp_mech plan``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from bp_mech.planner.ask import PROMPT as ASK_PROMPT  # noqa: E402
from bp_mech.planner.shapes import SHAPES  # noqa: E402 (the public shapes the book plans too)

QWEN25_7B, LLAMA3_70B = SHAPES["qwen2.5-7b"], SHAPES["llama-3-70b"]
# row -> (workload label, config or None, plan arguments, target seconds)
ROWS = {
    "tiny": ("tiny-b2s64", None, ["--workload", "tiny-b2s64", "--budget", "1GiB"], 3.0),
    "05b": ("qwen05-b2s512", None, ["--workload", "qwen05-b2s512", "--budget", "16GiB"], 5.0),
    "7b": ("qwen2.5-7b b2 s512", QWEN25_7B, ["--batch", "2", "--seq", "512", "--budget", "80GiB"], 10.0),
    "70b": ("llama-3-70b b1 s4096", LLAMA3_70B, ["--batch", "1", "--seq", "4096", "--budget", "80GiB"], 20.0),
}
SHARDED = ["--gpus", "8", "--shard", "fsdp2"]  # the 70B row's flags, where the command takes them
PLANNED = (0, 1)  # exit statuses of a plan made: something fits / nothing fits
TIMEOUT_FACTOR = 3  # an after run is stopped after this many times its target (at least 20 s): a clear miss
IMPORTS = "import bp_mech.cli, bp_mech.planner.report as r; r.model_classes()"  # every plan's, as it makes them
PROMPT = ASK_PROMPT.encode()  # bp-mech plan --ask's prompt, on stderr
FIRST_BATCH = ["--batch", "3"]  # the next arm's first question, untimed: the row's at another batch
BEFORE_TIMEOUT = 900  # today's command, untargeted: the 70B row took minutes beside other work


def command() -> list[str]:
    """``bp-mech`` as this interpreter runs it from the source tree."""
    return [sys.executable, "-m", "bp_mech"]


def environment(root: Path = ROOT) -> dict:
    """The command's environment: offline, the source tree of ``root`` (default: this one), bytecode written (as
    make does: where PYTHONDONTWRITEBYTECODE is set every run would compile what it imports again)."""
    src = str(root / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return dict(env, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def takes_gpus() -> bool:
    """Whether ``bp-mech plan --help`` lists ``--gpus`` and ``--shard``."""
    out = subprocess.run([*command(), "plan", "--help"], capture_output=True, text=True, env=environment(),
                         cwd=ROOT, timeout=120)
    return out.returncode == 0 and "--gpus" in out.stdout and "--shard" in out.stdout


def plan_process(args: list[str], root: Path = ROOT, **pipes) -> subprocess.Popen:
    """``bp-mech plan`` with ``args`` from ``root``'s sources, stdout discarded, in its own process group (so that
    ``stop`` takes its forked tracing workers with it)."""
    return subprocess.Popen([*command(), "plan", *args], stdout=subprocess.DEVNULL, env=environment(root), cwd=root,
                            start_new_session=True, **pipes)


def stop(proc: subprocess.Popen) -> None:
    """A run past its time stopped, its workers with it (nothing to stop where they have all ended)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def last_line(err: str) -> str:
    """The last line of a run's stderr (its error, where it failed), cut to fit the table."""
    return (err.strip().splitlines() or [""])[-1][:160]


def time_run(args: list[str], timeout: float, root: Path = ROOT) -> tuple[float, int, str]:
    """(wall seconds, exit status, the last line of stderr) of one ``bp-mech plan`` run from ``root``'s sources."""
    t0 = time.perf_counter()
    proc = plan_process(args, root, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return time.perf_counter() - t0, -1, f"stopped after {timeout:.0f} s"
    return time.perf_counter() - t0, proc.returncode, last_line(err)


def time_next(first: list[str], args: list[str], timeout: float) -> tuple[float, int, str]:
    """(wall seconds, exit status, the last line of stderr) of the question ``args`` asked next in a
    ``bp-mech plan --ask`` session (``planner.ask``) whose first question, ``first``, is answered untimed: from
    the line sent to the prompt after its answer (the session then quits, with that answer's status)."""
    proc = plan_process([*first, "--ask"], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    err, t0 = b"", time.perf_counter()

    def prompted(count: int) -> bool:  # stderr read until it holds ``count`` prompts, or the time is up
        nonlocal err
        deadline = time.monotonic() + timeout
        while err.count(PROMPT) < count:
            ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
            if not chunk:
                return False
            err += chunk
        return True

    try:
        if prompted(1):
            t0 = time.perf_counter()
            proc.stdin.write(f"plan {shlex.join(args)}\n".encode())
            proc.stdin.flush()
            if prompted(2):
                wall = time.perf_counter() - t0
                proc.communicate(b"quit\n", timeout=60)
                answer = err.decode(errors="replace").split(ASK_PROMPT)[1]  # (bad input: forgotten, not a plan)
                return wall, 2 if "bp-mech: error:" in answer else proc.returncode, last_line(answer)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:  # (a first question with bad input: the session never opened; its error)
        ended = proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        ended = None
    stop(proc)
    if ended not in (None, *PLANNED):
        return time.perf_counter() - t0, ended, last_line(err.decode(errors="replace"))
    return time.perf_counter() - t0, -1, f"no answer within {timeout:.0f} s"


def time_imports() -> float:
    """Wall seconds of the interpreter starting and importing what every plan imports (this tree's ``bp-mech``,
    its planner, Transformers' model classes as the command imports them: ``planner.report.model_classes``)
    and nothing else: the floor under any row's time."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, env=environment(), cwd=ROOT, timeout=120)
    return time.perf_counter() - t0


def p95(xs) -> float:
    """The 95th percentile of ``xs`` (nearest rank: with few runs, the largest)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-95 * len(xs) // 100) - 1))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm and row (median and P95 reported)")
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to the command (default: its own)")
    ap.add_argument("--after", default="", help="extra flags of the 'after' arm (default: none, the command as is)")
    ap.add_argument("--before", default="--full-depth",
                    help="extra flags of the 'before' arm (default: --full-depth, every block traced: the command "
                         "before the extrapolation in depth)")
    ap.add_argument("--before-src", type=Path, default=ROOT,
                    help="the source tree the 'before' arm runs (its src/; default: this one), e.g. a worktree of the "
                         "previous commit")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    if unknown := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    sharded = takes_gpus()
    print(f"bp-mech plan, {a.repeats} run(s) per arm and row, {os.cpu_count()} CPUs visible, "
          f"affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}; "
          f"--gpus/--shard {'accepted' if sharded else 'NOT accepted by this bp-mech: the 70b row runs on one device'}; "
          f"before: {a.before or '(the command as is)'}"
          f"{'' if a.before_src.resolve() == ROOT else f' from {a.before_src}'}; after: {a.after or '(the command as is)'}", flush=True)
    table, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for name in rows:
            label, config, args, target = ROWS[name]
            args = list(args)
            if config is not None:
                path = Path(tmp) / name / "config.json"
                path.parent.mkdir()
                path.write_text(json.dumps(config))
                args = ["--config", str(path), *args]
            if name == "70b":
                args += SHARDED if sharded else []
                label += "" if sharded else " (one device)"
            if a.workers:
                args += ["--workers", str(a.workers)]
            arms = {"before": args + a.before.split(), "after": args + a.after.split(), "next": args + a.after.split()}
            runs = {arm: [] for arm in arms}
            timeout = TIMEOUT_FACTOR * max(target, 20.0)
            for _ in range(a.repeats):  # interleaved: the machine's load falls on every arm alike
                for arm, flags in arms.items():
                    runs[arm].append(time_next(flags + FIRST_BATCH, flags, timeout) if arm == "next" else
                                     time_run(flags, timeout, ROOT) if arm == "after" else
                                     time_run(flags, BEFORE_TIMEOUT, a.before_src.resolve()))
            shown = " ".join(f"{name}/config.json" if x.startswith(tmp) else x for x in args)
            med = {}
            for arm, rs in runs.items():
                errors = [f"rc {rc}: {tail}" for _, rc, tail in rs if rc not in PLANNED]
                walls = [w for w, _, _ in rs]
                med[arm] = statistics.median(walls)
                ok = arm == "before" or (not errors and med[arm] <= target)
                failed |= bool(errors) or not ok
                extra = a.before if arm == "before" else a.after
                flags = shown + (f" {extra}" if extra else "")
                table.append((label, arm, flags if arm != "next" else "the same flags, asked next in a --ask session",
                              f"{med[arm]:.1f}", f"{p95(walls):.1f}", " ".join(f"{w:.1f}" for w in walls),
                              "-" if arm == "before" else f"{target:.0f}",
                              ("pass" if ok else "FAIL") + (f" ({errors[0]})" if errors else "")
                              + ("" if arm == "before" else f"; x{med[arm] / med['before']:.2f} of before")))
                print(f"  {label} {arm}: median {table[-1][3]} s, P95 {table[-1][4]} s (runs {table[-1][5]}; "
                      f"exit {[rc for _, rc, _ in rs]})", flush=True)
    floor = [time_imports() for _ in range(max(a.repeats, 3))]
    table.append(("(imports only)", "floor", f'python -c "{IMPORTS}"', f"{statistics.median(floor):.1f}",
                  f"{p95(floor):.1f}", " ".join(f"{w:.1f}" for w in floor), "-", "-"))
    head = ("workload", "arm", "flags", "median s", "P95 s", "runs s", "target s", "result")
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *table]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
