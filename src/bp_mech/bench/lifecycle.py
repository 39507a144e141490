"""Part 02 · 43 — the ledger measured: one steady-state training step, its storages tracked.

``LedgerObserver`` watches the one training step (``bench.step.train_step``) through its phases and
fills a ``Ledger`` (``bp_mech.ledger``) from the storages alive at each lifecycle stage, counted and
classified by the storage tracker (``bench.tracking.StorageTracker``): it opens the tracker's phases,
marks the stages, names the logits/loss region (from ``lm_head`` on: under the chunked loss that is
its ``ChunkedHead``) and the autograd nodes of that region, and promotes gradients and optimizer state
as they appear.

``Session`` builds a workload's model once, with its AdamW, real or fake, and gives the ledger of a
steady-state step of any ``Strategy``:

* ``fake=False``: real tensors; storages tracked on the CPU (memory source ``tracked-cpu``) or, on
  CUDA, tracked *and* read from the caching allocator beside them (``cuda-allocator``);
* ``fake=True``: the same step under ``FakeTensorMode`` (no memory is allocated, so the full qwen05
  runs on any CPU in seconds): the estimate (``fake-tensor``), what ``bp-mech plan`` traces.

The model is a ``Workload``'s Qwen2 or, for a ``ConfigWorkload``, any causal LM that Transformers builds
from its config (``AutoModelForCausalLM.from_config``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch

from bp_mech.bench.counters import ForwardCounter
from bp_mech.bench.step import StepOptions, make_optimizer, optimizer_state, train_step
from bp_mech.bench.strategy import PLAIN, Strategy, applied
from bp_mech.bench.tracking import StorageTracker
from bp_mech.ledger import CLASSES, STAGES, Counts, Ledger
from bp_mech.offload import OffloadConfig


@dataclass(frozen=True)
class ConfigWorkload:
    """A model given by its Transformers config, at one batch shape (what ``bp-mech plan`` traces)."""

    config: object  # a transformers PretrainedConfig of a causal LM (AutoModelForCausalLM.from_config builds it)
    batch: int  # sequences per batch (B)
    seq: int  # tokens per sequence (T)
    dtype: str = "float32"  # master weights
    seed: int = 0  # random init and token ids (real runs)


def _walk_graph(loss: torch.Tensor, lm_input_node, tr: StorageTracker) -> list:
    """Mark the autograd nodes between the loss and lm_head's input as the logits/loss part, and
    hook every node that sends a gradient to a parameter: what it sends is a gradient from then
    on (a tied weight's first gradient waits in the engine's input buffer for the second one).
    Returns the hook handles."""
    seen, todo, handles = set(), [(loss.grad_fn, True)], []
    while todo:
        n, in_loss = todo.pop()
        if n is None or n in seen or type(n).__name__ == "AccumulateGrad":
            continue
        seen.add(n)
        in_loss = in_loss and n is not lm_input_node
        if in_loss:
            tr.loss_nodes.add(n)
        to_param = [i for i, (f, _) in enumerate(n.next_functions) if type(f).__name__ == "AccumulateGrad"]
        if to_param:
            def hook(grads_in, _grads_out, idx=tuple(to_param)):
                for i in idx:
                    tr.relabel(grads_in[i], "gradients")
            handles.append(n.register_hook(hook))
        todo.extend((f, in_loss) for f, _ in n.next_functions)
    return handles


class LedgerObserver:
    """The ledger's observer of ``train_step``: the tracker's phases and marks at each lifecycle point.

    Use it around one step (it hooks ``lm_head`` and the parameters while entered)::

        with tracker, LedgerObserver(tracker, model, opt) as observe:
            train_step(model, opt, batch, strategy, applied=entered, observers=[observe])
    """

    def __init__(self, tr: StorageTracker, model, opt) -> None:
        self.tr, self.model, self.opt = tr, model, opt
        self.lm_input_node, self.graph_hooks, self.handles = None, [], []

    def __enter__(self) -> "LedgerObserver":
        def pre_hook(_mod, inputs):
            self.tr.region, self.lm_input_node = "loss", inputs[0].grad_fn

        self.handles = [self.model.lm_head.register_forward_pre_hook(pre_hook)]
        self.handles += [p.register_post_accumulate_grad_hook(lambda p: self.tr.relabel(p.grad, "gradients"))
                         for p in self.model.parameters() if p.requires_grad]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles + self.graph_hooks:
            h.remove()
        self.handles, self.graph_hooks = [], []

    @contextlib.contextmanager
    def __call__(self, phase: str, state):
        tr, host = self.tr, state.applied.host_bytes
        tr.start(phase)
        yield
        if phase == "forward":
            tr.end_forward()
            tr.mark("forward", host())
            self.graph_hooks = _walk_graph(state.loss, self.lm_input_node, tr)
        elif phase == "backward":
            for h in self.graph_hooks:
                h.remove()
            self.graph_hooks = []
            tr.loss_nodes = set()  # the nodes reach every AccumulateGrad, i.e. hold every parameter
            tr.mark("backward", host())
        elif phase == "optimizer":
            for t in optimizer_state(self.opt):
                tr.relabel(t, "optimizer_states")
        elif phase == "zero_grad":
            tr.mark("zero_grad", host())
            tr.start("idle")


def _build(w, device, fake: bool):
    """(model, batch) on ``device``: the real workload (a ``Workload``'s own model and text; a
    ``ConfigWorkload``'s random init from ``w.seed`` and random byte-range token ids), or a fake twin."""
    from transformers import AutoModelForCausalLM

    from bp_mech.bench.workload import build_model, make_batches, qwen2_config

    if not fake and not isinstance(w, ConfigWorkload):
        return build_model(w, device), make_batches(w, 1, device=device)[0]
    config = w.config if isinstance(w, ConfigWorkload) else qwen2_config(w.arch)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, w.dtype))  # (.to() cannot swap fake parameters)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(w.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, w.dtype),
                                                     attn_implementation="sdpa").train()
            ids = torch.randint(0, min(256, config.vocab_size), (w.batch, w.seq), device=device)
    finally:
        torch.set_default_dtype(prev)
    model.config.use_cache = False
    return (model if fake else model.to(device)), {"input_ids": ids, "labels": ids.clone()}


