"""Part 02 · 76 — TRAIN-MEMORY-STRATEGY: single and combined memory strategies, one decision.

Every strategy of ``CANDIDATES`` (``bp_mech.bench.strategy``: checkpointing, offload, fp16 autocast,
accumulation, the chunked loss, and combinations) on one workload: full training steps on one model
(``harness.same_weights``: a tracked step each for the peak, interleaved timing, a probe each against
plain), one record each with quality (loss and gradient errors within the strategy's
``bench.compare.tolerance``), capacity (peak) and time (median, P95). The decision is
``bp_mech.projects.pareto``'s: the Pareto set on the memory–time plane and the pick for a memory budget
(``budget_for``), made over the candidates that pass the quality check.
"""

from __future__ import annotations

import math

import torch

from bp_mech.bench.compare import EXACT_TOL, LOW_TOL, REORDER_TOL
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.bench.timing import CPU_TIMING_THREADS, SMOKE_SCHEDULE
from bp_mech.instruments.workload import build_model, make_batches, qwen2_config
from bp_mech.experiments import decision, harness
from bp_mech.experiments.dry_run import per_mode
from bp_mech.experiments.dry_run import schedule as harness_schedule
from bp_mech.planner.plan import ALLOCATOR_SLACK, CONTEXT_BYTES, headroom, needs, plan
from bp_mech.projects.pareto import Candidate, budget_decision

# --- the candidates, the rules -----------------------------------------------------------------------

# The singles that chapters 19, 42, AMP and 11 measured, the chunked loss, and the combinations that
# remove different lines of the ledger together (names: ``bp_mech.bench.strategy.parse``).
CANDIDATES = ("plain", "checkpoint-all", "offload", "fp16", "micro2", "chunked-loss",
              "checkpoint-all+offload", "checkpoint-all+chunked-loss", "fp16+chunked-loss",
              "checkpoint-all+fp16+chunked-loss", "checkpoint-all+offload+chunked-loss",
              "checkpoint-all+offload+fp16+chunked-loss")
SMOKE_CANDIDATES = ("plain", "micro2", "checkpoint-all+offload+fp16+chunked-loss")  # --smoke: every code path once
CPU_SCHEDULE = (40, 3)  # (timed, warm-up) rounds on the CPU: twelve candidates; P95 = the 38th of 40 steps

# The budget: on CUDA the question "fit qwen05-b2s512 in 8 GiB at the least time"; on the CPU (tracked
# bytes of the tiny model) a fraction of the plain peak. The headroom is ``bp-mech plan``'s: a candidate
# fits when ``planner.plan.needs(peak)`` (allocator slack, and the CUDA context on CUDA) <= budget.
GPU_BUDGET = 8 * 2**30
CPU_BUDGET_FRACTION = 0.80

# Dry run only: a part's step time in plain steps; a combination's parts multiply.
TIME_FACTOR = {"checkpoint-all": 1.35, "offload": 1.5, "fp16": 1.0, "micro2": 1.1, "chunked-loss": 1.05}
TRACE_S = {"tiny": 0.5, "qwen05": 2.0}  # dry run: ``bp-mech plan``'s fake-tensor step per candidate, host


def budget_for(device, plain_peak: int | None) -> int | None:
    """``GPU_BUDGET`` on CUDA; ``CPU_BUDGET_FRACTION`` x the plain peak on the CPU (None without one)."""
    if torch.device(device).type == "cuda":
        return GPU_BUDGET
    return None if plain_peak is None else int(CPU_BUDGET_FRACTION * plain_peak)


def candidates(ctx) -> tuple[str, ...]:
    """The candidates a run measures: ``SMOKE_CANDIDATES`` in a smoke run, else ``CANDIDATES``."""
    return SMOKE_CANDIDATES if ctx.smoke else CANDIDATES


def schedule(device, smoke: bool = False) -> tuple[int, int]:
    """(timed, warm-up) rounds: the harness's on CUDA, ``CPU_SCHEDULE`` on the CPU, ``SMOKE_SCHEDULE`` in a
    smoke run."""
    if smoke:
        return SMOKE_SCHEDULE
    return harness_schedule(device) if torch.device(device).type == "cuda" else CPU_SCHEDULE


# --- the measured run ------------------------------------------------------------------------------


def measure(model, batches, device, names=None, progress=None, smoke: bool = False) -> dict:
    """Full training steps of every strategy in ``names`` (default ``CANDIDATES``, plain first) on one
    model and one AdamW (``harness.same_weights``): time and peak do not depend on the weights.
    ``{name: Measured | Failed}``."""
    names = names or CANDIDATES
    return harness.same_weights(model, batches, device, {n: parse(n) for n in names}, *schedule(device, smoke),
                                progress=progress)


