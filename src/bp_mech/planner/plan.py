"""``bp-mech plan``: which memory strategies fit a budget, for any Hugging Face causal LM, without a GPU.

Part 02 · 43's ledger as a tool. The model is built from its Transformers config under
``FakeTensorMode`` at full size (no memory is allocated); one steady-state training step (the one
``bench.step.train_step``, AdamW with its moments, as on the GPU: fused unless ``options`` name another
implementation, as ``bp-mech plan --optimizer-impl`` does; CUDA's offload threshold; the outputs dropped
before backward unless ``definition.keep_outputs``) is traced per strategy of ``bench.strategy.CANDIDATES``
with the storage tracker (``planner.lifecycle.Session``: one fake model for all). For each: the ledger per
lifecycle stage, the peak, whether it fits, and what it costs in time (``planner.costs``: counted, not
assumed; the measured ratio of a cached GPU record of the same strategy beside it).
A model that does not attend causally (an encoder the causal-LM mapping lists: BERT with ``is_decoder``
false) is refused (``planner.causal``: a ``PlanError``, exit 2).

Decision rule: a strategy fits when ``needs(peak) <= budget``, ``needs`` being the allocator's slack on
the peak plus the CUDA context (``headroom``); the recommended one is the fitting one with the least
counted extra time; ties go to the one that keeps float32, then to fewer mechanisms, then to the lower
peak. Accumulation adds no counted work (the same FLOPs in smaller kernels, whose cost on a GPU only a
measured ratio shows). Validation: tests/planner/test_plan.py (the fake peak equals the tracked-CPU peak
at tiny size for every candidate and supported family). The table and the command are
``bp_mech.planner.report``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from bp_mech.instruments import anatomy
from bp_mech.planner import build, causal, lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition
from bp_mech.planner.finetune import FineTune, FineTuneError, missing_package
from bp_mech.bench.rates import ASSUMED_FLOPS
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import CANDIDATES, PLAIN, Strategy, unsupported
from bp_mech.planner.costs import LINK_BYTES_S, CachedRatio, Cost, Flops, cached_ratios, cost, forward_flops
from bp_mech.planner.fit import Fit, FitsInstead, fits_instead, largest_sizes
from bp_mech.planner.inputs import FAMILIES, PlanError, check_shape
from bp_mech.planner.shard import check as check_sharding, planning
from bp_mech.bench.oom import Failed
from bp_mech.planner.shallow import by_depth
from bp_mech.planner.trace import ledgers, one_line, stepped

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
    sharded: dict  # sharded plans: the most bytes of gathered parameters and of collective buffers at once


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
    definition: StepDefinition = STEADY  # which step was traced (``planner.definitions``; default: the steady state)
    outputs_saving: int | None = None  # plain's peak with the outputs kept through backward minus with them dropped
    fits: list[Fit] = dataclasses.field(default_factory=list)  # per row, the largest batch or seq that fits
    gpus: int = 1  # devices (a sharded plan is rank 0's, at ``batch`` sequences per device)
    shard: str | None = None  # None (one device), "fsdp2" or "ddp" (planner.shard)
    finetune: FineTune | None = None  # frozen parameters or LoRA traced (``planner.finetune``); None: full training

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), headroom=dict(context_bytes=CONTEXT_BYTES, allocator_slack=ALLOCATOR_SLACK))


def session(config, batch: int, seq: int, options: StepOptions,
            definition: StepDefinition = STEADY, finetune: FineTune | None = None, prepare=None) -> lifecycle.Session:
    """The fake session of ``config`` at (batch, seq), whose steps follow ``definition`` (``prepare``: the
    Session's, e.g. ``fully_shard``); a ``PlanError`` for a model the plan cannot take (Transformers' warnings
    while it builds one, such as an encoder's advice to set ``is_decoder``, are not the plan's output)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        s = lifecycle.Session(build.ConfigWorkload(config, batch, seq, finetune=finetune), fake=True,
                              options=options, definition=definition, prepare=prepare)
    except FineTuneError as e:  # --freeze / --lora-targets that do not fit this model
        raise PlanError(str(e)) from None
    except ValueError as e:  # AutoModelForCausalLM has no class for this config, or cannot build it
        raise PlanError(f"unknown architecture {config.model_type!r}: not a causal LM Transformers builds "
                        f"({one_line(e)})") from None
    except Exception as e:  # a config Transformers' own classes cannot be built from
        raise PlanError(f"Transformers cannot build {config.model_type!r} from this config: {one_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        anatomy.decoder_blocks(s.model), anatomy.output_head(s.model)
    except ValueError as e:
        raise PlanError(f"architecture {config.model_type!r} is not a decoder stack the plan can find: {e}") from None
    if causal.attends_causally(s.model) is False:  # an encoder the causal-LM mapping lists (BERT, is_decoder false)
        raise PlanError(causal.refusal(config.model_type))
    return s


def _row(led, s: Strategy, budget: int, flops, link: float, cached: dict, sharded=None) -> PlanRow:
    need = needs(led.peak)
    at = led.peak_stage if led.peak_stage in led.stages else "forward"  # (a peak inside the forward: its end)
    return PlanRow(s.name, led.peak, led.peak_stage, led.totals(), led.forward_peak, led.stages[at], at,
                   max(led.host.values(), default=0), need, need <= budget, s.amp is None,
                   0 if s.name == "plain" else s.name.count("+") + 1, cost(led, s, flops, link), cached.get(s.name),
                   dict(sharded or {}))


def plan(config, batch: int, seq: int, budget: int, device_name: str | None = None, candidates=CANDIDATES,
         options: StepOptions = StepOptions().for_device("cuda"), progress=None, workers: int = 1,
         results_dir=None, definition: StepDefinition = STEADY, fit: str | None = None,
         finetune: FineTune | None = None, gpus: int = 1, shard: str | None = None, full_depth: bool = False) -> Plan:
    """The ``Plan`` of ``config`` at (batch, seq) for ``budget`` bytes; ``workers``: processes that trace
    the candidates (``ledgers``); ``results_dir``: the cached records (``costs.cached_ratios``);
    ``definition``: the step traced (``planner.definitions.StepDefinition``, e.g. the first step, whose
    update allocates AdamW's moments, or ``keep_outputs=True``: the hand-written loop whose ``out`` keeps the
    logits alive through backward; default: the steady state, outputs dropped). With plain among the
    candidates, its step is traced once more in the other loop: ``Plan.outputs_saving``. ``finetune``: frozen
    parameters or LoRA (``planner.finetune.FineTune``); the optimizer and its implementation are ``options``'.
    ``fit``: "batch" or "seq": per strategy the largest batch (at ``seq``) or sequence (at ``batch``) that fits
    the budget (``Plan.fits``, ``largest_sizes``). ``shard``: "fsdp2" or "ddp": rank 0 of ``gpus`` devices, at
    ``batch`` sequences per device (``planner.shard``). Each step is extrapolated from three shallow ones
    (``planner.depth``: the full trace's ledger to the byte) where the model is one repeated block;
    ``full_depth``: trace every step at full depth instead."""
    t0, threads = time.perf_counter(), torch.get_num_threads()
    check_shape(config, batch, seq)
    if missing := missing_package(options.optimizer, finetune):
        raise PlanError(f"{'LoRA' if missing == 'peft' else options.optimizer} needs {missing}, which is not installed")
    if shard is not None:
        try:
            check_sharding(shard, gpus)
        except ValueError as e:
            raise PlanError(str(e)) from None
    torch.set_num_threads(1)  # fake tensors compute nothing: intra-op threads would only spin
    try:
        with planning(shard, gpus) if shard else contextlib.nullcontext((None, None)) as (prepare, trace):
            sess = session(config, batch, seq, options, definition, finetune, prepare)
            deep = None if full_depth else lambda todo: by_depth(
                sess, config, lambda c: session(c, batch, seq, options, definition, finetune, prepare), todo, shard, gpus)
            p = _plan(sess, config, batch, seq, budget, device_name, candidates, progress, workers, results_dir,
                      definition, fit, trace, deep)
    finally:
        torch.set_num_threads(threads)
    p.finetune, p.gpus, p.shard = finetune, gpus, shard
    p.elapsed_s = time.perf_counter() - t0
    return p


def plain_flops(sess, config, deep=None) -> Flops:
    """The plain forward's FLOPs: ``deep``'s, counted on its shallow sessions (``costs.flops_by_depth``), where
    the plan extrapolates in depth, else counted on the full model (``costs.forward_flops``); a ``PlanError``
    where the model's forward cannot run on fake tensors."""
    if deep is not None and deep.flops is not None:
        return deep.flops
    try:
        return forward_flops(sess)
    except Exception as e:  # noqa: BLE001 (the model's forward cannot run on fake tensors)
        raise PlanError(f"cannot trace {config.model_type!r} with fake tensors: {one_line(e)}") from None


def _plan(sess, config, batch, seq, budget, device_name, candidates, progress, workers, results_dir, definition,
          fit, trace, deep=None) -> Plan:
    """``plan``'s work on its fake session; ``trace``: ``planner.shard.planning``'s rank ledger, or None;
    ``deep(strategies)``: ``planner.shallow.by_depth``'s ``ByDepth`` for them, or None (full depth)."""
    skipped = {s.name: f"batch {batch} does not split into {s.micro_batches} micro-batches"
               for s in candidates if batch % s.micro_batches}
    skipped.update({s.name: why for s in candidates if s.name not in skipped and (why := unsupported(sess.model, s))})
    if definition.weights:  # half weights: nothing for autocast to cast, and no GradScaler for float16 grads
        skipped.update({s.name: f"the weights are {definition.weights} already: autocast has nothing to cast"
                        for s in candidates if s.amp and s.name not in skipped})
    todo = [s for s in candidates if s.name not in skipped]
    # and plain's step in the other loop (what dropping the outputs saves), traced beside them
    loop = [(PLAIN, definition.replace(keep_outputs=not definition.keep_outputs))] if PLAIN in todo else []
    deep = deep and deep(todo)
    if deep is None and definition.moments == "resident" and todo:  # every step on the full session: its optimizer
        sess.optimizer(definition.adamw or sess.options.adamw)  # made once here, before the FLOP count's forward
    flops = plain_flops(sess, config, deep)  # (which leaves FSDP2's root gathered), not once in each worker
    done = (progress or (lambda it, **kw: it))(ledgers(sess, todo + loop, workers, trace, deep, ordered=False),
                                               desc="strategies", total=len(todo) + len(loop))  # (as each is done)
    steps, records = [None] * (len(todo) + len(loop)), None
    for i, led in done:
        steps[i] = led
        records = records or cached_ratios(device_name, results_dir)  # read while the workers trace the rest
    cached, errors = records or cached_ratios(device_name, results_dir)
    link = next((m.link["h2d"] for m in cached.values() if m.link), LINK_BYTES_S)
    other = getattr(steps[-1], "ledger", steps[-1]) if loop else None
    rows = []
    for s, led in zip(todo, steps):
        if isinstance(led, Failed):
            skipped[s.name] = f"could not be traced: {led.failure}"
        else:  # (a sharded plan's rank ledger: its gathered parameters and collective buffers beside it)
            rows.append(_row(getattr(led, "ledger", led), s, budget, flops, link, cached, getattr(led, "most", None)))
    if not rows:
        why = skipped.get(PLAIN.name) or next(iter(skipped.values()), "no candidates")
        raise PlanError(f"cannot trace {config.model_type!r}: no strategy's step could be traced ({why})")

    def step(s, d=None):  # (what fits instead, the largest sizes: by depth too, at the session's shape now)
        led = stepped(sess, trace, (s, d) if d is not None else s, deep)
        return getattr(led, "ledger", led)
    plain = next((r for r in rows if r.strategy == PLAIN.name), None)
    best = next((r for r in rows if r.strategy == recommend(rows, budget)), None)
    text = config.get_text_config()
    model = dict(model_type=config.model_type, parameters=sum(p.numel() for p in sess.model.parameters()),
                 layers=len(flops.attn), hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                 attention=anatomy.unwrapped(sess.model).config._attn_implementation,
                 validated=config.model_type in FAMILIES,
                 trainable=sum(p.numel() for p in sess.model.parameters() if p.requires_grad))
    p = Plan(model, batch, seq, budget, device_name, sess.options,
             dict(plain_forward_flops=flops.total, flops_per_s=ASSUMED_FLOPS["cuda"]["float32"], link_bytes_per_s=link,
                  overlap="none (upper bound)"), rows, skipped, best and best.strategy, None, errors,
             definition=definition)
    if plain is not None and not isinstance(other, Failed):  # what dropping the outputs saves
        p.outputs_saving = plain.peak - other.peak if definition.keep_outputs else other.peak - plain.peak
    p.fits = largest_sizes(sess, rows, fit, batch, seq, budget, needs, step) if fit else []
    if best is None:
        p.fits_instead = fits_instead(sess, batch, seq, budget, min(rows, key=lambda r: r.needs), needs, step)
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
