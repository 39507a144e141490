"""Part 02 · 19 — TRAIN-CHECKPOINT, the experiment: plain saving against three checkpointing
configurations of ``bp_mech.checkpointing`` on one model.

A measured step is a full training step (``zero_grad`` + forward + backward + AdamW update, its
moments allocated beforehand), timed interleaved with the other candidates; the equality probe
runs the same step without the update, so every candidate starts from the same weights and the
loss and every gradient can be compared with the plain run exactly. The step, probe, comparison,
decision rule and records are the shared harness's (``bp_mech.experiments.harness``); this module
adds the candidates, the planning factors and the conformance check.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech import checkpointing
from bp_mech.experiments import harness, strategies
from bp_mech.bench.workload import PLAN_BASIS, build_model, make_batches

CANDIDATES = checkpointing.CONFIGURATIONS  # every configuration is an arm; "plain" is the baseline


# Planning only (``--mode dry_run``): a candidate's step time in plain steps.
TIME_FACTOR = {"plain": 1.0, "checkpoint-all": 1.35, "checkpoint-every2": 1.2, "checkpoint-mlp": 1.2}

SCRATCH_TOL = 1e-12  # float64: from-scratch checkpointing vs torch.utils.checkpoint repeat the same operations


def plan(ctx) -> dict:
    return dict(step="zero_grad + forward + backward + AdamW update (moments allocated by one update first)",
                timing="candidates interleaved, one full step of each per round (1 intra-op thread on the CPU)",
                probe="1 untimed step without the update per candidate, all from the same weights: loss, "
                      "gradients, forward calls, saved bytes; then 1 full step per candidate for the peak",
                modes=harness.plan_modes(ctx.workload, TIME_FACTOR.values(), ctx.smoke),
                estimate_basis=f"{PLAN_BASIS}; x TIME_FACTOR {TIME_FACTOR}; + gradients / PROBE_BYTES_S per candidate",
                rule=dict(MIN_PEAK_SAVING=strategies.MIN_PEAK_SAVING, MAX_TIME_RATIO=strategies.MAX_TIME_RATIO,
                          MIN_USEFUL_SAVING=strategies.MIN_USEFUL_SAVING))


def run(ctx) -> list:
    model = build_model(ctx.workload, ctx.device)
    batches = make_batches(ctx.workload, 4, device=ctx.device)
    candidates = {name: harness.Candidate(setup=lambda name=name: checkpointing.configure(model, name))
                  for name in CANDIDATES}
    results = harness.measure_candidates(model, batches, ctx.device, candidates, progress=ctx.progress, smoke=ctx.smoke)
    return strategies.make_records(ctx, results, "plain")


def conformance():
    """Our checkpointing vs Transformers' ``gradient_checkpointing_enable`` and ``torch.utils.checkpoint``."""
    from bp_mech.records.registry import ConformanceRow
    from bp_mech.bench.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    batch = make_batches(w, 1)[0]
    probes = {}
    for name in CANDIDATES:
        with checkpointing.configure(model, name):
            probes[name] = harness.probe(model, batch, "cpu")
    errors = [harness.compare(probes["plain"], probes[name]) for name in CANDIDATES[1:]]
    loss_tol, grad_tol = harness.EQUAL_TOL["cpu"]
    equal = all(e["loss_error"] <= loss_tol and e["grad_error"] <= grad_tol for e in errors)
    worst = max(max(e["loss_error"], e["grad_error"]) for e in errors)
    n_layers = len(model.model.layers)
    calls_ok = probes["checkpoint-all"]["calls"]["layer"] == [2] * n_layers and probes["plain"]["recomputes"] == 0
    torch.manual_seed(0)  # from scratch vs torch.utils.checkpoint on one MLP, float64
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(checkpointing.CheckpointedBlock(mlp)(x).sum(), [x, *mlp.parameters()])
    ref = torch.autograd.grad(checkpoint(mlp, x, use_reentrant=False).sum(), [x, *mlp.parameters()])
    scratch = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    ok = equal and calls_ok and scratch <= SCRATCH_TOL
    return ConformanceRow("Part 02 · 19", "TRAIN-CHECKPOINT",
                          "transformers gradient_checkpointing_enable + torch.utils.checkpoint (non-reentrant)", ok,
                          f"max loss/grad rel. error {worst:.1e} over {len(errors)} candidates "
                          f"(tol {loss_tol:g} / {grad_tol:g}, float32 CPU); "
                          f"layer forward calls under checkpointing {probes['checkpoint-all']['calls']['layer']}; "
                          f"from-scratch vs torch.utils.checkpoint {scratch:.1e} (tol {SCRATCH_TOL:.0e}, float64)")
