"""Project 73 — TRAIN-BASELINE: a fixed-model, fixed-data training baseline, on 1 and on 2 processes.

Every candidate is the same program, ``bp_mech.projects.baseline_loop``, started by ``accelerate
launch`` (``launch_command``) with 1 or 2 processes over the same global micro-batch G (1 process x G
rows = 2 processes x G/2 rows), the same k micro-batches per update, the same weights and rows. A
candidate's record has its loss curve, holdout loss before and after, tokens per second, step
median/P95 and peak; the 2-process record also its differences from the 1-process run: the loss of
every update, the first update's gradient, the parameters after ``naive_updates`` and after all
updates, and the same for the naive per-rank mean, which must *not* match.

On the CPU the processes talk over gloo; each uses one intra-op thread (the CPU timing protocol), so 2
processes use the machine's 2 cores, 1 process one. The candidates are separate launches, one after
the other: they cannot be interleaved as one process's candidates are, and on a shared 2-core machine
their time ratio says little (the decision never reads it). On CUDA the candidates that fit the
visible GPUs run (one GPU: the 1-process candidate), in ``MIXED_PRECISION["cuda"]``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bp_mech.bench.compare import relative_l2
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.strategy import PLAIN
from bp_mech.bench.timing import clock_for, summarize, timing_noise
from bp_mech.projects import baseline_loop
from bp_mech.projects.baseline_loop import LoopConfig
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

CANDIDATES = ("plain", "2-processes")  # plain: one process, the baseline
PROCESSES = {"plain": 1, "2-processes": 2}
MIXED_PRECISION = {"cpu": "no", "cuda": "fp16"}  # FP16 is the book's default low precision (loss scale, skips)
LAUNCH_TIMEOUT_S = 1200  # one launch, at most
LAUNCH_S = {"cpu": 12.0, "cuda": 10.0}  # dry run: launcher + imports + model build per launch

# 2 processes against 1 process, float32 on the CPU (relative; measured differences are ~1e-7):
# the same sums in another order (matmuls over G/2 instead of G rows, the gradient all-reduce adding
# two ranks' partial sums) differ by float32 rounding, 2^-24 ~ 6e-8 per operation, which over sums of
# 10^2..10^3 terms gives relative differences of order 1e-6. The tolerances sit above that:
GRAD_TOL = 1e-5  # first update's gradient, same weights: ||g2 - g1|| / ||g1||
LOSS_TOL = 1e-5  # logged loss of every compared update: |l2 - l1| / |l1|
# parameters after several AdamW updates, relative to the update ||p2 - p1|| / ||p1 - p0||: AdamW divides
# by sqrt(v) + eps, so a gradient difference d moves an element by at most ~ lr * d / (|g| + eps); it is
# amplified only where |g| is near eps = 1e-8 (the record keeps the largest |g2 - g1|, of the order of
# float32 rounding of the largest gradient element). One order of magnitude more room than the loss:
PARAM_TOL = 1e-4

# Decision rule (per candidate):
#   reject  if a loss, the gradient norm of an applied update (a step the fp16 scaler skipped has an
#           inf norm by design) or a holdout loss is not finite, or (2 processes) its loss curve, first
#           gradient or parameters differ from the 1-process run beyond the tolerances above;
#   tune    if the holdout loss did not fall (after >= before): the baseline does not learn;
#   accept  otherwise. Tokens per second is reported, never decided on: on a shared CPU it is noise.


def config_for(w, device, smoke: bool = False) -> LoopConfig:
    """The loop's settings: G = 2 x the workload's batch, so the 2-process candidate has b = batch rows
    per process and the 1-process one 2b; CPU runs save tensors for the comparison."""
    cuda = torch.device(device).type == "cuda"
    base = dict(workload=dataclasses.asdict(w), global_batch=2 * w.batch, device="cuda" if cuda else "cpu",
                mixed_precision=MIXED_PRECISION["cuda" if cuda else "cpu"], save_tensors=not cuda,
                progress=sys.stderr.isatty())
    if smoke:
        return LoopConfig(**base, updates=6, warmup=1, decay=2, naive_updates=3)
    if cuda:
        return LoopConfig(**base, updates=60, warmup=5, decay=20, lr=1e-4, holdout_batches=2, naive_updates=0)
    return LoopConfig(**base, updates=40, decay=14, naive_updates=12)


def launch_command(processes: int, cfg: LoopConfig, config_path, out_dir) -> list[str]:
    """``accelerate launch`` of the loop with ``processes`` processes. One process: Accelerate's simple
    launcher. More: ``--multi_gpu``, Accelerate's torchrun-based multi-process launcher, which on a
    machine without GPUs starts CPU processes (the loop's ``Accelerator(cpu=True)`` makes them
    MULTI_CPU over gloo); ``--main_process_port 0`` picks a free port. (``--cpu`` with more than one
    process would need MPI and a hostfile.)"""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", cfg.mixed_precision, "--dynamo_backend", "no"]
    if processes > 1:
        cmd += ["--multi_gpu", "--main_process_port", "0"]
    return cmd + ["-m", "bp_mech.projects.baseline_loop", "--config", str(config_path), "--out", str(out_dir)]


class LaunchError(RuntimeError):
    pass


def launch(cfg: LoopConfig, processes: int, workdir: Path) -> dict:
    """Run the loop under ``accelerate launch``; rank 0's result (and tensors, if saved). The launch's
    output goes to the terminal when there is one, else into ``workdir/launch.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    src = str(Path(baseline_loop.__file__).resolve().parents[2])  # the directory that holds bp_mech
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    cmd = launch_command(processes, cfg, workdir / "config.json", workdir / "out")
    log = None if sys.stderr.isatty() else open(workdir / "launch.log", "w")
    try:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                              timeout=LAUNCH_TIMEOUT_S).returncode
    finally:
        if log:
            log.close()
    if code != 0:
        tail = (workdir / "launch.log").read_text()[-3000:] if log else "(see the output above)"
        raise LaunchError(f"accelerate launch with {processes} process(es) exited with {code}: {' '.join(cmd)}\n{tail}")
    result = json.loads((workdir / "out" / "result.json").read_text())
    tensors = workdir / "out" / "tensors.pt"
    result["tensors"] = torch.load(tensors, weights_only=True) if tensors.exists() else None
    result["command"] = " ".join(["accelerate launch"] + cmd[3:])
    return result