def estimate(ctx) -> dict:
    """``bp-mech plan``'s estimate of every candidate at ``ctx.workload``.

    One steady-state step under fake tensors at full size, with the AdamW and offload
    threshold of ``ctx.device`` (the plan's own budget check is not used:
    ``budget_records`` applies this project's budget). ``{name: {peak, peak_stage,
    elapsed_s}}`` (elapsed_s: the time of the whole plan)."""
    w = ctx.workload
    p = plan(qwen2_config(w.arch), w.batch, w.seq, 2**62,
             candidates=[parse(n) for n in candidates(ctx)],
             options=StepOptions().for_device(ctx.device))
    return {r.strategy: dict(peak=r.peak, peak_stage=r.peak_stage,
                             elapsed_s=p.elapsed_s) for r in p.rows}


def candidate(m: harness.Measured) -> Candidate:
    """A measured arm as the budget decision sees it."""
    return Candidate(m.peak.allocated, m.timing.median_s, m.timing.p95_s, decision.work(m), bool(m.equal))


def budget_records(ctx, results: dict, budget: float | None = None, estimated: dict | None = None) -> list:
    """One record per candidate (``decision.strategy_records``: quality, capacity, time, the decision against
    plain) and, in ``metrics``, the budget's decision (``pareto.budget_decision``; ``budget`` defaults to
    ``budget_for``) and the plan's estimate beside the measured peak (``estimate``)."""
    measured = {n: m for n, m in results.items() if isinstance(m, harness.Measured)}
    base = measured.get(PLAIN.name)
    budget = budget if budget is not None else budget_for(ctx.device, base and base.peak.allocated)
    d = budget_decision({n: candidate(m) for n, m in measured.items()}, budget, *headroom(ctx.device))

    def extra(name, m):
        metrics = dict(applied_per_step=m.applied, chunked_loss_recomputes=decision.work(m)[2],
                       pareto_optimal=name in d.pareto, fits_budget=name in d.fitting, budget=d.to_dict())
        if name in (estimated or {}):
            e = estimated[name]
            metrics["plan"] = dict(e, evidence_level="estimated", memory_source="fake-tensor",
                                   error=m.peak.allocated / e["peak"] - 1,
                                   fits=budget is not None and needs(e["peak"], ctx.device) <= budget)
        return {}, metrics

    return decision.strategy_records(ctx, results, {n: parse(n) for n in results}, extra=extra)


def dry_run(ctx) -> dict:
    """Per mode the schedule, the budget and the time estimate (``bench.rates.dry_run_seconds``: per
    candidate its tracked, warm-up, timed and probe steps at its ``TIME_FACTOR``); the rules."""
    w = ctx.workload
    factors = [math.prod(TIME_FACTOR.get(part, 1.0) for part in name.split("+")) for name in candidates(ctx)]

    def fields(dev):
        rounds, warmup = schedule(dev, ctx.smoke)
        seconds = ASSUMED_BUILD_S[dev] + len(factors) * TRACE_S.get(w.arch, 2.0) + sum(
            dry_run_seconds(w.arch, w.batch * w.seq, f * (rounds + warmup + 2), dev) for f in [1.0, *factors])
        return dict(timed_rounds=rounds, warmup_rounds=warmup, interleaved=True, estimated_seconds=round(seconds, 1),
                    threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                    budget_bytes=budget_for(dev, None) or f"{CPU_BUDGET_FRACTION} x the plain peak")

    return dict(step="bp-mech plan's estimate of every candidate (fake tensors); full training steps "
                     "(bp_mech.bench.step.train_step) on one model and AdamW, interleaved; 1 step each for the peak; "
                     "1 probe each (no update) against plain",
                modes=per_mode(fields), time_factor=TIME_FACTOR,
                estimate_basis=f"{ASSUMED_BASIS}; steps x TIME_FACTOR; + TRACE_S {TRACE_S} per candidate",
                rule=dict(pick="least median step among the candidates equal to plain within their tolerance that "
                               "fit: peak x (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES (CUDA only) <= budget; none if its "
                               "time against the runner-up is noise",
                          ALLOCATOR_SLACK=ALLOCATOR_SLACK, CONTEXT_BYTES=CONTEXT_BYTES,
                          per_candidate=dict(MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING,
                                             MAX_TIME_RATIO=decision.MAX_TIME_RATIO)),
                tolerances=dict(exact=EXACT_TOL, reorder=REORDER_TOL, low=LOW_TOL))


def run(ctx, budget: float | None = None) -> list:
    """The plan's estimate (first: it needs no device), then every candidate measured on ``ctx.workload``;
    ``budget`` (bytes) overrides ``budget_for``."""
    estimated = estimate(ctx)
    model = build_model(ctx.workload, ctx.device)
    batches = make_batches(ctx.workload, 4, device=ctx.device)
    results = measure(model, batches, ctx.device, names=candidates(ctx), progress=ctx.progress, smoke=ctx.smoke)
    return budget_records(ctx, results, budget, estimated)
