"""``bp-mech plan``: which memory strategies fit a budget, for any Hugging Face causal LM, without a GPU.

Part 02 · 43's ledger as a tool. The model is built from its Transformers config under
``FakeTensorMode`` at full size (no memory is allocated); one steady-state training step (AdamW with
its moments, as on the GPU: fused, CUDA's offload threshold) is traced per strategy of
``strategy.CANDIDATES`` with the storage tracker (``ledger_measure.Session``: one fake model for all).
For each: the ledger per lifecycle stage, the peak, whether it fits, and what it costs in time,
counted rather than assumed:

* recomputes: sublayer forwards beyond the first (``counters.ForwardCounter``) times each sublayer's
  forward FLOPs (counted once with ``torch.utils.flop_counter`` on the plain forward; SDPA's causal
  core 2 B T^2 H d_head added, which the counter does not see on the CPU), and the chunked loss's
  second lm_head matmul;
* transfers: the bytes the offload's hooks copied, at the host link's bandwidth (a cached Part 02 ·
  42 GPU record's measured one, else ``LINK_BYTES_S``), not overlapped (an upper bound);
* both against the plain step's 3 x forward FLOPs at ``workload.PLAN_FLOPS`` (float32). Where a GPU
  record of the same strategy is cached (19, 42, AMP, 11, 76), its measured time ratio is shown beside.

Decision rule: a strategy fits when ``peak * (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES <= budget``; the
recommended one is the fitting one with the least counted extra time; ties go to the one that keeps
float32, then to fewer mechanisms, then to the lower peak. Accumulation adds no counted work (the same
FLOPs in smaller kernels, whose cost on a GPU only a measured ratio shows). Validation: tests/planner/test_plan.py (the fake
peak equals the tracked-CPU peak at tiny size for every candidate and supported family). The table,
the messages and the command are ``bp_mech.planner.report``'s.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from bp_mech.bench import lifecycle as ledger_measure
from bp_mech.ledger import LedgerConfig
from bp_mech.bench.strategy import CANDIDATES, Strategy, parse
from bp_mech.bench.workload import PLAN_FLOPS, WorkloadError

FAMILIES = ("qwen2", "llama", "mistral", "phi3", "gemma")  # model types validated against tracked-CPU peaks
CONTEXT_BYTES = 512 * 2**20  # CUDA context + cuBLAS workspace, outside the caching allocator's counters
ALLOCATOR_SLACK = 0.10  # reserved over allocated: the caching allocator's block rounding and fragmentation
LINK_BYTES_S = 25e9  # pinned host <-> device copies, when no cached record measured it (PCIe 4.0 x16, ~80 %)
GiB = 2**30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(WorkloadError):
    """A plan that cannot be made: unknown architecture, a shape the config cannot take, no fit (exit 2)."""


def parse_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592; decimal (GB) and binary (GiB) units, or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise PlanError(f"cannot read the budget {text!r}; write e.g. 8GiB, 80GB or 512MiB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def load_config(path) -> object:
    """A Transformers config from a ``config.json`` (or a directory holding one), offline."""
    from transformers import AutoConfig

    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read config {p}: {e}") from None
    kind = d.pop("model_type", None)
    try:
        return AutoConfig.for_model(kind, **d)
    except (ValueError, KeyError, TypeError):
        raise PlanError(f"unknown architecture {kind!r} in {p}: Transformers {_version()} has no config class for "
                        f"it; validated families: {', '.join(FAMILIES)}") from None


def _version() -> str:
    import transformers

    return transformers.__version__


def check_shape(config, batch: int, seq: int) -> None:
    """Refuse what the config cannot take: batch < 1, seq < 2, seq beyond max_position_embeddings."""
    if batch < 1 or seq < 2:
        raise PlanError(f"batch must be >= 1 and seq >= 2, got --batch {batch} --seq {seq}")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise PlanError(f"--seq {seq} exceeds the config's max_position_embeddings {limit} ({config.model_type})")


def _session(config, batch, seq, options):
    try:
        s = ledger_measure.Session(ledger_measure.ConfigWorkload(config, batch, seq), fake=True, options=options)
    except ValueError as e:  # AutoModelForCausalLM has no class for this config
        raise PlanError(f"unknown architecture {config.model_type!r}: not a causal LM Transformers builds "
                        f"({str(e).splitlines()[0][:120]})") from None
    layers = getattr(getattr(s.model, "model", None), "layers", None)
    if layers is None or not all(hasattr(l, "self_attn") and hasattr(l, "mlp") for l in layers) \
            or not hasattr(s.model, "lm_head"):
        raise PlanError(f"architecture {config.model_type!r} is not a decoder stack the plan knows "
                        "(model.layers[i].self_attn / .mlp and lm_head)")
    return s


def forward_flops(session) -> dict:
    """Forward FLOPs of one plain step, per part: each layer's attention (+ SDPA's causal core) and MLP,
    and lm_head, counted by ``torch.utils.flop_counter`` on the fake model (no_grad, no memory)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, (B, T) = session.model.config, session.batch["input_ids"].shape
    counter = FlopCounterMode(display=False)
    with session._active(), counter, torch.no_grad():
        session.model(input_ids=session.batch["input_ids"])
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    core = 2 * B * T * T * cfg.num_attention_heads * hd  # QK^T and PV, causal half (flash skips masked blocks)
    part = lambda suffix: sum(v for k, v in counts.items() if k.endswith(suffix))  # noqa: E731
    n = len(session.model.model.layers)
    attn = [part(f".layers.{i}.self_attn") + core for i in range(n)]
    mlp = [part(f".layers.{i}.mlp") for i in range(n)]
    return dict(attn=attn, mlp=mlp, head=part(".lm_head"), total=counter.get_total_flops() + n * core)