def compare(ref: dict, got: dict) -> dict:
    """A multi-process run against the 1-process run: token-weighted and naive differences."""
    r, g, n = ref["tensors"], got["tensors"], got["naive"]
    l1, l2 = ref["run"]["loss"], got["run"]["loss"]
    early = len(n["loss"]) if n else 0
    rel = lambda a, b: abs(a - b) / abs(b) if math.isfinite(a - b) else math.inf  # noqa: E731
    out = dict(loss_rel_diff=max(rel(a, b) for a, b in zip(l2, l1)), grad_rel_diff=relative_l2(g["grad"], r["grad"]),
               grad_max_abs_diff=max((a - b).abs().max().item() for a, b in zip(g["grad"], r["grad"])),
               param_rel_diff=relative_l2(g["params"], r["params"], r["init"]), compared_updates=len(l1))
    if n:
        out.update(early_updates=early, param_rel_diff_early=relative_l2(g["params_early"], r["params_early"], r["init"]),
                   naive=dict(loss_rel_diff=max(rel(a, b) for a, b in zip(n["loss"], l1[:early])),
                              grad_rel_diff=relative_l2(g["naive_grad"], r["grad"]),
                              param_rel_diff_early=relative_l2(g["naive_params_early"], r["params_early"], r["init"])))
    return out


def beyond(grad_rel_diff: float, loss_rel_diff: float, param_rel_diff: float) -> list[str]:
    """The differences of a multi-process run from the 1-process run beyond their tolerances, in words.

    Args:
        grad_rel_diff: the first update's gradient, ||g2 - g1|| / ||g1||.
        loss_rel_diff: the largest |l2 - l1| / |l1| over the compared updates.
        param_rel_diff: the largest parameter difference relative to the update, ||p2 - p1|| / ||p1 - p0||.

    Returns:
        One phrase per difference beyond GRAD_TOL, LOSS_TOL or PARAM_TOL (NaN is beyond); empty: equal.

    Example:
        >>> beyond(1e-3, 0.0, 0.0)
        ['first gradient 0.001 > GRAD_TOL 1e-05']
    """
    return [f"{what} {v:.2g} > {name} {tol:g}" for what, v, name, tol in (
        ("first gradient", grad_rel_diff, "GRAD_TOL", GRAD_TOL), ("loss", loss_rel_diff, "LOSS_TOL", LOSS_TOL),
        ("parameters", param_rel_diff, "PARAM_TOL", PARAM_TOL)) if not v <= tol]


