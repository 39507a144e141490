"""What a strategy costs in time, counted rather than assumed, and what cached GPU records measured.

* ``forward_flops``: the forward FLOPs of one plain step, per part, counted by
  ``torch.utils.flop_counter`` on the fake model (SDPA's causal core 2 B T^2 H d_head added, which the
  counter does not see on the CPU);
* ``cost``: a strategy's extra work over the plain step: its recomputed sublayers (forward calls beyond
  one per micro-batch, ``counters.ForwardCounter``) times their FLOPs, the chunked loss's second lm_head
  matmul, and the offload's bytes at the host link's bandwidth (not overlapped: an upper bound), all
  against the plain step's 3 x forward FLOPs at ``bench.rates.ASSUMED_FLOPS`` (float32);
* ``cached_ratios``: the measured time and peak ratios of cached GPU records, by the strategy each
  record names (``Record.strategy``), against the plain arm of the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bp_mech.instruments import anatomy
from bp_mech.bench.rates import ASSUMED_FLOPS
from bp_mech.bench.strategy import PLAIN, Strategy

LINK_BYTES_S = 25e9  # pinned host <-> device copies, when no cached record measured it (PCIe 4.0 x16, ~80 %)
STRATEGY_EXPERIMENTS = ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-AMP-BACKWARD", "TRAIN-GRADIENT-ACCUMULATION",
                        "TRAIN-MEMORY-STRATEGY")  # the experiments whose arms are strategies


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one plain step."""

    attn: list[int]  # per layer: its attention (projections + SDPA's causal core)
    mlp: list[int]  # per layer: its MLP
    head: int  # lm_head
    total: int  # the whole forward


def forward_flops(session) -> Flops:
    """``Flops`` of the session's model on its batch (no_grad, fake tensors: no memory)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, (B, T) = session.model.config.get_text_config(), session.batch["input_ids"].shape
    counter = FlopCounterMode(display=False)
    with session.active(), counter, torch.no_grad():
        session.model(input_ids=session.batch["input_ids"])
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    names = {m: n for n, m in session.model.named_modules()}
    flops = lambda m: counts.get(f"{type(session.model).__name__}.{names[m]}", 0) if m is not None else 0  # noqa: E731
    sdpa = session.model.config._attn_implementation == "sdpa"  # eager's matmuls are in the count already
    blocks = anatomy.decoder_blocks(session.model)
    cores = [sdpa_core(anatomy.attention(b), cfg, B, T) if sdpa else 0 for b in blocks]
    attn = [flops(anatomy.attention(b)) + core for b, core in zip(blocks, cores)]
    # the MLP, or the rest of a block without an MLP child (``counters.ForwardCounter`` counts it so)
    mlp = [flops(anatomy.mlp(b)) if anatomy.mlp(b) is not None else flops(b) + core - a
           for a, b, core in zip(attn, blocks, cores)]
    return Flops(attn, mlp, flops(anatomy.output_head(session.model)), counter.get_total_flops() + sum(cores))


def flops_by_depth(counted: dict, layers: int) -> Flops | None:
    """``forward_flops`` at ``layers`` blocks from ``counted`` ({depth: ``Flops``} of one repeated block's stack cut
    shallow, ``planner.shallow.shallow_sessions``): each block's FLOPs are the same, so the total is affine in
    the depth. The step per block from the two shallowest, checked on every other depth; None where a block's
    FLOPs differ between blocks or depths, or the total is not affine (the caller counts the full model).

    Example:
        >>> f = lambda d: Flops([3] * d, [5] * d, 7, 7 + 8 * d)
        >>> flops_by_depth({2: f(2), 3: f(3), 4: f(4)}, 24) == f(24)
        True
        >>> flops_by_depth({2: f(2), 3: f(3), 4: Flops([3] * 4, [5] * 4, 7, 99)}, 24) is None  # not affine
        True
    """
    counted = dict(sorted(counted.items()))
    if len(counted) < 2:
        return None
    (a, fa), (b, fb) = list(counted.items())[:2]
    if (fb.total - fa.total) % (b - a):
        return None
    step = (fb.total - fa.total) // (b - a)
    parts = {(x, y) for f in counted.values() for x, y in zip(f.attn, f.mlp)}
    if len(parts) != 1 or any(f.total != fa.total + (d - a) * step or f.head != fa.head for d, f in counted.items()):
        return None
    (attn, mlp), = parts
    return Flops([attn] * layers, [mlp] * layers, fa.head, fa.total + (layers - a) * step)


def sdpa_core(attn, cfg, B: int, T: int) -> int:
    """SDPA's causal core of one attention module, which the FLOP counter does not see on the CPU: QK^T and
    PV, 2 B T^2 H d_head (the causal half of 4 B T^2 H d_head: flash attention skips masked blocks); 0 for
    a block without attention (a state-space mixer). Heads and head size from the module where it keeps
    them (per-layer head sizes), else from the config."""
    if attn is None:
        return 0
    heads = getattr(attn, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
    hd = getattr(attn, "head_dim", None) or (heads and getattr(cfg, "hidden_size", 0) // heads)
    return 2 * B * T * T * heads * hd if heads and hd else 0


@dataclass(frozen=True)
class Cost:
    """A strategy's counted extra work over the plain step."""

    recomputes: int  # sublayer forwards beyond one per micro-batch
    recompute_flops: float  # their FLOPs (+ the chunked loss's second lm_head matmul)
    d2h_bytes: int  # the offload's copies to the host
    h2d_bytes: int  # and back
    transfer_s: float  # those bytes at the link's bandwidth
    extra: float  # recompute FLOPs / the plain step's + transfer seconds / the plain step's: a fraction of it