def cached_ratios(device_name: str | None = None, results_dir=None) -> dict[str, dict]:
    """Strategy name -> the measured GPU time and peak ratios of a cached record of that strategy
    against its own run's baseline (Part 02 · 19, 42, AMP, 11 and 76), the newest per strategy, of a
    device whose name contains ``device_name`` (any if None); ``results_dir``: default book/results."""
    from bp_mech.records import registry
    from bp_mech.book import report

    names = {("TRAIN-CHECKPOINT", c): c for c in ("checkpoint-all", "checkpoint-every2", "checkpoint-mlp")}
    names.update({("TRAIN-OFFLOAD", "offload"): "offload", ("TRAIN-OFFLOAD", "offload-checkpoint"):
                  "checkpoint-all+offload", ("TRAIN-AMP-BACKWARD", "fp16-amp"): "fp16",
                  ("TRAIN-AMP-BACKWARD", "bf16-amp"): "bf16", ("TRAIN-GRADIENT-ACCUMULATION", "micro2"): "micro2"})
    base = {"TRAIN-CHECKPOINT": "plain", "TRAIN-OFFLOAD": "resident", "TRAIN-AMP-BACKWARD": "fp32",
            "TRAIN-GRADIENT-ACCUMULATION": "full", "TRAIN-MEMORY-STRATEGY": "plain"}
    out = {}
    for sid, baseline in base.items():
        if not registry.get(sid).implemented:
            continue
        try:
            groups = report.cached(sid, results_dir or report.RESULTS_DIR).gpu()
        except ValueError as e:  # a corrupt or unmergeable cache: said in the plan, not used
            out.setdefault("_errors", []).append(f"{sid}: {e}")
            continue
        for label, recs in groups.items():
            ref = next((r for r in recs if r.candidate == baseline and r.step_median_s), None)
            for r in recs:
                name = r.candidate if sid == "TRAIN-MEMORY-STRATEGY" else names.get((sid, r.candidate))
                if ref is None or name is None or not r.step_median_s or r.evidence_level != "gpu-measured" or \
                        (device_name and device_name.lower() not in (r.device_name or "").lower()) or \
                        (name in out and out[name]["created_at"] >= r.created_at):  # the newest record wins
                    continue
                bw = (r.metrics or {}).get("bandwidth_bytes_per_s")
                out[name] = dict(time_ratio=r.step_median_s / ref.step_median_s, device=r.device_name,
                                 workload=r.workload_id, record=f"{sid} {label} {r.candidate}", created_at=r.created_at,
                                 peak_ratio=r.peak_allocated / ref.peak_allocated
                                 if r.peak_allocated and ref.peak_allocated else None, link=bw)
    return out


