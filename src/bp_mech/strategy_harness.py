"""The shared harness that measures a memory strategy against the plain step: equality probe, peak/time,
decision rule, records — used by 19 and 42.

A step is ``zero_grad`` + forward + backward, with no optimizer update: every candidate sees the
same weights, so the loss and every gradient can be compared with the plain run exactly.

* ``train_step`` (timed) and ``probe`` (one untimed step: loss, gradients, forward calls, what
  waits for backward), ``compare`` against the plain run, within ``TOL``;
* ``ForwardCounter`` counts forward calls per layer and sublayer with module pre-hooks (they fire
  on a recompute too); ``SavedBytesCounter`` counts what autograd saves with a counting-only
  ``saved_tensors_hooks`` pass;
* ``decide``: the accept/tune/reject rule from peak cut and time ratio, as code;
* ``measure_candidate`` (timed steps, then the probe), ``make_records`` (one record per candidate),
  ``schedule`` / ``estimate_seconds`` / ``plan_modes`` for ``--mode dry_run``.

A strategy (``bp_mech.checkpointing``, ``bp_mech.offload``) passes in its configuration as a
``setup`` context and its saved-tensor hooks as ``saving``; this module imports none of them.
"""

from __future__ import annotations

import contextlib
import math

import torch

from bp_mech.measure import PeakMemory, free, measure_steps
from bp_mech.results import json_safe
from bp_mech.workload import PLAN_BUILD_S, param_count, plan_seconds

# --- measuring: forward calls and saved tensors ----------------------------------------


