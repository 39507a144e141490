"""Part 02 · 42 — TRAIN-OFFLOAD, the experiment: the plain (resident) step against PyTorch's
``save_on_cpu``, the package's ``ActivationOffload`` (``bp_mech.offload``, the strategy ``offload``) and
that offload under checkpointing (``checkpoint-all+offload``).

Before the candidates, a counting-only pass (``counters.SavedBytesCounter``, no copies) counts the
saved activations independently; each record says whether the hooks' D2H bytes equal what that
count predicts. On CUDA the pinned host link is measured (``host_memory.measure_bandwidth``) and each
record sets the step-time overhead against the transfer bound. Measuring is the harness's
(``harness.same_weights``), the decision rule and records ``bp_mech.experiments.decision``'s, as in
Part 02 · 19. ``save_on_cpu`` is an arm of this experiment, not a strategy of the book: PyTorch's hooks
stand in for the offload's (its records' ``strategy`` is null).
"""

from __future__ import annotations

import torch

from bp_mech import checkpointing, host_memory, offload
from bp_mech.instruments import counters
from bp_mech.bench.compare import EXACT_TOL, compare
from bp_mech.bench.step import probe
from bp_mech.bench.strategy import PLAIN, Entered, Strategy, configured, parse
from bp_mech.instruments.tracking import host_side
from bp_mech.instruments.workload import build_model, make_batches
from bp_mech.experiments import decision, harness
from bp_mech.experiments.dry_run import same_weights_modes, schedule

CANDIDATES = ("plain", "save_on_cpu", "offload", "checkpoint-all+offload")
ARMS = {"plain": PLAIN, "save_on_cpu": Strategy(offload=True), "offload": Strategy(offload=True),
        "checkpoint-all+offload": parse("checkpoint-all+offload")}

# Dry run only: an arm's step time in plain steps.
TIME_FACTOR = {"plain": 1.0, "save_on_cpu": 6.0, "offload": 1.5, "checkpoint-all+offload": 2.0}


def dry_run(ctx) -> dict:
    return dict(step="forward (under the arm's hooks) + backward + AdamW update + zero_grad, interleaved",
                counting="1 counting-only saved_tensors_hooks forward per configuration (plain, checkpointed)",
                modes=same_weights_modes(ctx.workload, TIME_FACTOR.values(), ctx.smoke,
                                                 min_bytes=offload.min_bytes,
                                                 bandwidth=lambda d: "pinned H2D/D2H, 256 MiB x 5" if d == "cuda" else None),
                estimate_basis=f"as Part 02 · 19's, with TIME_FACTOR {TIME_FACTOR}",
                rule=dict(MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING, MAX_TIME_RATIO=decision.MAX_TIME_RATIO,
                          MIN_USEFUL_SAVING=decision.MIN_USEFUL_SAVING))


def count_saved(model, batch, candidate="plain") -> counters.SavedBytesCounter:
    """What autograd saves in one forward (counting only), under checkpointing configuration ``candidate``."""
    counter = counters.SavedBytesCounter(model.parameters())
    with checkpointing.configure(model, candidate), counter:
        model(**batch).loss  # the graph is dropped at once; nothing is moved
    return counter


def make_hooks(name: str, model, cfg: offload.OffloadConfig, device):
    """The saved-tensor hooks of an offloading arm: PyTorch's (``save_on_cpu``) or the book's."""
    if name == "save_on_cpu":
        return offload.CountingSaveOnCpu(host_region=host_side)
    return offload.ActivationOffload(model.parameters(), cfg, device, host_region=host_side)


def hook_stats(hooks) -> dict:
    """What the hooks counted in the last step, as plain numbers (the hooks and their pool can go)."""
    out = dict(d2h=hooks.d2h_bytes, h2d=hooks.h2d_bytes)
    if isinstance(hooks, offload.ActivationOffload):
        out.update(kept_small_bytes=hooks.kept_small_bytes, kept_param_saves=hooks.kept_params,
                   shared_views=hooks.shared_views, offloaded_tensors=hooks.offloaded,
                   host_pool_bytes=hooks.pool.allocated, host_peak_bytes=hooks.pool.high_water,
                   pool_allocations=hooks.pool.allocations)
    else:
        out.update(host_peak_bytes=hooks.d2h_bytes)  # save_on_cpu holds every copy until backward
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        # the CUDA caching host allocator's own view of pinned memory, beside the pool's counters
        out["cuda_host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items()
                                         if isinstance(v, (int, float))}
    return out


