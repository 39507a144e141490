"""Part 02 · 43 — the ledger measured: one training step (the steady state by default), its storages tracked.

``LedgerObserver`` watches the one training step (``bench.step.train_step``) through its phases and
fills a ``Ledger`` (``bp_mech.ledger``) from the storages alive at each lifecycle stage, counted and
classified by the storage tracker (``instruments.tracking.StorageTracker``): it opens the tracker's phases,
marks the stages, names the logits/loss region (from the output head on, ``anatomy.output_head``: under the chunked loss that is
its ``ChunkedHead``) and the autograd nodes of that region, and promotes gradients and optimizer state
as they appear.

``Session`` builds a workload's model once (a ``Workload``'s Qwen2, or any causal LM Transformers builds from a
``ConfigWorkload``'s config) and gives the ledger of a step of any ``Strategy`` (``planner.definitions``):
real (``tracked-cpu``; on CUDA also read from the caching allocator, ``cuda-allocator``) or fake, under
``FakeTensorMode`` (``fake-tensor``: no memory allocated, the full qwen05 in seconds; what ``bp-mech plan`` traces).
"""

from __future__ import annotations

import contextlib

import torch

from bp_mech.instruments import anatomy
from bp_mech.planner import fake_ops
from bp_mech.planner.build import build
from bp_mech.instruments.counters import ForwardCounter
from bp_mech.planner.cuda_autocast import cuda_policy
from bp_mech.planner.definitions import STEADY, StepDefinition, StepLedger
from bp_mech.bench.step import StepState, optimizer_state, train_step
from bp_mech.bench.optimizer import StepOptions, make_optimizer
from bp_mech.bench.strategy import PLAIN, Strategy, enter
from bp_mech.instruments.tracking import StorageTracker
from bp_mech.ledger_table import CLASSES, STAGES, Counts, Ledger
from bp_mech.offload import OffloadConfig


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
    """The ledger's observer of ``train_step``: the tracker's phases and marks at each
    lifecycle point.

    Use it around one step (it hooks ``lm_head`` and the parameters while entered)::

        with tracker, LedgerObserver(tracker, model, opt) as observe:
            train_step(model, opt, batch, strategy, entered=entered,
                       observers=[observe])
    """

    def __init__(self, tr: StorageTracker, model, opt) -> None:
        self.tr, self.model, self.opt = tr, model, opt
        self.lm_input_node, self.graph_hooks, self.handles = None, [], []

    def __enter__(self) -> "LedgerObserver":
        def pre_hook(_mod, inputs):
            self.tr.region, self.lm_input_node = "loss", inputs[0].grad_fn

        head = anatomy.output_head(self.model)
        self.handles = [head.register_forward_pre_hook(pre_hook)]
        def relabel(p):
            self.tr.relabel(p.grad, "gradients")

        self.handles += [p.register_post_accumulate_grad_hook(relabel)
                         for p in self.model.parameters() if p.requires_grad]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles + self.graph_hooks:
            h.remove()
        self.handles, self.graph_hooks = [], []

    @contextlib.contextmanager
    def __call__(self, phase: str, state):
        tr, host = self.tr, state.entered.host_bytes
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
            # the nodes reach every AccumulateGrad, i.e. hold every parameter
            tr.loss_nodes = set()
            tr.mark("backward", host())
        elif phase == "optimizer":
            for t in optimizer_state(self.opt):
                tr.relabel(t, "optimizer_states")
        elif phase == "zero_grad":
            tr.mark("zero_grad", host())
            tr.start("idle")


def _add(tr: StorageTracker, tensors, label: str) -> None:
    for t in tensors:
        tr.add(t, label)


WARMUP_TRIES = 4  # AMP: a warm-up step the GradScaler skips (inf/NaN) allocates no AdamW state; retry


