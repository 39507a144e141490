"""Part 02 · 76 — TRAIN-MEMORY-STRATEGY: single and combined memory strategies, one decision.

Every strategy of ``CANDIDATES`` (``bp_mech.bench.strategy``: checkpointing, offload, fp16 autocast,
accumulation, the chunked loss, and combinations) on one workload: full training steps on one model
(``measure``: interleaved timing, a peak step each, a probe each against plain), one record each with
quality (loss and gradient errors within the strategy's ``tolerance``), capacity (peak) and time
(median, P95). The decision is ``bp_mech.projects.pareto``'s: the Pareto set on the memory–time plane
and the pick for a memory budget (``budget_for``), made over the candidates that pass the quality check.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from bp_mech.bench import strategy
from bp_mech.bench.counters import ForwardCounter
from bp_mech.experiments import harness, strategies
from bp_mech.bench.timing import CPU_TIMING_THREADS, SMOKE_SCHEDULE, time_interleaved, timing_noise
from bp_mech.bench.oom import oom_as_failure, release_memory
from bp_mech.planner import plan as plan_tool
from bp_mech.ledger import LedgerConfig
from bp_mech.planner.plan import ALLOCATOR_SLACK, CONTEXT_BYTES
from bp_mech.projects.pareto import Measured, budget_decision, needed_bytes
from bp_mech.records.results import json_safe
from bp_mech.bench.strategy import Strategy
from bp_mech.bench.tracking import PeakMemory
from bp_mech.update_dynamics import global_grad_norm
from bp_mech.bench.workload import PLAN_BASIS, PLAN_BUILD_S, build_model, make_adamw, make_batches, plan_seconds, qwen2_config

# --- the candidates, the rules -----------------------------------------------------------------------

# The singles that chapters 19, 42, AMP and 11 measured, the chunked loss, and the combinations that
# remove different lines of the ledger together (names: ``bp_mech.bench.strategy.parse``).
CANDIDATES = ("plain", "checkpoint-all", "offload", "fp16", "micro2", "chunked-loss",
              "checkpoint-all+offload", "checkpoint-all+chunked-loss", "fp16+chunked-loss",
              "checkpoint-all+fp16+chunked-loss", "checkpoint-all+offload+chunked-loss",
              "checkpoint-all+offload+fp16+chunked-loss")
SMOKE_CANDIDATES = ("plain", "micro2", "checkpoint-all+offload+fp16+chunked-loss")  # --smoke: every code path once
CPU_SCHEDULE = (40, 3)  # (timed, warm-up) rounds on the CPU: twelve candidates; P95 = the 38th of 40 steps

# Quality: the (loss, gradient) relative errors against the plain probe a strategy may show, by what it
# changes in the arithmetic (``tolerance``).
EXACT_TOL = harness.EQUAL_TOL  # checkpointing, offload: the same operations (bitwise on the CPU)
REORDER_TOL = (1e-5, 1e-4)  # accumulation, chunked loss: float32 sums in another order (~1e-6 seen)
LOW_TOL = (1e-2, 5e-2)  # fp16 autocast: matmuls rounded to 11-bit mantissas (unit roundoff 4.9e-4), L layers deep

# The budget: on CUDA the question, "fit qwen05-b2s512 in 8 GiB at the least time"; on the CPU
# (tracked bytes of the tiny model) a fraction of the plain peak. The headroom is ``bp-mech plan``'s: a
# candidate fits when peak x (1 + ALLOCATOR_SLACK) + the CUDA context (``headroom``) <= budget.
GPU_BUDGET = 8 * 2**30
CPU_BUDGET_FRACTION = 0.80

# Planning only (``--mode dry_run``): a part's step time in plain steps; a combination's parts multiply.
TIME_FACTOR = {"checkpoint-all": 1.35, "offload": 1.5, "fp16": 1.0, "micro2": 1.1, "chunked-loss": 1.05}
PLAN_TRACE_S = {"tiny": 0.5, "qwen05": 2.0}  # planning: ``bp-mech plan``'s fake-tensor step per candidate, host
# The seed's figures for the singles it measured (``bp_mech.records.references``): the course's reference, never ours.
SEED_REFERENCE = {"checkpoint-all": "TRAIN-CHECKPOINT", "offload": "TRAIN-OFFLOAD", "fp16": "TRAIN-AMP-BACKWARD"}


def tolerance(s: Strategy, device) -> tuple[float, float]:
    """(loss, gradient) relative tolerance of strategy ``s`` against the plain step on ``device``."""
    if s.amp is not None:
        return LOW_TOL
    return REORDER_TOL if s.micro_batches > 1 or s.chunked_loss is not None else EXACT_TOL[torch.device(device).type]


def headroom(device) -> tuple[float, int]:
    """(allocator slack, context bytes): ``bp_mech.planner.plan``'s; tracked CPU storages have no CUDA context."""
    return ALLOCATOR_SLACK, CONTEXT_BYTES if torch.device(device).type == "cuda" else 0


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
    return harness.schedule(device) if torch.device(device).type == "cuda" else CPU_SCHEDULE