class ForwardCounter:
    """Forward calls of each decoder layer and of its attention and MLP, via module pre-hooks.

    Module hooks fire on every ``__call__``, including the recompute ``torch.utils.checkpoint``
    runs in backward, so ``calls`` and ``recomputes`` are measured, not assumed.
    """

    def __init__(self, model):
        layers = model.model.layers
        unwrap = lambda m: getattr(m, "inner", m)  # noqa: E731  (checkpoint_mlp's wrapper)
        self.modules = {"layer": list(layers), "attn": [l.self_attn for l in layers],
                        "mlp": [unwrap(l.mlp) for l in layers]}
        self.calls = {part: [0] * len(layers) for part in self.modules}  # part -> calls per layer
        self._handles = []

    def __enter__(self):
        for part, mods in self.modules.items():
            for i, m in enumerate(mods):
                self._handles.append(m.register_forward_pre_hook(self._hook(part, i)))
        return self

    def _hook(self, part, i):
        def hook(module, args):
            self.calls[part][i] += 1
        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def recomputes(self) -> int:
        """Sublayer (attention, MLP) forward executions beyond the first one."""
        return sum(c - 1 for part in ("attn", "mlp") for c in self.calls[part] if c > 0)


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counting-only saved-tensor hooks: what autograd keeps for backward; nothing is moved.

    ``storages`` maps each distinct non-parameter storage to its bytes (views of one storage count
    once: that is the memory they hold); ``tensor_bytes`` is the per-tensor sum a naive copier
    moves (views and parameters included); ``param_saves`` counts saves of parameters (or views).
    Nested hooks do not stack: inside a checkpointed region ``torch.utils.checkpoint``'s own hooks
    win, so under checkpointing this counts what stays saved *outside* the recomputed regions.
    """

    def __init__(self, params=()):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}  # storage data_ptr -> nbytes
        self.tensors = self.tensor_bytes = self.param_saves = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.tensors += 1
        self.tensor_bytes += t.numel() * t.element_size()
        if t.layout == torch.strided:
            st = t.untyped_storage()  # pack returns t, so no counted storage dies and reuses its address
            if st.data_ptr() in self._param_ptrs:
                self.param_saves += 1
            elif st.nbytes():
                self.storages[st.data_ptr()] = st.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def bytes_at_least(self, n: int) -> int:
        """Bytes of the saved storages of at least ``n`` bytes (what an offloader skipping tiny ones moves)."""
        return sum(b for b in self.storages.values() if b >= n)


# --- one step, equality -----------------------------------------------------------------


def train_step(model, batch, saving=None) -> torch.Tensor:
    """``zero_grad``, forward (under ``saving``: saved-tensor hooks, or none), backward. No update."""
    model.zero_grad(set_to_none=True)
    with saving if saving is not None else contextlib.nullcontext():
        loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def probe(model, batch, device, saving=None) -> dict:
    """One step on ``batch`` for what the timed steps do not show.

    Returns the loss, the gradients (copied to the CPU), their total norm and finiteness (both
    computed on the device, in float64), forward calls per layer, recomputes, and
    ``held_after_forward``: live bytes (allocator on CUDA, tracked storages on the CPU) added
    between the start and the end of forward, i.e. what waits for backward.
    """
    model.zero_grad(set_to_none=True)
    with ForwardCounter(model) as fc, PeakMemory(device, resident=[model.parameters()]) as pm:
        pm.mark("start")
        with saving if saving is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        pm.mark("after_forward")
        loss.backward()
    gs = [p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64)
                                                 for g in gs if g is not None])).item()
    grads = [None if g is None else g.detach().to("cpu", copy=True) for g in gs]
    return dict(loss=loss.item(), grads=grads, grad_norm=norm, calls=fc.calls, recomputes=fc.recomputes,
                held_after_forward=pm.marks["after_forward"] - pm.marks["start"],
                finite=math.isfinite(loss.item()) and math.isfinite(norm))  # a NaN/inf anywhere makes the norm one


def compare(ref: dict, got: dict) -> dict:
    """Loss error (relative), gradient error (max over parameters of max|diff| / max|ref|), bitwise.

    A non-finite difference (a NaN or inf gradient, e.g. from a copy read before it finished) is an
    infinite error: it must never pass a tolerance (``max(0.0, nan)`` is 0.0 in Python).
    """
    finite = lambda x: x if math.isfinite(x) else math.inf  # noqa: E731
    loss_err = finite(abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30))
    bitwise, grad_err = loss_err == 0.0, 0.0
    for a, b in zip(got["grads"], ref["grads"]):
        if a is None or b is None:
            grad_err, bitwise = (grad_err, bitwise) if a is b else (math.inf, False)
            continue
        d = (a - b).abs().max().item()
        bitwise = bitwise and d == 0.0
        grad_err = max(grad_err, finite(d / (b.abs().max().item() or 1.0)))
    return dict(loss_error=loss_err, grad_error=grad_err, bitwise=bitwise,
                grad_norm_error=finite(abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)))


# Equality with the plain run: (loss, gradient) relative tolerances by device type.
TOL = {"cpu": (0.0, 0.0),  # CPU kernels are deterministic here: bitwise equality is required
       "cuda": (1e-6, 1e-4)}  # fp32 CUDA: a recompute may pick other kernels, backward may reassociate

# Decision rule, from ratios against the plain (resident) run of the same invocation:
#   reject  if loss or gradients are not finite or differ beyond TOL, or the peak drops by less than MIN_USEFUL_CUT;
#   accept  if the peak drops by at least MIN_PEAK_CUT at a median step time of at most MAX_TIME_RATIO x;
#   tune    otherwise: it saves memory, but too little or at too high a time cost.
MIN_PEAK_CUT = 0.20
MAX_TIME_RATIO = 1.50
MIN_USEFUL_CUT = 0.05


def decide(equal: bool, peak_cut: float, time_ratio: float) -> tuple[str, str | None]:
    """(decision, next step) by the rule above."""
    if not equal:
        return "reject", "loss or gradients differ from the plain run (or are not finite): find the wrong op or race"
    if peak_cut < MIN_USEFUL_CUT:
        return "reject", "the peak barely moves: the memory is not in the saved activations"
    if peak_cut >= MIN_PEAK_CUT and time_ratio <= MAX_TIME_RATIO:
        return "accept", None
    if peak_cut < MIN_PEAK_CUT:
        return "tune", "saves too little: cover more of the saved activations"
    return "tune", "saves memory but costs too much time: recompute or move less"


# --- measuring a candidate, planning ---------------------------------------------------

PROBE_BYTES_S = 0.5e9  # planning: float32 gradient bytes per second the probe copies to the host and compares


def schedule(device) -> tuple[int, int]:
    """(timed steps, leading warm-up steps excluded from median/P95)."""
    return (8, 2) if torch.device(device).type == "cuda" else (10, 2)


def estimate_seconds(w, factors, device) -> float:
    """Planning estimate (``bp_mech.workload.plan_seconds``): per candidate, its timed steps, the probe
    and one more pass (tracked on the CPU, counting in 42) at ``factor`` x a plain pass, plus the probe's
    gradient copy; one model build."""
    dev = torch.device(device).type
    passes, probe = schedule(dev)[0] + 2, param_count(w.arch) * 4 / PROBE_BYTES_S
    return round(PLAN_BUILD_S[dev] + sum(plan_seconds(w.arch, w.batch * w.seq, f * passes, dev) + probe
                                         for f in factors), 1)


def plan_modes(w, factors, **per_device) -> dict:
    """Steps and estimated seconds of ``--mode cpu`` and ``--mode real_gpu`` for workload ``w``."""
    out = {}
    for mode, dev in (("cpu", "cpu"), ("real_gpu", "cuda")):
        steps, warmup = schedule(dev)
        out[mode] = dict(steps=steps, warmup_excluded=warmup, estimated_seconds=estimate_seconds(w, factors, dev),
                         **{k: v(dev) for k, v in per_device.items()})
    return out


def release(model, device) -> None:
    """Drop gradients and cached blocks so each candidate's reserved peak is its own."""
    model.zero_grad(set_to_none=True)
    free(device)


