"""``bp-mech plan``: which memory strategies fit a budget, for any Hugging Face causal LM, without a GPU.

Part 02 · 43's ledger as a tool. The model is built from its Transformers config under
``FakeTensorMode`` at full size (no memory is allocated); one steady-state training step (the one
``bench.step.train_step``, AdamW with its moments, as on the GPU: fused unless ``options`` name another
implementation, as ``bp-mech plan --optimizer-impl`` does; CUDA's offload threshold; the outputs dropped
before backward unless ``definition.keep_outputs``) is traced per strategy of ``bench.strategy.CANDIDATES``
with the storage tracker (``bench.lifecycle.Session``: one fake model for all). For each: the ledger per
lifecycle stage, the peak, whether it fits, and what it costs in time (``planner.costs``: counted, not
assumed; the measured ratio of a cached GPU record of the same strategy beside it).

Decision rule: a strategy fits when ``needs(peak) <= budget``, ``needs`` being the allocator's slack on
the peak plus the CUDA context (``headroom``); the recommended one is the fitting one with the least
counted extra time; ties go to the one that keeps float32, then to fewer mechanisms, then to the lower
peak. Accumulation adds no counted work (the same FLOPs in smaller kernels, whose cost on a GPU only a
measured ratio shows). Validation: tests/planner/test_plan.py (the fake peak equals the tracked-CPU peak
at tiny size for every candidate and supported family). The table and the command are
``bp_mech.planner.report``'s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from bp_mech.bench import lifecycle
from bp_mech.bench.definitions import STEADY, StepDefinition
from bp_mech.bench.rates import ASSUMED_FLOPS
from bp_mech.bench.step import StepOptions
from bp_mech.bench.strategy import CANDIDATES, PLAIN, Strategy, parse
from bp_mech.planner.costs import LINK_BYTES_S, CachedRatio, Cost, cached_ratios, cost, forward_flops
from bp_mech.planner.inputs import FAMILIES, PlanError, check_shape

# The CUDA context (the driver's code and data on the device) sits outside the caching allocator's
# counters. Library workspaces (cuBLAS, cuDNN) do not: they are allocated through the caching
# allocator, so they are in its counters but not in a traced peak; the slack covers them.
CONTEXT_BYTES = 512 * 2**20
# reserved over allocated (block rounding, fragmentation), and the library workspaces a
# traced peak does not hold
ALLOCATOR_SLACK = 0.10


def headroom(device) -> tuple[float, int]:
    """(allocator slack, context bytes) on ``device``: the slack everywhere (the plan's margin), the CUDA
    context on CUDA only."""
    return ALLOCATOR_SLACK, CONTEXT_BYTES if torch.device(device).type == "cuda" else 0


def needed_bytes(peak: float, slack: float, context: float) -> float:
    """What a step of allocated peak ``peak`` needs on the device.

    ``peak * (1 + slack) + context``: the caching allocator reserves more than the
    traced peak (block rounding, fragmentation, the libraries' workspaces, which it
    also allocates: ``slack`` of the peak), and the CUDA context sits outside its
    counters (``context`` bytes)."""
    if slack < 0 or context < 0:
        raise ValueError(
            f"slack and context are >= 0, got slack={slack} context={context}")
    return peak * (1 + slack) + context


def needs(peak: float, device="cuda") -> int:
    """The budget a step of allocated peak ``peak`` needs on ``device``: ``needed_bytes`` with
    ``headroom(device)``."""
    return int(needed_bytes(peak, *headroom(device)))


@dataclass(frozen=True)
class PlanRow:
    """One strategy of the plan."""

    strategy: str  # its name (bench.strategy)
    peak: int  # the traced step's peak, bytes
    peak_stage: str  # the ledger stage it is at ("forward_peak": inside the forward)
    stages: dict[str, int]  # bytes at each ledger stage
    forward_peak: int  # the peak inside the forward
    peak_ledger: dict[str, int]  # bytes per ledger class at the peak's stage (the forward's end for a forward peak)
    peak_ledger_stage: str  # that stage
    host_bytes: int  # host bytes the offload holds at most
    needs: int  # the budget it needs (``needs``)
    fits: bool  # needs <= budget
    keeps_float32: bool  # no autocast
    mechanisms: int  # how many mechanisms it combines
    cost: Cost  # counted extra time
    measured: CachedRatio | None  # a cached GPU record of the same strategy


@dataclass(frozen=True)
class FitsInstead:
    """What would fit when nothing does."""

    strategy: str  # the leanest strategy
    needs: int  # what it needs at the asked shape
    small_shape: list[int]  # the second shape traced: [batch, seq]
    small_needs: int  # what it needs there
    model_state: int  # bytes after backward: parameters, gradients, AdamW moments (+ the batch)
    batch: int | None = None  # about the largest batch that fits (None: not even one; or a seq answer instead)
    seq: int | None = None  # at batch 1: about the largest sequence that fits


@dataclass
class Plan:
    """The plan: per strategy a ``PlanRow``, the recommendation, what would fit instead."""

    model: dict  # model_type, parameters, layers, hidden_size, vocab_size, validated (a family tested at tiny size)
    batch: int
    seq: int
    budget: int  # bytes
    device_name: str | None  # cached records of this device only
    options: StepOptions  # the step's AdamW and offload threshold
    time_model: dict  # plain_forward_flops, flops_per_s, link_bytes_per_s, overlap
    rows: list[PlanRow]
    skipped: dict[str, str]  # strategy -> why it was not traced
    recommended: str | None
    fits_instead: FitsInstead | None
    cache_errors: list[str]
    elapsed_s: float = 0.0
    evidence_level: str = "estimated"
    memory_source: str = "fake-tensor"
    definition: StepDefinition = STEADY  # which step was traced (``bench.definitions``; default: the steady state)
    outputs_saving: int | None = None  # plain's peak with the outputs kept through backward minus with them dropped

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), headroom=dict(context_bytes=CONTEXT_BYTES, allocator_slack=ALLOCATOR_SLACK))


def session(config, batch: int, seq: int, options: StepOptions,
            definition: StepDefinition = STEADY) -> lifecycle.Session:
    """The fake session of ``config`` at (batch, seq), whose steps follow ``definition``; a ``PlanError``
    for a model the plan cannot take."""
    try:
        s = lifecycle.Session(lifecycle.ConfigWorkload(config, batch, seq), fake=True, options=options,
                              definition=definition)
    except ValueError as e:  # AutoModelForCausalLM has no class for this config
        raise PlanError(f"unknown architecture {config.model_type!r}: not a causal LM Transformers builds "
                        f"({str(e).splitlines()[0][:120]})") from None
    layers = getattr(getattr(s.model, "model", None), "layers", None)
    if layers is None or not all(hasattr(x, "self_attn") and hasattr(x, "mlp") for x in layers) \
            or not hasattr(s.model, "lm_head"):
        raise PlanError(f"architecture {config.model_type!r} is not a decoder stack the plan knows "
                        "(model.layers[i].self_attn / .mlp and lm_head)")
    return s


_SESSION = None  # the session a forked worker inherits (set only while ``ledgers``' pool runs)


def _ledger_in_worker(s: Strategy):
    return _SESSION.ledger(s)


def _quiet_worker():
    torch.set_num_threads(1)


def ledgers(sess, strategies, workers: int = 1):
    """The session's ledger of each strategy, in order. ``workers`` > 1 (Linux): forked processes that
    inherit the fake session (nothing is rebuilt or pickled but the ledgers), one strategy per task."""
    global _SESSION
    import multiprocessing

    if workers <= 1 or len(strategies) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (sess.ledger(s) for s in strategies)
        return
    # the longest first (more forward passes and hooks: more operations to trace), so that no worker is
    # left with a long one at the end; the ledgers come back in the order asked for
    work = lambda s: s.micro_batches * (2 + (s.checkpoint != "plain") + s.offload)  # noqa: E731
    order = sorted(range(len(strategies)), key=lambda i: -work(strategies[i]))
    done, nxt = {}, 0
    _SESSION = sess
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(strategies)), _quiet_worker) as pool:
            for i, led in zip(order, pool.imap(_ledger_in_worker, [strategies[i] for i in order])):
                done[i] = led
                while nxt in done:
                    yield done.pop(nxt)
                    nxt += 1
    finally:
        _SESSION = None


def default_workers() -> int:
    """Processes for ``ledgers``: the CPUs this process may use, at most 4."""
    import os

    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _row(led, s: Strategy, budget: int, flops, link: float, cached: dict) -> PlanRow:
    need = needs(led.peak)
    at = led.peak_stage if led.peak_stage in led.stages else "forward"  # (a peak inside the forward: its end)
    return PlanRow(s.name, led.peak, led.peak_stage, led.totals(), led.forward_peak, led.stages[at], at,
                   max(led.host.values(), default=0), need, need <= budget, s.amp is None,
                   0 if s.name == "plain" else s.name.count("+") + 1, cost(led, s, flops, link), cached.get(s.name))


def plan(config, batch: int, seq: int, budget: int, device_name: str | None = None, candidates=CANDIDATES,
         options: StepOptions = StepOptions().for_device("cuda"), progress=None, workers: int = 1,
         results_dir=None, definition: StepDefinition = STEADY) -> Plan:
    """The ``Plan`` of ``config`` at (batch, seq) for ``budget`` bytes; ``workers``: processes that trace
    the candidates (``ledgers``); ``results_dir``: the cached records (``costs.cached_ratios``);
    ``definition``: the step traced (``bench.definitions.StepDefinition``, e.g. the first step, whose
    update allocates AdamW's moments, or ``keep_outputs=True``: the hand-written loop whose ``out`` keeps the
    logits alive through backward; default: the steady state, outputs dropped). With plain among the
    candidates, its step is traced once more in the other loop: ``Plan.outputs_saving``."""
    t0, threads = time.perf_counter(), torch.get_num_threads()
    check_shape(config, batch, seq)
    torch.set_num_threads(1)  # fake tensors compute nothing: intra-op threads would only spin
    try:
        sess = session(config, batch, seq, options, definition)
        flops = forward_flops(sess)
        cached, errors = cached_ratios(device_name, results_dir)
        link = next((m.link["h2d"] for m in cached.values() if m.link), LINK_BYTES_S)
        skipped = {s.name: f"batch {batch} does not split into {s.micro_batches} micro-batches"
                   for s in candidates if batch % s.micro_batches}
        todo = [s for s in candidates if s.name not in skipped]
        traced = (progress or (lambda it, **kw: it))(ledgers(sess, todo, workers), desc="strategies", total=len(todo))
        rows = [_row(led, s, budget, flops, link, cached) for s, led in zip(todo, traced)]
        plain = next((r for r in rows if r.strategy == PLAIN.name), None)
        other = plain and sess.step(PLAIN, definition.replace(keep_outputs=not definition.keep_outputs)).peak
    finally:
        torch.set_num_threads(threads)
    best = next((r for r in rows if r.strategy == recommend(rows, budget)), None)
    model = dict(model_type=config.model_type, parameters=sum(p.numel() for p in sess.model.parameters()),
                 layers=len(flops.attn), hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                 validated=config.model_type in FAMILIES)
    p = Plan(model, batch, seq, budget, device_name, options,
             dict(plain_forward_flops=flops.total, flops_per_s=ASSUMED_FLOPS["cuda"]["float32"], link_bytes_per_s=link,
                  overlap="none (upper bound)"), rows, skipped, best and best.strategy, None, errors,
             definition=definition)
    if plain is not None:  # what dropping the outputs before backward saves (the other loop: one more trace)
        p.outputs_saving = plain.peak - other if definition.keep_outputs else other - plain.peak
    if best is None and rows:
        p.fits_instead = fits_instead(config, batch, seq, budget, min(rows, key=lambda r: r.needs), options,
                                      definition)
    p.elapsed_s = time.perf_counter() - t0
    return p


def recommend(rows, budget: int) -> str | None:
    """The plan's pick for ``budget``: of the rows whose ``needs`` fit, the least counted extra time;
    ties go to float32, then to fewer mechanisms, then to the lower peak (None: nothing fits)."""
    best = min((r for r in rows if r.needs <= budget), default=None,
               key=lambda r: (round(r.cost.extra, 3), not r.keeps_float32, r.mechanisms, r.peak))
    return best and best.strategy


def smallest_budget(rows, at_least: int) -> int | None:
    """The smallest budget at which at least ``at_least`` of the rows fit (None: fewer rows)."""
    need = sorted(r.needs for r in rows)
    return need[at_least - 1] if 0 < at_least <= len(need) else None


def fits_instead(config, batch: int, seq: int, budget: int, leanest: PlanRow, options,
                 definition: StepDefinition = STEADY) -> FitsInstead:
    """What would fit when nothing does: the leanest strategy's budget, and about the largest batch (or,
    at batch 1, sequence) it fits at, from one more step at batch 1 (seq / 2) and a line through both."""
    s = parse(leanest.strategy)
    b1, t1 = (1, seq) if batch > 1 else (1, max(2, seq // 2))
    small = session(config, b1, t1, options, definition).ledger(s.replace(micro_batches=1) if b1 % s.micro_batches else s)
    x0, x1 = (b1, batch) if batch > 1 else (t1, seq)
    need0 = needs(small.peak)
    slope = (leanest.needs - need0) / (x1 - x0) if x1 != x0 else 0
    fit_x = int(x0 + (budget - need0) / slope) if slope > 0 and budget >= need0 else None
    return FitsInstead(s.name, leanest.needs, [b1, t1], need0, leanest.stages["backward"],
                       **({"batch": fit_x} if batch > 1 else {"seq": fit_x}))