def cost(led, s: Strategy, flops: Flops, link: float) -> Cost:
    """The ``Cost`` of a step of ``s`` from its ledger's counts (``Ledger.counts``)."""
    c, n, k = led.counts, len(flops.attn), s.micro_batches  # each micro-batch runs every layer once (1/k tokens)
    recompute = ((c.attn_calls - k * n) * sum(flops.attn) + (c.mlp_calls - k * n) * sum(flops.mlp)) / (n * k)
    recompute += flops.head if s.chunked_loss is not None else 0  # the chunked loss's second lm_head matmul
    plain_s = 3 * flops.total / ASSUMED_FLOPS["cuda"]["float32"]
    transfer_s = (c.d2h_bytes + c.h2d_bytes) / link
    return Cost(c.recomputes, recompute, c.d2h_bytes, c.h2d_bytes, transfer_s,
                recompute / (3 * flops.total) + transfer_s / plain_s)


@dataclass(frozen=True)
class CachedRatio:
    """A cached GPU record of a strategy against the plain arm of its run."""

    time_ratio: float  # median step / the plain arm's
    peak_ratio: float | None  # allocated peak / the plain arm's
    device: str | None  # the record's GPU
    workload: str  # its workload
    record: str  # "<experiment> <run label> <candidate>"
    created_at: str | None  # when it was made (the newest record of a strategy wins)
    link: dict | None  # the host link's measured bandwidth, {"h2d", "d2h"} bytes/s (Part 02 · 42's records)


def cached_ratios(device_name: str | None = None, results_dir=None) -> tuple[dict[str, CachedRatio], list[str]]:
    """``({strategy: CachedRatio}, errors)``: per strategy the newest cached GPU record that names it, of a
    device whose name contains ``device_name`` (any if None), against the plain arm of the same run;
    ``errors``: caches that could not be read (said in the plan, not used). ``results_dir``: default
    book/results."""
    from bp_mech import RESULTS_DIR
    from bp_mech.records.cache import cached

    out: dict[str, CachedRatio] = {}
    errors = []
    for sid in STRATEGY_EXPERIMENTS:
        try:
            groups = cached(sid, results_dir or RESULTS_DIR, check_stale=False).gpu()  # (a ratio, stale or not)
        except ValueError as e:  # a corrupt or unmergeable cache
            errors.append(f"{sid}: {e}")
            continue
        for label, recs in groups.items():
            ref = next((r for r in recs if r.strategy == PLAIN.name and r.step_median_s), None)
            for r in recs:
                name = r.strategy
                if ref is None or name in (None, PLAIN.name) or not r.step_median_s or \
                        r.evidence_level != "gpu-measured" or \
                        (device_name and device_name.lower() not in (r.device_name or "").lower()) or \
                        (name in out and (out[name].created_at or "") >= (r.created_at or "")):  # newest wins
                    continue
                out[name] = CachedRatio(r.step_median_s / ref.step_median_s,
                                        r.peak_allocated / ref.peak_allocated
                                        if r.peak_allocated and ref.peak_allocated else None,
                                        r.device_name, r.workload_id, f"{sid} {label} {r.candidate}", r.created_at,
                                        (r.metrics or {}).get("bandwidth_bytes_per_s"))
    return out, errors