def measure_candidate(model, batches, device, setup=contextlib.nullcontext, saving=None) -> dict:
    """Time ``schedule(device)`` steps, then probe, under ``setup()`` and the hooks ``saving``.

    The probe comes last so that it checks the steady state: warm caches and, for offload, a
    host pool whose buffers are being reused.
    """
    release(model, device)
    steps, warmup = schedule(device)
    with setup():
        stats = measure_steps(lambda i: train_step(model, batches[i % len(batches)], saving), steps,
                              warmup, device, resident=[model.parameters()])
        counter = SavedBytesCounter(model.parameters()) if saving is None else None
        out = probe(model, batches[0], device, counter or saving)
    out["stats"] = stats
    if counter is not None:
        out.update(saved_activation_bytes=counter.bytes, saved_tensors=counter.tensors)
    release(model, device)
    return out


def make_records(ctx, results: dict, baseline: str, extra=lambda name, r: ({}, {})) -> list:
    """One record per candidate from ``{name: (measurement, failure)}``; ratios against ``baseline``.

    ``extra(name, r)`` returns (record fields, metrics) that an experiment adds. Non-finite
    numbers are stored as null (records are strict JSON); ``all_finite`` says why.
    """
    base = results[baseline][0]
    tol = TOL[torch.device(ctx.device).type]
    recs = []
    for name, (r, failure) in results.items():
        if failure is not None:
            recs.append(ctx.record(name, failure=failure, memory_source=ctx.memory_source,
                                   next_step="does not fit: see the failure"))
            continue
        st = r["stats"]
        fields, metrics = extra(name, r)
        metrics = dict(loss=r["loss"], grad_norm=r["grad_norm"], forward_calls=r["calls"],
                       held_after_forward_bytes=r["held_after_forward"], step_samples_s=st.timing.samples,
                       tolerances=dict(loss=tol[0], grad=tol[1]), **metrics)
        for k in ("saved_activation_bytes", "saved_tensors"):
            if k in r:
                metrics[k] = r[k]
        cmp = decision = next_step = None
        if name != baseline and base is not None:
            cmp = compare(base, r)
            equal = r["finite"] and base["finite"] and cmp["loss_error"] <= tol[0] and cmp["grad_error"] <= tol[1]
            bst = base["stats"]
            peak_cut = 1 - st.peak_allocated / bst.peak_allocated
            ratio = st.timing.median_s / bst.timing.median_s
            decision, next_step = decide(equal, peak_cut, ratio)
            metrics.update(equal=equal, bitwise_equal=cmp["bitwise"], grad_norm_error=cmp["grad_norm_error"],
                           peak_cut=peak_cut, time_ratio=ratio, p95_ratio=st.timing.p95_s / bst.timing.p95_s)
        recs.append(ctx.record(
            name, output_error=json_safe(cmp and cmp["loss_error"]), grad_error=json_safe(cmp and cmp["grad_error"]),
            all_finite=r["finite"], peak_allocated=st.peak_allocated, peak_reserved=st.peak_reserved,
            step_median_s=st.timing.median_s, step_p95_s=st.timing.p95_s, warmup_excluded=st.timing.warmup_excluded,
            recompute_count=r["recomputes"], memory_source=st.memory_source, decision=decision,
            next_step=next_step, metrics=json_safe(metrics), **fields))
    return recs