def link_metrics(d2h: int, h2d: int, bandwidth: dict, median_s: float, base_median_s: float) -> dict:
    """The transfer bound (bytes / measured bandwidth, nothing overlapped) against the step-time overhead
    over the resident run; what exceeds the bound is, at least, the implementation's."""
    bound = d2h / bandwidth["d2h"] + h2d / bandwidth["h2d"]
    overhead = median_s - base_median_s
    return dict(bandwidth_bytes_per_s=bandwidth, transfer_bound_s=bound, overhead_s=overhead,
                overhead_over_bound=overhead / bound if bound else None,
                implementation_s=max(0.0, overhead - bound))


def run(ctx, bandwidth: dict | None = None) -> list:
    """Every arm; ``bandwidth`` ({"h2d", "d2h"} bytes/s) is measured on CUDA when not given."""
    device = ctx.device
    model = build_model(ctx.workload, device)
    batches = make_batches(ctx.workload, 4, device=device)
    counts = {c: count_saved(model, batches[0], c) for c in ("plain", "checkpoint-all")}
    if bandwidth is None and torch.device(device).type == "cuda":
        bandwidth = host_memory.measure_bandwidth(device)
    cfg = offload.OffloadConfig(min_bytes=offload.min_bytes(device))
    hooks = {name: make_hooks(name, model, cfg, device) for name, s in ARMS.items() if s.offload}
    results = harness.same_weights(model, batches, device, ARMS, *schedule(device, ctx.smoke), hooks=hooks,
                                   progress=ctx.progress)
    stats = {name: hook_stats(h) for name, h in hooks.items()}  # the counters of their last step (the probe)
    del hooks  # frees the host pools
    base = results["plain"] if isinstance(results["plain"], harness.Measured) else None
    plain = counts["plain"]

    def experiment_fields(name, m):
        metrics = dict(saved_activation_bytes=plain.bytes, saved_tensors=plain.tensors,
                       saved_tensor_bytes_per_tensor=plain.tensor_bytes)
        if name == "plain":
            return {}, metrics
        counted_by_hooks = {k: v for k, v in stats[name].items() if k not in ("d2h", "h2d")}
        # what the counting pass predicts: distinct storages >= min_bytes for ours; every saved
        # tensor (parameters and views included) for save_on_cpu
        counted = counts[ARMS[name].checkpoint]
        expected = counted.tensor_bytes if name == "save_on_cpu" else counted.bytes_at_least(cfg.min_bytes)
        metrics.update(counted_by_hooks, expected_d2h_bytes=expected, d2h_matches_count=m.d2h_bytes == expected,
                       saved_outside_checkpoint_bytes=counts["checkpoint-all"].bytes, min_bytes=cfg.min_bytes,
                       implementation="torch.autograd.graph.save_on_cpu" if name == "save_on_cpu" else
                       "bp_mech.offload.ActivationOffload")
        if bandwidth is not None and base is not None:
            metrics.update(link_metrics(m.d2h_bytes, m.h2d_bytes, bandwidth, m.timing.median_s, base.timing.median_s))
        return {}, metrics

    return decision.strategy_records(ctx, results, ARMS, extra=experiment_fields)


def conformance():
    """Our offload vs PyTorch's ``save_on_cpu`` and the resident run: same loss and gradients;
    our D2H bytes equal the independently counted saved-activation bytes."""
    from bp_mech.records.registry import ConformanceRow
    from bp_mech.instruments.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model, batch = build_model(w), make_batches(w, 1)[0]
    counted = count_saved(model, batch).bytes_at_least(offload.CPU_MIN_BYTES)
    ours = offload.ActivationOffload(model.parameters(), offload.OffloadConfig(min_bytes=offload.CPU_MIN_BYTES),
                                     host_region=host_side)
    save_on_cpu = offload.CountingSaveOnCpu(host_region=host_side)
    s = Strategy(offload=True)
    plain_probe = probe(model, batch)
    probes = []
    for hooks in (ours, save_on_cpu):
        with configured(model, s):
            probes.append(probe(model, batch, s, entered=Entered(model, s, "cpu", hooks=hooks)))
    loss_tol, grad_tol = EXACT_TOL["cpu"]
    errors = [compare(plain_probe, p) for p in probes]
    equal = all(e.within(EXACT_TOL["cpu"]) for e in errors)
    worst = max(max(e.loss_error, e.grad_error) for e in errors)
    ok = equal and ours.d2h_bytes == counted and ours.d2h_bytes <= save_on_cpu.d2h_bytes
    return ConformanceRow("Part 02 · 42", "TRAIN-OFFLOAD", "torch.autograd.graph.save_on_cpu + resident autograd", ok,
                          f"max loss/grad rel. error {worst:.1e} (tol {loss_tol:g} / {grad_tol:g}, float32 CPU); "
                          f"D2H {ours.d2h_bytes} B vs counted saved activations {counted} B; "
                          f"save_on_cpu copies {save_on_cpu.d2h_bytes} B")