# --- the measured run ------------------------------------------------------------------------------


class _NoUpdate:
    """The probe's optimizer: zero_grad, and a step that changes nothing (its ``param_groups`` let a
    GradScaler unscale the gradients), so every probe starts from the same weights."""

    def __init__(self, opt):
        self.param_groups = opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (p for group in self.param_groups for p in group["params"]):
            p.grad = None

    def step(self) -> None:
        return None


def measure(model, batches, device, names=None, progress=None, smoke: bool = False) -> dict:
    """Full training steps (``strategy.train_step``) of every strategy in ``names`` (default ``CANDIDATES``,
    plain first) on one model and one AdamW: time and peak do not depend on the weights.

    1. one plain update allocates AdamW's moments; 2. warm-up rounds, then timed rounds, one step of each
    candidate in turn (``measure.time_interleaved``, one CPU thread); 3. the peak of one more step each
    (``tracking.PeakMemory``); 4. a probe each: the step without the update (``_NoUpdate``; fp16 through a
    fresh GradScaler at the candidate's scale), every one from the same weights, compared with the plain
    probe at once (``harness.compare``). Returns ``{name: (measurement, None)}``, or ``(None, failure)``
    for a candidate that could not allocate (the others go on).
    """
    names, (rounds, warmup) = names or CANDIDATES, schedule(device, smoke)
    parsed = {n: strategy.parse(n) for n in names}
    opt = make_adamw(model.parameters(), harness.LR, device)
    strategy.train_step(model, opt, batches[0], strategy.PLAIN)  # AdamW's moments exist from here on
    ctxs = {n: strategy.Applied(model, s, device) for n, s in parsed.items()}  # offload pools, scalers: reused
    setup = {n: (lambda s=s: strategy.applied(model, s, device)) for n, s in parsed.items()}
    failures, applied = {}, {n: [] for n in names}

    def one_step(name, i):
        scaler = ctxs[name].scaler
        scale = scaler.get_scale() if scaler.is_enabled() else None
        _, failure = oom_as_failure(strategy.train_step, model, opt, batches[i % len(batches)], parsed[name],
                                    ctx=ctxs[name])
        if failure:
            failures[name] = failure
        else:  # a step the GradScaler skipped (inf/NaN) lowered its scale
            applied[name].append(scale is None or scaler.get_scale() >= scale)

    timings = time_interleaved({n: (lambda i, n=n: n in failures or one_step(n, i)) for n in names}, rounds, warmup,
                               device, around=setup, progress=progress)
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    peaks, out, base = {}, {}, None
    for name in [n for n in names if n not in failures]:
        with setup[name](), PeakMemory(device, resident=[model.parameters(), state]) as peaks[name]:
            one_step(name, 1)
    for name in [n for n in names if n not in failures]:
        c = ctxs[name]
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=c.scaler.get_scale(),
                                      enabled=c.scaler.is_enabled())
        with setup[name](), ForwardCounter(model) as fc:
            loss, failure = oom_as_failure(strategy.train_step, model, _NoUpdate(opt), batches[0], parsed[name],
                                           scaler, ctx=c)
        if failure:
            failures[name] = failure
            continue
        grads = [p.grad for p in model.parameters()]
        norm = global_grad_norm(grads, dtype=torch.float64).item()
        probe = dict(loss=loss.item(), grads=grads, grad_norm=norm)
        if name == "plain":
            base = dict(probe, grads=[None if g is None else g.detach().clone() for g in grads])
        k = parsed[name].micro_batches  # every sublayer runs once per micro-batch; more is a recompute
        finite = math.isfinite(probe["loss"]) and math.isfinite(norm)
        out[name] = dict(loss=probe["loss"], grad_norm=norm, finite=finite,
                         calls=fc.calls, recomputes=sum(n - k for part in ("attn", "mlp") for n in fc.calls[part] if n),
                         d2h=c.d2h_bytes, h2d=c.h2d_bytes, chunked=int(parsed[name].chunked_loss is not None),
                         timing=timings[name], pm=peaks[name], applied=applied[name],
                         cmp=None if base is None or name == "plain" else harness.compare(base, probe))
        model.zero_grad(set_to_none=True)
    del opt, state, base
    release_memory(device)
    return {n: (None, failures[n]) if n in failures else (out[n], None) for n in names}


