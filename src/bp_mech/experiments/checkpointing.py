"""Part 02 · 19 — TRAIN-CHECKPOINT, the experiment: plain saving against three checkpointing
configurations of ``bp_mech.checkpointing`` on one model.

A measured step is a full training step (``bench.step.train_step``: forward, backward, AdamW update,
zero_grad; its moments allocated beforehand), timed interleaved with the other arms; the equality
probe runs the same step without the update, so every arm starts from the same weights and the
loss and every gradient can be compared with the plain run exactly. Measuring is the harness's
(``harness.same_weights``), the decision rule and records ``bp_mech.experiments.decision``'s; this
module adds the arms, the dry run's factors and the conformance check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from bp_mech import checkpointing
from bp_mech.bench.compare import EXACT_TOL, compare
from bp_mech.bench.rates import ASSUMED_BASIS
from bp_mech.bench.step import probe, train_step
from bp_mech.bench.optimizer import StepOptions, make_optimizer
from bp_mech.bench.strategy import Strategy, configured, parse
from bp_mech.bench.timing import matmul_flops
from bp_mech.instruments.workload import build_model, make_batches, parse_workload
from bp_mech.experiments.dry_run import same_weights_modes, schedule
from bp_mech.experiments import decision, harness

CANDIDATES = checkpointing.CONFIGURATIONS  # every configuration is an arm (a strategy's name); "plain" is the baseline
ARMS = {name: Strategy(checkpoint=name) for name in CANDIDATES}

# Dry run only: an arm's step time in plain steps.
TIME_FACTOR = {"plain": 1.0, "checkpoint-all": 1.35, "checkpoint-every2": 1.2, "checkpoint-mlp": 1.2}

SCRATCH_TOL = 1e-12  # float64: from-scratch checkpointing vs torch.utils.checkpoint repeat the same operations


def dry_run(ctx) -> dict:
    return dict(step="forward + backward + AdamW update + zero_grad (moments allocated by one update first)",
                timing="arms interleaved, one full step of each per round (1 intra-op thread on the CPU)",
                probe="1 untimed step without the update per arm, all from the same weights: loss, "
                      "gradients, forward calls, saved bytes; before the timing, 1 tracked step per arm: the peak",
                modes=same_weights_modes(ctx.workload, TIME_FACTOR.values(), ctx.smoke),
                estimate_basis=f"{ASSUMED_BASIS}; x TIME_FACTOR {TIME_FACTOR}; + gradients / PROBE_BYTES_S per arm",
                rule=dict(MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING, MAX_TIME_RATIO=decision.MAX_TIME_RATIO,
                          MIN_USEFUL_SAVING=decision.MIN_USEFUL_SAVING))


def run(ctx) -> list:
    model = build_model(ctx.workload, ctx.device)
    batches = make_batches(ctx.workload, 4, device=ctx.device)
    results = harness.same_weights(model, batches, ctx.device, ARMS, *schedule(ctx.device, ctx.smoke),
                                   progress=ctx.progress)
    return decision.strategy_records(ctx, results, ARMS)


def conformance():
    """Our checkpointing vs Transformers' ``gradient_checkpointing_enable`` and ``torch.utils.checkpoint``."""
    from bp_mech.records.registry import ConformanceRow
    from bp_mech.instruments.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    batch = make_batches(w, 1)[0]
    probes = {}
    for name, s in ARMS.items():
        with configured(model, s):
            probes[name] = probe(model, batch, s)
    errors = [compare(probes["plain"], probes[name]) for name in CANDIDATES[1:]]
    loss_tol, grad_tol = EXACT_TOL["cpu"]
    equal = all(e.within(EXACT_TOL["cpu"]) for e in errors)
    worst = max(max(e.loss_error, e.grad_error) for e in errors)
    n_layers = len(model.model.layers)
    calls_ok = probes["checkpoint-all"].calls["layer"] == [2] * n_layers and probes["plain"].recomputes == 0
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
                          f"layer forward calls under checkpointing {probes['checkpoint-all'].calls['layer']}; "
                          f"from-scratch vs torch.utils.checkpoint {scratch:.1e} (tol {SCRATCH_TOL:.0e}, float64)")


# --- what a step's time is made of (the chapter's time ratio) --------------------------


@dataclass(frozen=True)
class StepWork:
    """What one full training step does, counted: FLOPs and ATen operators dispatched."""

    flops: int  # torch.utils.flop_counter over zero_grad, forward, backward and the update
    operators: int  # ATen operators dispatched in that step (each a call, whatever its size)


class _OperatorCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def step_work(workload: str = "tiny-b2s64",
              strategies=("plain", "checkpoint-all")) -> dict[str, StepWork]:
    """{strategy: StepWork} of one steady-state step (moments allocated by one update first),
    on one CPU model, from the same weights' shapes (counts do not depend on the values)."""
    w = parse_workload(workload)
    model, batches = build_model(w), make_batches(w, 1)
    opt = make_optimizer(model.parameters(), StepOptions(), "cpu")
    train_step(model, opt, batches[0])  # allocates AdamW's moments
    out = {}
    for name in strategies:
        s = parse(name)
        with configured(model, s):
            ops, flops = _OperatorCount(), FlopCounterMode(display=False)
            with flops, ops:
                train_step(model, opt, batches[0], s)
        out[name] = StepWork(flops.get_total_flops(), ops.n)
    return out


def matmul_rate(n: int = 512, repeats: int = 20) -> float:
    """FLOP/s of an n x n float32 matmul on one intra-op thread, by that thread's CPU time (the
    clock and the thread count of the chapter's timing): what the step's FLOPs could run at."""
    return matmul_flops(n, repeats, threads=1, clock=time.thread_time)