def equal(eq: dict | None, naive: bool = False) -> bool | None:
    """Within GRAD_TOL, LOSS_TOL and PARAM_TOL (``beyond``; None: nothing compared)."""
    if eq is None:
        return None
    d = eq["naive"] if naive else eq
    params = [d["param_rel_diff_early"]] + ([] if naive else [d["param_rel_diff"]])
    return not beyond(d["grad_rel_diff"], d["loss_rel_diff"], max(params))


def decide(finite: bool, holdout_before: float, holdout_after: float, processes: int = 1,
           differences: tuple[float, float, float] | None = None) -> Decision:
    """A candidate's decision, by the rule above.

    Args:
        finite: every loss, applied update's gradient norm and holdout loss finite.
        holdout_before: the holdout loss before training.
        holdout_after: the holdout loss after it.
        processes: the candidate's processes.
        differences: (gradient, loss, parameters) relative differences from the 1-process run (``beyond``'s
            arguments); None: not compared.

    Returns:
        The ``Decision``; its reason names the numbers that fired the rule.

    Example:
        >>> decide(True, 5.0, 3.0, 2, (1e-3, 0.0, 0.0)).reason
        '2 processes do not reproduce 1 process: first gradient 0.001 > GRAD_TOL 1e-05'
    """
    if not finite:
        return Decision("reject", "a loss or an applied update's gradient norm is not finite",
                        "lower the learning rate or check the data")
    if processes > 1 and differences is not None and (why := beyond(*differences)):
        return Decision("reject", f"{processes} processes do not reproduce 1 process: " + "; ".join(why),
                        "check the loss divisor and the sharding")
    if not holdout_after < holdout_before:
        return Decision("tune", f"the holdout loss did not fall ({holdout_before:.4f} -> {holdout_after:.4f})",
                        "raise the learning rate or the number of updates")
    return Decision("accept", f"finite, the holdout loss fell ({holdout_before:.4f} -> {holdout_after:.4f})"
                    + (", and the processes reproduce 1 process within the tolerances" if differences else ""),
                    "the reference: compare every optimisation's tokens/s and holdout loss with it")


def run(ctx) -> list:
    device = ctx.device
    cfg = config_for(ctx.workload, device, ctx.smoke)
    fit = torch.cuda.device_count() if device == "cuda" else max(PROCESSES.values())
    names = [c for c in CANDIDATES if PROCESSES[c] <= fit]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bp-mech-73-") as tmp:
        for name in ctx.progress(names, desc="candidates"):
            results[name] = launch(cfg, PROCESSES[name], Path(tmp) / name)
    return [candidate_record(ctx, name, cfg, results[name], results.get(PLAIN.name)) for name in names]


def tokens_per_second(res: dict, cfg: LoopConfig) -> float:
    """Target tokens of the timed updates (all processes) / the sum of their times (the slowest rank's)."""
    timed = slice(cfg.warmup_excluded, None)
    return sum(res["run"]["target_tokens"][timed]) / sum(res["seconds"][timed])


def step_timing(res: dict, cfg: LoopConfig, device):
    """The timed updates of a launch by the deciding clock (``bench.timing.clock_for``: each rank's thread CPU
    time on the CPU, the slowest rank's), wall time beside."""
    clock = clock_for(device)
    return summarize(res["cpu_seconds"] if clock == "thread_time" else res["seconds"], cfg.warmup_excluded, clock,
                     res["seconds"])


