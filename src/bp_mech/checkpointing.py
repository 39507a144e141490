"""Part 02 · 19 — TRAIN-CHECKPOINT: activation (gradient) checkpointing.

Between forward and backward a training step keeps every tensor autograd saved for backward.
Checkpointing keeps only a block's inputs and runs the block's forward a second time in
backward to rebuild the rest (Griewank & Walther 2000; Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"): the saved activations of a block shrink to its input, the step
pays one extra forward of every checkpointed block.

* From scratch: ``CheckpointFunction`` / ``CheckpointedBlock`` (the reentrant design: forward
  under ``no_grad`` saving only the input, recompute and backpropagate inside ``backward``).
* With the framework: Transformers' ``gradient_checkpointing_enable`` (every layer, or every
  n-th layer), which calls ``torch.utils.checkpoint`` non-reentrant; ``checkpoint_mlp``, a
  selective variant that wraps only each layer's MLP in ``torch.utils.checkpoint``.
* Measured, not assumed: ``counters.ForwardCounter`` counts forward calls per layer and
  sublayer with module pre-hooks (they fire on the recompute too); ``counters.SavedBytesCounter``
  counts what autograd saves with a counting-only ``saved_tensors_hooks`` pass.

A measured step is a full training step (``zero_grad`` + forward + backward + AdamW update, its
moments allocated beforehand), timed interleaved with the other candidates; the equality probe
runs the same step without the update, so every candidate starts from the same weights and the
loss and every gradient can be compared with the plain run exactly. The step, probe, comparison,
decision rule and records live in ``bp_mech.experiments.harness``, shared with Part 02 · 42.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech.experiments import harness
from bp_mech.workload import PLAN_BASIS, build_model, make_batches

CODE_MODULES = ("bp_mech.experiments.harness",)  # its step, probe, decision and records: hashed with this one

# --- from scratch ---------------------------------------------------------------------


class CheckpointFunction(torch.autograd.Function):
    """``y = fn(x)`` keeping only ``x``; backward runs ``fn(x)`` again, with grad, and differentiates it.

    ``params`` (those ``fn`` uses) are passed as inputs so that autograd asks for their gradients
    even when ``x`` needs none; they are not activations, keeping a reference to them costs nothing.
    (No RNG stashing, unlike ``torch.utils.checkpoint``: Qwen2 has no dropout.)
    """

    @staticmethod
    def forward(ctx, fn, x, *params):  # x (..., C)
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)  # the only activation kept between forward and backward
        with torch.no_grad():  # no graph: fn's intermediates are freed as soon as they are used
            return fn(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)  # the recompute: a second forward of the block, now building a graph
        grads = torch.autograd.grad(y, [x, *ctx.params], dy, allow_unused=True)
        return None, *grads


class CheckpointedBlock(nn.Module):
    """A block whose forward keeps only its input; ``calls`` counts real executions of the block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.calls = 0  # forward executions, the recompute in backward included

    def _run(self, x):
        self.calls += 1  # counted where the block runs, so a recompute cannot be missed or faked
        return self.block(x)

    def forward(self, x):
        params = [p for p in self.block.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return self._run(x)  # nothing to differentiate: a plain forward
        return CheckpointFunction.apply(self._run, x, *params)


# --- the candidates ---------------------------------------------------------------------


class _Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (non-reentrant) while training."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def checkpoint_mlp(model):
    """Selective checkpointing: only each decoder layer's MLP is recomputed in backward."""
    layers = model.model.layers
    for layer in layers:
        layer.mlp = _Checkpointed(layer.mlp)
    try:
        yield model
    finally:
        for layer in layers:
            layer.mlp = layer.mlp.inner


def enable_native(model, every_n_layers: int = 1) -> None:
    """Transformers' checkpointing: ``torch.utils.checkpoint`` (non-reentrant) on every n-th layer."""
    kw = dict(gradient_checkpointing_kwargs={"use_reentrant": False})
    native_n = "every_n_layers" in inspect.signature(model.gradient_checkpointing_enable).parameters
    if native_n:
        kw["every_n_layers"] = every_n_layers
    model.gradient_checkpointing_enable(**kw)
    if not native_n:  # older Transformers: the same per-layer flags, set by hand
        for i, layer in enumerate(model.model.layers):
            layer.gradient_checkpointing = i % every_n_layers == 0


CANDIDATES = ("plain", "checkpoint-all", "checkpoint-every2", "checkpoint-mlp")


@contextlib.contextmanager
def configure(model, candidate: str):
    """Apply a candidate's checkpointing to ``model`` inside the block, and undo it after."""
    if candidate == "checkpoint-mlp":
        with checkpoint_mlp(model):
            yield model
        return
    n = {"plain": 0, "checkpoint-all": 1, "checkpoint-every2": 2}[candidate]
    if n:
        enable_native(model, n)
    try:
        yield model
    finally:
        if n:
            model.gradient_checkpointing_disable()
            model.disable_input_require_grads()  # enable added a hook on the embeddings


# The seed's reference (RTX 5070 Ti, Qwen2.5-0.5B, b2s512): quoted as such, never as this book's run.
SEED_REFERENCE = dict(run_label="b2s512_default2", device="RTX 5070 Ti", model="Qwen2.5-0.5B",
                      peak_saving=0.337, median_ratio=1.192, decision="accept")


# --- the experiment ---------------------------------------------------------------------

TIME_FACTOR = {"plain": 1.0, "checkpoint-all": 1.35, "checkpoint-every2": 1.2, "checkpoint-mlp": 1.2}  # planning


def plan(ctx) -> dict:
    return dict(step="zero_grad + forward + backward + AdamW update (moments allocated by one update first)",
                timing="candidates interleaved, one full step of each per round (1 intra-op thread on the CPU)",
                probe="1 untimed step without the update per candidate, all from the same weights: loss, "
                      "gradients, forward calls, saved bytes; then 1 full step per candidate for the peak",
                modes=harness.plan_modes(ctx.workload, TIME_FACTOR.values(), ctx.smoke),
                estimate_basis=f"{PLAN_BASIS}; x TIME_FACTOR {TIME_FACTOR}; + gradients / PROBE_BYTES_S per candidate",
                rule=dict(MIN_PEAK_SAVING=harness.MIN_PEAK_SAVING, MAX_TIME_RATIO=harness.MAX_TIME_RATIO,
                          MIN_USEFUL_SAVING=harness.MIN_USEFUL_SAVING))


def run(ctx) -> list:
    model = build_model(ctx.workload, ctx.device)
    batches = make_batches(ctx.workload, 4, device=ctx.device)
    candidates = {name: harness.Candidate(setup=lambda name=name: configure(model, name)) for name in CANDIDATES}
    results = harness.measure_candidates(model, batches, ctx.device, candidates, progress=ctx.progress, smoke=ctx.smoke)
    return harness.make_records(ctx, results, "plain")


def conformance():
    """Our checkpointing vs Transformers' ``gradient_checkpointing_enable`` and ``torch.utils.checkpoint``."""
    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    batch = make_batches(w, 1)[0]
    runs = {}
    for name in CANDIDATES:
        with configure(model, name):
            runs[name] = harness.probe(model, batch, "cpu")
    errs = [harness.compare(runs["plain"], runs[n]) for n in CANDIDATES[1:]]
    worst = max(max(e["loss_error"], e["grad_error"]) for e in errs)
    L = len(model.model.layers)
    calls_ok = runs["checkpoint-all"]["calls"]["layer"] == [2] * L and runs["plain"]["recomputes"] == 0
    torch.manual_seed(0)  # from scratch vs torch.utils.checkpoint on one MLP, float64
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(CheckpointedBlock(mlp)(x).sum(), [x, *mlp.parameters()])
    ref = torch.autograd.grad(checkpoint(mlp, x, use_reentrant=False).sum(), [x, *mlp.parameters()])
    scratch = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    ok = worst <= harness.EQUAL_TOL["cpu"][1] and calls_ok and scratch <= 1e-12
    return ConformanceRow("Part 02 · 19", "TRAIN-CHECKPOINT",
                          "transformers gradient_checkpointing_enable + torch.utils.checkpoint (non-reentrant)", ok,
                          f"max loss/grad rel. error {worst:.1e} over {len(errs)} candidates (tol 0, float32 CPU); "
                          f"layer forward calls under checkpointing {runs['checkpoint-all']['calls']['layer']}; "
                          f"from-scratch vs torch.utils.checkpoint {scratch:.1e} (tol 1e-12, float64)")