WARMUP_TRIES = 4  # AMP: a warm-up step the GradScaler skips (inf/NaN) allocates no AdamW state; retry


class Session:
    """One model with its AdamW and one batch, real or fake (``FakeTensorMode``: no memory allocated),
    whose ``ledger(strategy)`` is the ledger of a steady-state step of that strategy; the model is built
    once.

    ``options``: AdamW implementation, offload threshold, learning rate (``StepOptions``, resolved for the
    device). Fake tensors run on the CPU; pass ``options.for_device("cuda")`` to estimate a GPU run (fused
    AdamW, CUDA's offload threshold). A fake step cannot read values, so it is told what a real one finds
    out: the batch holds one sequence per row (Transformers' packed-sequence check, which would otherwise
    build a (B, 1, T, T) mask where the real step lets SDPA apply the causal mask itself), and its
    GradScaler is off.
    """

    def __init__(self, w, device="cpu", fake: bool = False, options: StepOptions = StepOptions()):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake, self.device = fake, torch.device("cpu" if fake else device)
        self.options = options.for_device(self.device)
        self.mode = FakeTensorMode() if fake else None
        with self.active():
            self.model, self.batch = _build(w, self.device, fake)
            self.load_alloc = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
            self.opt = make_optimizer(self.model.parameters(), self.options, self.device)
            if fake:  # AdamW's moments without a warm-up step: their shape does not depend on the gradients
                for p in self.model.parameters():
                    p.grad = torch.zeros_like(p)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)

    def active(self):
        """The session's mode: ``FakeTensorMode`` (and the packed-sequence check off) when fake, else nothing."""
        stack = contextlib.ExitStack()
        if self.fake:
            from transformers import masking_utils

            stack.enter_context(self.mode)
            stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None))
        return stack

    def _uncached_hooks(self, hooks) -> None:
        """The fake dispatch cache's keys hold the storages an op was given, so those the offload's hooks
        view with ``set_`` would never be freed: its hooks run with the cache off (the rest keeps it)."""
        def uncached(fn):
            def run(*args):
                self.mode.cache_enabled = False
                try:
                    return fn(*args)
                finally:
                    self.mode.cache_enabled = True
            return run
        hooks.pack_hook, hooks.unpack_hook = uncached(hooks.pack_hook), uncached(hooks.unpack_hook)

    def ledger(self, s: Strategy = PLAIN) -> Ledger:
        """The ledger of one steady-state step of ``s``. Warm-up updates under the same strategy first,
        until AdamW's moments exist (an AMP step the GradScaler skips allocates none); with fake tensors,
        whose steps leave nothing else behind, none: the session made the moments with one update on zero
        gradients. ``Ledger.updates`` counts them with the measured one, ``skipped`` the skipped ones."""
        model, opt, batch, device = self.model, self.opt, self.batch, self.device
        scaler = torch.amp.GradScaler(device.type, enabled=False) if self.fake else None
        off = OffloadConfig(min_bytes=self.options.offload_min_bytes)
        with self.active(), applied(model, s, device, off, scaler) as ctx:
            count = dict(updates=int(self.fake), skipped=0)  # (fake: the session's update that made the moments)
            if self.fake and ctx.offload is not None:
                self._uncached_hooks(ctx.offload)

            def update(observers=()):
                r = train_step(model, opt, batch, s, applied=ctx, observers=observers)
                count["updates"] += 1
                count["skipped"] += int(not r.applied)
                return r.loss

            for _ in range(WARMUP_TRIES if not self.fake else 0):
                update()
                if opt.state:
                    break
            tr = StorageTracker(device)
            for t in [*model.parameters(), *model.buffers()]:
                tr.add(t, "parameters")
            tr.mark("load")
            for t in optimizer_state(opt):
                tr.add(t, "optimizer_states")
            for t in batch.values():
                tr.add(t, "other")
            with tr, LedgerObserver(tr, model, opt) as observe, ForwardCounter(model) as calls:
                loss = update([observe])
            finite = None if self.fake else bool(torch.isfinite(loss).all())
            attn, mlp = sum(calls.calls["attn"]), sum(calls.calls["mlp"])  # forwards of each, recomputes included
            counts = Counts(recomputes=attn + mlp - 2 * s.micro_batches * len(calls.calls["attn"]), attn_calls=attn,
                            mlp_calls=mlp, d2h_bytes=ctx.d2h_bytes, h2d_bytes=ctx.h2d_bytes)
            scaled = ctx.scaler.is_enabled()
        snaps = {x: tr.marks[x][1] for x in ("load", "forward", "backward", "zero_grad")}
        snaps.update(backward_peak=tr.peaks["backward"][1], optimizer_peak=tr.peaks["optimizer"][1])
        if self.load_alloc is not None:
            tr.allocator["load"] = self.load_alloc
        source = "fake-tensor" if self.fake else ("cuda-allocator" if device.type == "cuda" else "tracked-cpu")
        return Ledger(source, s.name, {x: tr.classify(snaps[x], CLASSES) for x in STAGES},
                      host={x: tr.marks[x][2] for x in tr.marks}, forward_peak=tr.peaks["forward"][0],
                      allocator=dict(tr.allocator), finite=finite, updates=count["updates"],
                      skipped=count["skipped"] if scaled else None,
                      rounded={x: sum(-(-tr.nbytes[n] // 512) * 512 for n in snaps[x]) for x in STAGES}, counts=counts)


def track(w, s: Strategy = PLAIN, device="cpu", fake: bool = False, options: StepOptions = StepOptions()) -> Ledger:
    """Ledger of one steady-state step of ``w`` (a ``Workload`` or a ``ConfigWorkload``) under strategy ``s``,
    on a fresh ``Session``: real tensors, or fake ones (``fake=True``: no memory is allocated, so the full
    qwen05 fits on any CPU in seconds)."""
    return Session(w, device, fake, options).ledger(s)