def estimate(ctx) -> dict:
    """``bp-mech plan``'s estimate of every candidate at ``ctx.workload``: one steady-state step under fake
    tensors at full size, with the AdamW and offload threshold of ``ctx.device`` (the plan's own budget
    check is not used: ``make_records`` applies this project's budget). ``{name: {peak, peak_stage}}``."""
    w = ctx.workload
    p = plan_tool.plan(qwen2_config(w.arch), w.batch, w.seq, 2**62, candidates=[strategy.parse(n) for n in candidates(ctx)],
                       options=LedgerConfig().for_device(ctx.device))
    return {r["strategy"]: dict(peak=r["peak"], peak_stage=r["peak_stage"], elapsed_s=p["elapsed_s"])
            for r in p["rows"]}


def make_records(ctx, results: dict, budget: float | None = None, estimated: dict | None = None) -> list:
    """One record per candidate: quality (loss and gradient errors against plain, ``tolerance``), capacity
    (peak), time (median, P95), the decision against plain (``strategies.decide``) and, in ``metrics``, the
    budget's (``budget_decision``; ``budget`` defaults to ``budget_for``) and the plan's estimate beside the
    measured peak (``estimate``)."""
    base = results["plain"][0]
    cands = {}
    for name, (r, _) in results.items():
        if r is not None:
            tol = tolerance(strategy.parse(name), ctx.device)
            r["equal"] = r["finite"] and (name == "plain" or r["cmp"] is not None and r["cmp"]["loss_error"] <= tol[0]
                                          and r["cmp"]["grad_error"] <= tol[1])
            r["tolerances"] = dict(loss=tol[0], grad=tol[1])
            cands[name] = Measured(r["pm"].peak_allocated, r["timing"].median_s, r["timing"].p95_s,
                                   (r["recomputes"], r["d2h"], r["chunked"]), r["equal"])
    budget = budget if budget is not None else budget_for(ctx.device, base and base["pm"].peak_allocated)
    decision = budget_decision(cands, budget, *headroom(ctx.device))
    recs = []
    for name, (r, failure) in results.items():
        s = strategy.parse(name)
        fields = dataclasses.asdict(s)
        if failure is not None:
            recs.append(ctx.record(name, failure=failure, memory_source=ctx.memory_source,
                                   metrics=dict(strategy=fields), next_step="does not fit: see the failure"))
            continue
        t, cmp, pm = r["timing"], r["cmp"], r["pm"]
        metrics = dict(strategy=fields, loss=r["loss"], grad_norm=r["grad_norm"], forward_calls=r["calls"],
                       tolerances=r["tolerances"], equal=r["equal"], step_samples_s=t.samples,
                       applied_per_step=r["applied"], chunked_loss_recomputes=r["chunked"],
                       pareto_optimal=name in decision["pareto"], fits_budget=name in decision["fitting"],
                       budget=decision)
        if name in (estimated or {}):
            e = estimated[name]
            metrics["plan"] = dict(e, evidence_level="estimated", memory_source="fake-tensor",
                                   error=pm.peak_allocated / e["peak"] - 1,
                                   fits=budget is not None and needed_bytes(e["peak"], *headroom(ctx.device)) <= budget)
        verdict, noise = (None, None), None
        if name != "plain" and base is not None and cmp is not None:
            noise = timing_noise(t, base["timing"], cands[name].more_work(cands["plain"]))
            metrics.update(bitwise_equal=cmp["bitwise"], grad_norm_error=cmp["grad_norm_error"],
                           peak_saving=1 - pm.peak_allocated / base["pm"].peak_allocated,
                           time_ratio=t.median_s / base["timing"].median_s,
                           p95_ratio=t.p95_s / base["timing"].p95_s, more_work=cands[name].more_work(cands["plain"]))
            verdict = strategies.decide(r["equal"], metrics["peak_saving"], metrics["time_ratio"], noise)
        recs.append(ctx.record(
            name, output_error=json_safe(cmp and cmp["loss_error"]), grad_error=json_safe(cmp and cmp["grad_error"]),
            all_finite=r["finite"], peak_allocated=pm.peak_allocated, peak_reserved=pm.peak_reserved,
            step_median_s=t.median_s, step_p95_s=t.p95_s, warmup_excluded=t.warmup_excluded, threads=t.threads,
            timing_noise=noise, updates=sum(r["applied"]), skipped_updates=len(r["applied"]) - sum(r["applied"]),
            recompute_count=r["recomputes"], memory_source=pm.memory_source,
            transfer_bytes=dict(d2h=r["d2h"], h2d=r["h2d"]) if s.offload else None,
            decision=verdict[0], next_step=verdict[1], metrics=json_safe(metrics)))
    return recs