def _cost(led, s: Strategy, flops: dict, link: float) -> dict:
    """Counted extra work of a step of ``s`` over the plain one, as a fraction of the plain step's time."""
    c, n, k = led.counts, len(flops["attn"]), s.micro_batches  # each micro-batch runs every layer once (1/k tokens)
    recompute = ((c["attn_calls"] - k * n) * sum(flops["attn"]) + (c["mlp_calls"] - k * n) * sum(flops["mlp"])) / (n * k)
    recompute += flops["head"] if s.chunked_loss is not None else 0  # the chunked loss's second lm_head matmul
    plain_s = 3 * flops["total"] / PLAN_FLOPS["cuda"]["float32"]
    transfer_s = (c["d2h_bytes"] + c["h2d_bytes"]) / link
    return dict(recomputes=c["recomputes"], recompute_flops=recompute,
                d2h_bytes=c["d2h_bytes"], h2d_bytes=c["h2d_bytes"], transfer_s=transfer_s,
                extra=recompute / (3 * flops["total"]) + transfer_s / plain_s)


def needs(peak: int) -> int:
    """The budget a step of this peak needs: ``peak * (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES``."""
    return int(peak * (1 + ALLOCATOR_SLACK)) + CONTEXT_BYTES


def _row(led, s: Strategy, budget: int, flops: dict, link: float, cached: dict) -> dict:
    need = needs(led.peak)
    at = led.peak_stage if led.peak_stage in led.stages else "forward"  # (a peak inside the forward: its end)
    return dict(strategy=s.name, peak=led.peak, peak_stage=led.peak_stage, stages=led.totals(),
                forward_peak=led.forward_peak, peak_ledger=led.stages[at], peak_ledger_stage=at,
                host_bytes=max(led.host.values(), default=0), needs=need, fits=need <= budget,
                keeps_float32=s.amp is None, mechanisms=0 if s.name == "plain" else s.name.count("+") + 1,
                cost=_cost(led, s, flops, link), measured=cached.get(s.name))


_SESSION = None  # the session a forked worker inherits (set only while ``measure_all``'s pool runs)


def _measure_in_worker(s: Strategy):
    return _SESSION.measure(s)


def _quiet_worker():
    torch.set_num_threads(1)


def measure_all(session, strategies, workers: int = 1):
    """The session's ledger of each strategy, in order. ``workers`` > 1 (Linux): forked processes that
    inherit the fake session (nothing is rebuilt or pickled but the ledgers), one strategy per task."""
    global _SESSION
    import multiprocessing

    if workers <= 1 or len(strategies) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (session.measure(s) for s in strategies)
        return
    # the longest first (more forward passes and hooks: more operations to trace), so that no worker is
    # left with a long one at the end; the ledgers come back in the order asked for
    work = lambda s: s.micro_batches * (2 + (s.checkpoint != "plain") + s.offload)  # noqa: E731
    order = sorted(range(len(strategies)), key=lambda i: -work(strategies[i]))
    done, nxt = {}, 0
    _SESSION = session
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(strategies)), _quiet_worker) as pool:
            for i, led in zip(order, pool.imap(_measure_in_worker, [strategies[i] for i in order])):
                done[i] = led
                while nxt in done:
                    yield done.pop(nxt)
                    nxt += 1
    finally:
        _SESSION = None


