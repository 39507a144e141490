#!/usr/bin/env python
"""Time ``bp-mech plan`` end to end (the real command, in a subprocess) against the issue's speed targets.

    tools/bench_plan.py [--rows 05b,7b,70b] [--repeats 3] [--workers N]

Rows (issue 20, "speed on two cores"):

* ``05b``: Qwen2.5-0.5B, ``--workload qwen05-b2s512 --budget 16GiB``, every candidate: <= 20 s;
* ``7b``: the Qwen2.5-7B architecture (its public config.json shape, written to a temporary directory),
  batch 2 x seq 512, ``--budget 80GiB``, every candidate: <= 60 s;
* ``70b``: Llama-3-70B's public shape, batch 1 x seq 4096, ``--budget 80GiB --gpus 8 --shard fsdp2``:
  <= 120 s. Where ``bp-mech plan --help`` offers no ``--gpus``/``--shard`` yet, the row runs on one
  device and the table says so.

Each row runs ``--repeats`` times, one after the other (the machine is shared: the median is reported,
every run beside it). A run's wall time is the whole command's: interpreter start, imports, the config
read, the traces and the printed plan. The command's exit status 0 (something fits) and 1 (nothing
fits, the plan printed all the same) are both a plan; anything else is an error.

Prints one table (workload, flags, median wall seconds, the runs, target, pass/fail) and exits 1 when a
target is missed or a run failed, else 0. Environment: HF_HUB_OFFLINE=1 and PYTHONPATH=src (this source
tree) for the command; it runs with this interpreter (``python -m bp_mech plan``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from bp_mech.planner.shapes import SHAPES  # noqa: E402 (the public shapes the book plans too)

QWEN25_7B, LLAMA3_70B = SHAPES["qwen2.5-7b"], SHAPES["llama-3-70b"]
# row -> (workload label, config or None, plan arguments, target seconds)
ROWS = {
    "05b": ("qwen05-b2s512", None, ["--workload", "qwen05-b2s512", "--budget", "16GiB"], 20.0),
    "7b": ("qwen2.5-7b b2 s512", QWEN25_7B, ["--batch", "2", "--seq", "512", "--budget", "80GiB"], 60.0),
    "70b": ("llama-3-70b b1 s4096", LLAMA3_70B, ["--batch", "1", "--seq", "4096", "--budget", "80GiB"], 120.0),
}
SHARDED = ["--gpus", "8", "--shard", "fsdp2"]  # the 70B row's flags, where the command takes them
PLANNED = (0, 1)  # exit statuses of a plan made: something fits / nothing fits
TIMEOUT_FACTOR = 3  # a run is stopped after this many times its target (a clear miss)


def command() -> list[str]:
    """``bp-mech`` as this interpreter runs it from the source tree."""
    return [sys.executable, "-m", "bp_mech"]


def environment() -> dict:
    src = str(ROOT / "src")
    return dict(os.environ, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def takes_gpus() -> bool:
    """Whether ``bp-mech plan --help`` lists ``--gpus`` and ``--shard``."""
    out = subprocess.run([*command(), "plan", "--help"], capture_output=True, text=True, env=environment(),
                         cwd=ROOT, timeout=120)
    return out.returncode == 0 and "--gpus" in out.stdout and "--shard" in out.stdout


def time_run(args: list[str], timeout: float) -> tuple[float, int, str]:
    """(wall seconds, exit status, the last line of stderr) of one ``bp-mech plan`` run."""
    t0 = time.perf_counter()
    # its own process group: a run stopped at the timeout takes its forked tracing workers with it
    proc = subprocess.Popen([*command(), "plan", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=environment(), cwd=ROOT, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return time.perf_counter() - t0, -1, f"stopped after {timeout:.0f} s"
    return time.perf_counter() - t0, proc.returncode, (err.strip().splitlines() or [""])[-1][:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (the median is reported)")
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to the command (default: its own)")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    if unknown := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    sharded = takes_gpus()
    print(f"bp-mech plan, {a.repeats} run(s) per row, {os.cpu_count()} CPUs visible, "
          f"affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}; "
          f"--gpus/--shard {'accepted' if sharded else 'NOT accepted by this bp-mech: the 70b row runs on one device'}",
          flush=True)
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
            runs = [time_run(args, TIMEOUT_FACTOR * target) for _ in range(a.repeats)]
            errors = [f"rc {rc}: {tail}" for _, rc, tail in runs if rc not in PLANNED]
            median = statistics.median(w for w, _, _ in runs)
            ok = not errors and median <= target
            failed |= not ok
            shown = " ".join(f"{name}/config.json" if x.startswith(tmp) else x for x in args)
            table.append((label, shown, f"{median:.1f}", " ".join(f"{w:.1f}" for w, _, _ in runs), f"{target:.0f}",
                          "pass" if ok else "FAIL" + (f" ({errors[0]})" if errors else "")))
            print(f"  {label}: {table[-1][2]} s (runs {table[-1][3]}; exit {[rc for _, rc, _ in runs]})", flush=True)
    head = ("workload", "flags", "median s", "runs s", "target s", "result")
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *table]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