def plan(ctx) -> dict:
    """``--mode dry_run``: per mode the schedule, the budget and the time estimate (``workload.plan_seconds``:
    per candidate its warm-up, timed, peak and probe steps at its ``TIME_FACTOR``); the rules."""
    w = ctx.workload
    factors = [math.prod(TIME_FACTOR.get(part, 1.0) for part in name.split("+")) for name in candidates(ctx)]

    def fields(dev):
        rounds, warmup = schedule(dev, ctx.smoke)
        seconds = PLAN_BUILD_S[dev] + len(factors) * PLAN_TRACE_S.get(w.arch, 2.0) + sum(
            plan_seconds(w.arch, w.batch * w.seq, f * (rounds + warmup + 2), dev) for f in [1.0, *factors])
        return dict(timed_rounds=rounds, warmup_rounds=warmup, interleaved=True, estimated_seconds=round(seconds, 1),
                    threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                    budget_bytes=budget_for(dev, None) or f"{CPU_BUDGET_FRACTION} x the plain peak")

    return dict(step="bp-mech plan's estimate of every candidate (fake tensors); full training steps "
                     "(bp_mech.bench.strategy.train_step) on one model and AdamW, interleaved; 1 step each for the peak; "
                     "1 probe each (no update) against plain",
                modes=harness.plan_per_mode(fields), time_factor=TIME_FACTOR,
                estimate_basis=f"{PLAN_BASIS}; steps x TIME_FACTOR; + PLAN_TRACE_S {PLAN_TRACE_S} per candidate",
                rule=dict(pick="least median step among the candidates equal to plain within their tolerance that "
                               "fit: peak x (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES (CUDA only) <= budget; none if its "
                               "time against the runner-up is noise",
                          ALLOCATOR_SLACK=ALLOCATOR_SLACK, CONTEXT_BYTES=CONTEXT_BYTES,
                          per_candidate=dict(MIN_PEAK_SAVING=strategies.MIN_PEAK_SAVING,
                                             MAX_TIME_RATIO=strategies.MAX_TIME_RATIO)),
                tolerances=dict(exact=EXACT_TOL, reorder=REORDER_TOL, low=LOW_TOL))


def run(ctx, budget: float | None = None) -> list:
    """The plan's estimate (first: it needs no device), then every candidate measured on ``ctx.workload``;
    ``budget`` (bytes) overrides ``budget_for``."""
    estimated = estimate(ctx)
    model = build_model(ctx.workload, ctx.device)
    batches = make_batches(ctx.workload, 4, device=ctx.device)
    results = measure(model, batches, ctx.device, names=candidates(ctx), progress=ctx.progress, smoke=ctx.smoke)
    return make_records(ctx, results, budget, estimated)