def default_workers() -> int:
    """Processes for ``measure_all``: the CPUs this process may use, at most 4."""
    import os

    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def plan(config, batch: int, seq: int, budget: int, device_name: str | None = None,
         candidates=CANDIDATES, options: LedgerConfig = LedgerConfig().for_device("cuda"), progress=None,
         workers: int = 1, results_dir=None) -> dict:
    """The plan as a JSON-able dict (``rows`` one per candidate, ``recommended``, ``fits_instead``);
    ``workers``: processes that trace the candidates (``measure_all``); ``results_dir``: the cached
    records (``cached_ratios``)."""
    t0, threads = time.perf_counter(), torch.get_num_threads()
    check_shape(config, batch, seq)
    torch.set_num_threads(1)  # fake tensors compute nothing: intra-op threads would only spin
    try:
        return _plan(config, batch, seq, budget, device_name, candidates, options, progress, workers, t0, results_dir)
    finally:
        torch.set_num_threads(threads)


def _plan(config, batch, seq, budget, device_name, candidates, options, progress, workers, t0, results_dir) -> dict:
    session = _session(config, batch, seq, options)
    flops = forward_flops(session)
    cached = cached_ratios(device_name, results_dir)
    errors = cached.pop("_errors", [])
    link = next((m["link"]["h2d"] for m in cached.values() if m.get("link")), LINK_BYTES_S)
    skipped = {s.name: f"batch {batch} does not split into {s.micro_batches} micro-batches"
               for s in candidates if batch % s.micro_batches}
    todo = [s for s in candidates if s.name not in skipped]
    ledgers = (progress or (lambda it, **kw: it))(measure_all(session, todo, workers), desc="strategies", total=len(todo))
    rows = [_row(led, s, budget, flops, link, cached) for s, led in zip(todo, ledgers)]
    fit = [r for r in rows if r["fits"]]
    best = min(fit, key=lambda r: (round(r["cost"]["extra"], 3), not r["keeps_float32"], r["mechanisms"], r["peak"]),
               default=None)
    n_params = sum(p.numel() for p in session.model.parameters())
    out = dict(model=dict(model_type=config.model_type, parameters=n_params, layers=len(flops["attn"]),
                          hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                          validated=config.model_type in FAMILIES),
               batch=batch, seq=seq, budget=budget, device_name=device_name, evidence_level="estimated",
               memory_source="fake-tensor", adamw=options.adamw, offload_min_bytes=options.offload_min_bytes,
               headroom=dict(context_bytes=CONTEXT_BYTES, allocator_slack=ALLOCATOR_SLACK),
               time_model=dict(plain_forward_flops=flops["total"], flops_per_s=PLAN_FLOPS["cuda"]["float32"],
                               link_bytes_per_s=link, overlap="none (upper bound)"),
               rows=rows, skipped=skipped, recommended=best and best["strategy"], fits_instead=None,
               cache_errors=errors)
    if best is None and rows:
        out["fits_instead"] = fits_instead(config, batch, seq, budget, min(rows, key=lambda r: r["needs"]), options)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def fits_instead(config, batch: int, seq: int, budget: int, leanest: dict, options) -> dict:
    """What would fit when nothing does: the leanest strategy's budget, and about the largest batch (or,
    at batch 1, sequence) it fits at, from one more step at batch 1 (seq / 2) and a line through both."""
    s = parse(leanest["strategy"])
    b1, t1 = (1, seq) if batch > 1 else (1, max(2, seq // 2))
    small = _session(config, b1, t1, options).measure(s.replace(micro_batches=1) if b1 % s.micro_batches else s)
    x0, x1 = (b1, batch) if batch > 1 else (t1, seq)
    need0 = needs(small.peak)
    slope = (leanest["needs"] - need0) / (x1 - x0) if x1 != x0 else 0
    fit_x = int(x0 + (budget - need0) / slope) if slope > 0 and budget >= need0 else None
    return dict(strategy=s.name, needs=leanest["needs"], small_shape=[b1, t1], small_needs=need0,
                model_state=leanest["stages"]["backward"],  # parameters, gradients, AdamW moments (+ the batch)
                **({"batch": fit_x} if batch > 1 else {"seq": fit_x}))