def candidate_record(ctx, name: str, cfg: LoopConfig, res: dict, ref: dict | None):
    if res.get("failure"):
        return ctx.record(name, strategy=PLAIN.name, failure=res["failure"], metrics=dict(processes=PROCESSES[name]))
    P, run_, T = res["processes"], res["run"], ctx.workload.seq
    timing, tokens_per_s = step_timing(res, cfg, ctx.device), tokens_per_second(res, cfg)
    timing.threads = res["threads"]
    applied_norms = [g for g, a in zip(run_["grad_norm"], run_["applied"]) if a]  # a skipped fp16 step's is inf
    finite = all(math.isfinite(x) for x in run_["loss"] + applied_norms + [res["holdout_before"], res["holdout_after"]])
    eq = compare(ref, res) if P > 1 and ref and not ref.get("failure") and res["tensors"] and ref["tensors"] else None
    differences = (eq["grad_rel_diff"], eq["loss_rel_diff"],
                   max(eq.get("param_rel_diff_early", 0.0), eq["param_rel_diff"])) if eq else None
    decided = decide(finite, res["holdout_before"], res["holdout_after"], P, differences)
    base = None if P == 1 or not ref or ref.get("failure") else step_timing(ref, cfg, ctx.device)
    naive = res["naive"]
    by_run = dict(training=run_["updates"], naive=naive and naive["updates"])  # naive: the per-rank-mean mistake
    return ctx.record(
        name, strategy=PLAIN.name, input_shape=[cfg.global_batch // P, T],
        effective_batch=cfg.accumulation * cfg.global_batch, updates=sum(v for v in by_run.values() if v),
        skipped_updates=run_["skipped"] + (naive["skipped"] if naive else 0), all_finite=finite,
        output_error=eq and eq["loss_rel_diff"], grad_error=eq and eq["grad_rel_diff"],
        peak_allocated=max(res["peak_by_rank"]), **timing.record_fields(),
        timing_noise=base and timing_noise(timing, base, more_work=False), memory_source=ctx.memory_source,
        **decided.record_fields(),
        metrics=dict(
            processes=P, distributed_type=res["distributed_type"], backend=res["backend"],
            mixed_precision=res["mixed_precision"], launch_command=res["command"],
            per_process_rows=cfg.global_batch // P,
            global_micro_batch=cfg.global_batch, accumulation=cfg.accumulation, seq=T,
            tokens_per_s=tokens_per_s,
            input_tokens_per_s=cfg.accumulation * cfg.global_batch * T / timing.wall_median_s,
            tokens_per_s_definition="target tokens (labels[:, 1:] != -100) of the timed updates on all processes / "
                                    "the sum of those updates' wall times, each the slowest rank's",
            timed_updates=len(timing.samples), step_samples_s=timing.samples, wall_samples_s=timing.wall_samples,
            seconds_by_rank=res["seconds_by_rank"],
            peak_by_rank=res["peak_by_rank"], holdout_before=res["holdout_before"], holdout_after=res["holdout_after"],
            curve=json_safe({k: run_[k] for k in ("loss", "target_tokens", "lr", "grad_norm", "clip_coef", "applied")}),
            naive_loss=naive and json_safe(naive["loss"]), updates_by_run=by_run, equivalence=eq,
            equal=equal(eq), naive_equal=equal(eq, naive=True) if eq and "naive" in eq else None,
            speedup=base and tokens_per_s / tokens_per_second(ref, cfg),
            lr=cfg.lr, wsd=dataclasses.asdict(cfg.wsd()), max_norm=cfg.max_norm,
            rule=dict(GRAD_TOL=GRAD_TOL, LOSS_TOL=LOSS_TOL, PARAM_TOL=PARAM_TOL)))


def dry_run(ctx) -> dict:
    """Candidates, launch commands and, per mode, an estimate (``modes.real_gpu``: one GPU)."""
    w = ctx.workload

    def fields(dev):
        cfg = config_for(w, dev, ctx.smoke)
        names = list(CANDIDATES) if dev == "cpu" else [PLAIN.name]  # 2 processes need 2 GPUs
        seconds = sum(LAUNCH_S[dev] + ASSUMED_BUILD_S[dev] + dry_run_seconds(
            w.arch, cfg.global_batch // PROCESSES[n] * w.seq, cfg.accumulation * (cfg.updates + cfg.naive_updates * (
                PROCESSES[n] > 1)) + 2 * cfg.holdout_batches, dev, low=cfg.mixed_precision != "no") for n in names)
        return dict(candidates=names, updates=cfg.updates, accumulation=cfg.accumulation,
                    global_micro_batch=cfg.global_batch, mixed_precision=cfg.mixed_precision,
                    naive_updates=cfg.naive_updates, warmup_excluded=cfg.warmup_excluded,
                    commands=[" ".join(["accelerate launch"] + launch_command(PROCESSES[n], cfg, "CONFIG", "OUT")[3:])
                              for n in names], estimated_seconds=round(seconds, 1))

    from bp_mech.experiments.dry_run import per_mode

    return dict(modes=per_mode(fields), optimizer="AdamW", schedule="WSD on the update clock (Part 02 · 12)",
                rule=dict(GRAD_TOL=GRAD_TOL, LOSS_TOL=LOSS_TOL, PARAM_TOL=PARAM_TOL),
                estimate_basis=ASSUMED_BASIS + "; + LAUNCH_S per launch (launcher, imports)")