class Session:
    """One model with its AdamW and one batch, real or fake (``FakeTensorMode``: no memory allocated),
    whose ``ledger(strategy)`` is the ledger of one step of that strategy (by default the steady-state
    step); the model is built once.

    ``options``: AdamW implementation, offload threshold, learning rate, autocast policy (``StepOptions``,
    resolved for the device). Fake tensors run on the CPU; pass ``options.for_device("cuda")`` to estimate
    a GPU run (fused AdamW, CUDA's offload threshold, CUDA's autocast op lists: ``planner.cuda_autocast``).
    ``definition``: the step's definition (``planner.definitions.StepDefinition``); its ``weights`` are the
    session's (the model is built in that dtype), the rest may change per ``ledger`` call. A fake step
    cannot read values, so it is told what a real one finds out: the batch holds one sequence per row
    (Transformers' packed-sequence check, which would otherwise build a (B, 1, T, T) mask where the real
    step lets SDPA apply the causal mask itself), and its GradScaler is off.
    """

    def __init__(self, w, device="cpu", fake: bool = False, options: StepOptions = StepOptions(),
                 definition: StepDefinition = STEADY, prepare=None, tracker=StorageTracker):
        """``prepare``: None, or ``prepare(model) -> model`` applied (under the session's mode) right after the
        model is built, before its optimizer is made (``planner.shard``: ``fully_shard`` or DDP). ``tracker``:
        the storage tracker's class, called with the device for each step (``planner.shard_tracking.ShardTracker``
        sees through DTensors and FSDP's storage resizes)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake, self.device = fake, torch.device("cpu" if fake else device)
        self.options, self.definition = options.for_device(self.device), definition
        self.mode = FakeTensorMode() if fake else None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}  # AdamW implementation -> its steady optimizer
        self.tracker = tracker  # the storage tracker's class (StorageTracker's interface)
        with self.active():
            self.model, self.batch = build(w, self.device, fake, definition.weights)
            self.model = self.model if prepare is None else prepare(self.model)
            self.load_alloc = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        self.dtype = next(self.model.parameters()).dtype

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The session's steady optimizer, made when first asked for (a plan that extrapolates in depth
        never steps the full-depth session: 70B on 8 fake ranks spent most of its session here)."""
        return self.optimizer(self.definition.adamw or self.options.adamw)

    def optimizer(self, impl: str):
        """The session's optimizer (``options.optimizer``: AdamW unless told otherwise) of implementation
        ``impl``, made once over the parameters that train; a fake one has its state already (one update on
        zero gradients: its shape does not depend on the gradients)."""
        if impl not in self.optimizers:
            with self.active():
                opt = self.optimizers[impl] = make_optimizer(self.model.parameters(), self.options, self.device, impl)
                if self.fake:  # (frozen parameters get no gradient and no state)
                    for p in self.model.parameters():
                        if p.requires_grad:
                            p.grad = torch.zeros_like(p)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        return self.optimizers[impl]

    @contextlib.contextmanager
    def tracking(self, tracker):
        """Steps inside tracked by ``tracker`` (a class, or a callable of the device), the session's own after."""
        before, self.tracker = self.tracker, tracker
        try:
            yield self
        finally:
            self.tracker = before

    def active(self):
        """The session's mode: ``FakeTensorMode`` and ``planner.fake_ops.patched()`` when fake, else nothing."""
        stack = contextlib.ExitStack()
        if self.fake:
            stack.enter_context(self.mode)
            stack.enter_context(fake_ops.patched())
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

    def ledger(self, s: Strategy = PLAIN, definition: StepDefinition | None = None) -> Ledger:
        """The ledger of one step of ``s`` under ``definition`` (None: the session's): ``step(...).ledger``."""
        return self.step(s, definition).ledger

    def step(self, s: Strategy = PLAIN, definition: StepDefinition | None = None) -> StepLedger:
        """One step of ``s`` under ``definition`` (None: the session's), tracked: its ``StepLedger``.

        The steady state (``moments="resident"``): warm-up updates under the same strategy first, until
        AdamW's moments exist (an AMP step the GradScaler skips allocates none); with fake tensors, whose
        steps leave nothing else behind, none: the session made the moments with one update on zero
        gradients. The first step: a new AdamW, whose update allocates them. Forward and backward only: no
        optimizer (its ledger's optimizer stage is the backward's end; ``zero_grad`` drops the gradients).
        With ``keep_outputs`` in the steady state, the last step's outputs are alive at the start (under
        fake tensors: those of a forward without autograd on the last micro-batch). ``Ledger.updates`` counts the updates with the measured
        one, ``skipped`` the skipped ones."""
        d = self.definition if definition is None else definition
        if d.weights != self.definition.weights:
            raise ValueError(f"the session's weights are {self.dtype}: build a Session with weights={d.weights!r}")
        model, batch, device = self.model, self.batch, self.device
        resident = d.moments == "resident"
        scaler = torch.amp.GradScaler(device.type, enabled=False) if self.fake else None
        off = OffloadConfig(min_bytes=self.options.offload_min_bytes)
        emulate = s.amp is not None and self.options.autocast == "cuda" and device.type != "cuda"
        with self.active():
            impl = d.adamw or self.options.adamw
            opt = None if d.moments == "none" else self.optimizer(impl) if resident else \
                make_optimizer(model.parameters(), self.options, device, impl)
        held = [] if d.keep_outputs else None  # the outputs a training loop's ``out`` holds
        with self.active(), cuda_policy() if emulate else contextlib.nullcontext(), \
                enter(model, s, device, off, scaler) as ctx:
            count = dict(updates=int(self.fake and resident), skipped=0)  # (fake: the session's moment update)
            if self.fake and ctx.offload is not None:
                self._uncached_hooks(ctx.offload)

            def update(observers=()):
                r = train_step(model, opt, batch, s, entered=ctx, observers=observers, update=opt is not None,
                               outputs=held)
                if opt is None:  # no optimizer: the gradients are dropped as zero_grad would
                    with contextlib.ExitStack() as stack:
                        for observe in observers:
                            stack.enter_context(observe("zero_grad", StepState(model, None, s, ctx)))
                        model.zero_grad(set_to_none=True)
                count["updates"] += int(opt is not None)
                count["skipped"] += int(opt is not None and not r.applied)
                return r.loss

            for _ in range(WARMUP_TRIES if resident and not self.fake else 0):
                update()
                if opt.state:
                    break
            if resident and self.fake and d.keep_outputs:  # the last step's outputs, alive at the start
                with ctx.micro_batches(batch) as micro, torch.no_grad(), ctx.forward():
                    held[:] = [model(**micro[-1])]  # (its loss's graph is gone, as after a backward)
            tr = self.tracker(device)
            for t in [*model.parameters(), *model.buffers()]:
                tr.add(t, "parameters")
            tr.mark("load")
            for t in optimizer_state(opt) if opt is not None else ():
                tr.add(t, "optimizer_states")
            for t in batch.values():
                tr.add(t, "other")
            _add(tr, [t for out in held or () for t in out.values()], "logits_loss")  # (no name left on them)
            start = tr.current
            with tr, LedgerObserver(tr, model, opt) as observe, ForwardCounter(model) as calls:
                loss = update([observe])
            finite = None if self.fake else bool(torch.isfinite(loss).all())
            attn, mlp = sum(calls.calls["attn"]), sum(calls.calls["mlp"])  # forwards of each, recomputes included
            extra = sum(c - s.micro_batches for part in ("attn", "mlp") for c in calls.calls[part] if c)
            counts = Counts(recomputes=extra, attn_calls=attn,
                            mlp_calls=mlp, d2h_bytes=ctx.d2h_bytes, h2d_bytes=ctx.h2d_bytes)
            scaled = ctx.scaler.is_enabled()
        snaps = {x: tr.marks[x][1] for x in ("load", "forward", "backward", "zero_grad")}
        snaps.update(backward_peak=tr.peaks["backward"][1],
                     optimizer_peak=tr.peaks["optimizer"][1] if opt is not None else tr.marks["backward"][1])
        if self.load_alloc is not None:
            tr.allocator["load"] = self.load_alloc
        source = "fake-tensor" if self.fake else ("cuda-allocator" if device.type == "cuda" else "tracked-cpu")
        led = Ledger(source, s.name, {x: tr.classify(snaps[x], CLASSES) for x in STAGES},
                     host={x: tr.marks[x][2] for x in tr.marks}, forward_peak=tr.peaks["forward"][0],
                     allocator=dict(tr.allocator), finite=finite, updates=count["updates"],
                     skipped=count["skipped"] if scaled else None,
                     rounded={x: sum(-(-tr.nbytes[n] // 512) * 512 for n in snaps[x]) for x in STAGES}, counts=counts)
        return StepLedger(led, d, start, tuple(tr.timeline))


def track(w, s: Strategy = PLAIN, device="cpu", fake: bool = False, options: StepOptions = StepOptions(),
          definition: StepDefinition = STEADY) -> Ledger:
    """Ledger of one step of ``w`` (a ``Workload`` or a ``ConfigWorkload``) under strategy ``s`` and
    ``definition`` (default: the steady state), on a fresh ``Session``: real tensors, or fake ones
    (``fake=True``: no memory is allocated, so the full qwen05 fits on any CPU in seconds)."""
    return Session(w, device, fake, options, definition).ledger(s)
