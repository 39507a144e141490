"""Part 02 · 43 — the ledger measured: one steady-state training step, its storages tracked.

``track`` runs one steady-state training step of a workload and fills a ``Ledger``
(``bp_mech.ledger``) from the storages alive at each lifecycle stage, counted and classified by
the package's storage tracker (``bp_mech.bench.tracking.StorageTracker``). The strategies are the book's
own mechanisms, so a word means one thing everywhere: checkpointing is
``bp_mech.checkpointing.configure`` (Part 02 · 19), offload is ``bp_mech.offload.ActivationOffload``
(Part 02 · 42) and AdamW is ``bp_mech.bench.workload.make_adamw``'s, as in the GPU runs (fused on CUDA,
foreach on the CPU).

* ``fake=False``: real tensors; storages tracked on the CPU (memory source ``tracked-cpu``)
  or, on CUDA, tracked *and* read from the caching allocator beside them (``cuda-allocator``);
* ``fake=True``: the same step under ``FakeTensorMode`` (no memory is allocated, so the full
  qwen05 runs on any CPU in seconds): the estimate (``fake-tensor``).

The step is ``bp_mech.bench.strategy.train_step``, so any ``Strategy`` (combinations included) is measured as
projects 74 and 76 and ``bp-mech plan`` run it; a ``LedgerConfig`` names one of the chapter's five
(``as_strategy``). ``train_step`` here adds the lifecycle marks: it opens the tracker's phases (forward,
backward, optimizer, zero_grad), marks the stages, names the logits/loss region (from ``lm_head`` on:
under the chunked loss that is its ``ChunkedHead``) and the autograd nodes of that region, and promotes
gradients and optimizer state as they appear.

The model is a ``Workload``'s Qwen2 or, for a ``ConfigWorkload``, any causal LM that Transformers
builds from its config (``AutoModelForCausalLM.from_config``: Qwen2, Llama, Mistral, Phi3, ...).
``Session`` builds it once with its optimizer and moments, so that ``bp-mech plan`` measures many
strategies on one fake model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch

from bp_mech.bench import strategy as strategies
from bp_mech.bench.counters import ForwardCounter
from bp_mech.ledger import CLASSES, STAGES, Ledger, LedgerConfig
from bp_mech.offload import ActivationOffload, OffloadConfig
from bp_mech.bench.strategy import Strategy
from bp_mech.bench.tracking import StorageTracker


@dataclass(frozen=True)
class ConfigWorkload:
    """A model given by its Transformers config, at one batch shape (what ``bp-mech plan`` traces)."""

    config: object  # a transformers PretrainedConfig of a causal LM (AutoModelForCausalLM.from_config builds it)
    batch: int  # sequences per batch (B)
    seq: int  # tokens per sequence (T)
    dtype: str = "float32"  # master weights
    seed: int = 0  # random init and token ids (real runs)


def as_strategy(cfg: LedgerConfig) -> Strategy:
    """The ``Strategy`` a ledger configuration names (checkpoint: every layer; amp: ``cfg.amp_dtype``)."""
    return Strategy(checkpoint=cfg.checkpoint, offload=cfg.strategy == "offload",
                    amp=cfg.amp_dtype if cfg.strategy == "amp" else None,
                    micro_batches=cfg.micro_batches if cfg.strategy == "accumulation" else 1)


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


def offload_hooks(model, cfg: LedgerConfig, device) -> ActivationOffload:
    """Part 02 · 42's offload for the ledger: ``min_bytes`` from ``cfg`` (``offload.min_bytes(device)``
    unless set). Its pool is reused across steps, so a steady-state step allocates no host memory. It
    tells storages apart by identity, so the same class runs under fake tensors (the estimate)."""
    return ActivationOffload(model.parameters(), OffloadConfig(min_bytes=cfg.for_device(device).offload_min_bytes),
                             device)


def train_step(model, opt, batch: dict, cfg: LedgerConfig | Strategy, tr: StorageTracker, scaler=None,
               hooks=None, ctx: strategies.Applied | None = None) -> torch.Tensor:
    """One update of ``strategy.train_step`` with the tracker's phases and marks; zero_grad is the step's
    last act (the ledger's last stage), so the next step starts with no gradients. ``ctx``: the
    strategy already entered on the model (``strategy.applied``, as ``track`` does); None enters it for
    this step, with ``hooks`` (``offload_hooks``) as its offload if given. Returns the update's loss."""
    s = cfg if isinstance(cfg, Strategy) else as_strategy(cfg)
    if ctx is None:
        off = None if isinstance(cfg, Strategy) else OffloadConfig(min_bytes=cfg.for_device(tr.device).offload_min_bytes)
        with strategies.applied(model, s, tr.device, off) as entered:
            if s.offload != (hooks is not None):
                raise ValueError(f"strategy {s.name!r} with offload hooks {hooks!r}: offload needs them, the rest none")
            entered.offload = hooks if hooks is not None else entered.offload
            return train_step(model, opt, batch, s, tr, scaler, ctx=entered)
    lm_in, graph_hooks = {}, []

    def pre_hook(_mod, inputs):
        tr.region, lm_in["node"] = "loss", inputs[0].grad_fn

    def events(name, *args):
        if name in ("forward", "backward", "optimizer"):
            tr.start(name)
        elif name == "forward_end":
            tr.end_forward()
            tr.mark("forward", ctx.host_bytes())
            graph_hooks[:] = _walk_graph(args[0], lm_in["node"], tr)
        elif name == "backward_end":
            for h in graph_hooks:
                h.remove()
            tr.loss_nodes = set()  # the nodes reach every AccumulateGrad, i.e. hold every parameter
            tr.mark("backward", ctx.host_bytes())
        elif name == "optimizer_end":
            for state in opt.state.values():
                for v in state.values():
                    tr.relabel(v, "optimizer_states")

    handles = [model.lm_head.register_forward_pre_hook(pre_hook)]
    handles += [p.register_post_accumulate_grad_hook(lambda p: tr.relabel(p.grad, "gradients"))
                for p in model.parameters() if p.requires_grad]
    try:
        loss = strategies.train_step(model, opt, batch, s, scaler, ctx=ctx, events=events)
        tr.start("zero_grad")
        opt.zero_grad(set_to_none=True)
        tr.mark("zero_grad", ctx.host_bytes())
        tr.start("idle")
    finally:
        for h in handles:
            h.remove()
    return loss


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


def make_optimizer(params, cfg: LedgerConfig, device):
    """AdamW of flavour ``cfg.for_device(device).adamw``: by default ``workload.make_adamw``'s for the
    device (fused on CUDA, foreach on the CPU), the AdamW of the GPU runs of 11, 19, 42 and AMP; another
    flavour only when asked for (a fake-tensor estimate of a GPU run asks for the fused one)."""
    from bp_mech.bench.workload import make_adamw

    flavour = cfg.for_device(device).adamw
    if flavour == LedgerConfig().for_device(device).adamw:
        return make_adamw(params, cfg.lr, device)
    return torch.optim.AdamW(params, lr=cfg.lr, **{flavour: True})


class Session:
    """One model with its AdamW and one batch, real or fake (``FakeTensorMode``: no memory allocated),
    on which ``measure`` runs steady-state steps of any strategy; the model is built once.

    ``options``: AdamW flavour, offload threshold and learning rate (a ``LedgerConfig``, resolved for
    the device; its ``strategy`` is not used). Fake tensors run on the CPU; pass
    ``options.for_device("cuda")`` to estimate a GPU run (fused AdamW, CUDA's offload threshold).
    A fake step cannot read values, so it is told what a real one finds out: the batch holds one
    sequence per row (Transformers' packed-sequence check, which would otherwise build a (B, 1, T, T)
    mask where the real step lets SDPA apply the causal mask itself), and its GradScaler is off.
    """

    def __init__(self, w, device="cpu", fake: bool = False, options: LedgerConfig = LedgerConfig()):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake, self.device = fake, torch.device("cpu" if fake else device)
        self.options = options.for_device(self.device)
        self.mode = FakeTensorMode() if fake else None
        with self._active():
            self.model, self.batch = _build(w, self.device, fake)
            self.load_alloc = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
            self.opt = make_optimizer(self.model.parameters(), self.options, self.device)
            if fake:  # AdamW's moments without a warm-up step: their shape does not depend on the gradients
                for p in self.model.parameters():
                    p.grad = torch.zeros_like(p)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)

    def _active(self):
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

    def measure(self, cfg: LedgerConfig | Strategy) -> Ledger:
        """The ledger of one steady-state step of ``cfg``. Warm-up updates under the same strategy first,
        until AdamW's moments exist (an AMP step the GradScaler skips allocates none); with fake tensors,
        whose steps leave nothing else behind, none: the session made the moments with one update on zero
        gradients. ``Ledger.updates`` counts them with the measured one, ``skipped`` the skipped ones."""
        s = cfg if isinstance(cfg, Strategy) else as_strategy(cfg)
        model, opt, batch, device = self.model, self.opt, self.batch, self.device
        with self._active(), strategies.applied(model, s, device, OffloadConfig(min_bytes=self.options.offload_min_bytes)) as ctx:
            scaler = torch.amp.GradScaler(device.type, enabled=False) if self.fake else ctx.scaler
            count = dict(updates=int(self.fake), skipped=0)  # (fake: the session's update that made the moments)
            if self.fake and ctx.offload is not None:
                self._uncached_hooks(ctx.offload)

            def update(tracker):  # one train_step; a step the GradScaler skips (inf/NaN) lowers its scale
                scale = scaler.get_scale()
                loss = train_step(model, opt, batch, s, tracker, scaler, ctx=ctx)
                count["updates"] += 1
                count["skipped"] += int(scaler.is_enabled() and scaler.get_scale() < scale)
                return loss

            for _ in range(WARMUP_TRIES if not self.fake else 0):
                update(StorageTracker(device))
                if opt.state:
                    break
            tr = StorageTracker(device)
            for t in [*model.parameters(), *model.buffers()]:
                tr.add(t, "parameters")
            tr.mark("load")
            for t in (v for state in opt.state.values() for v in state.values()):
                tr.add(t, "optimizer_states")
            for t in batch.values():
                tr.add(t, "other")
            with tr, ForwardCounter(model) as calls:
                loss = update(tr)
            finite = None if self.fake else bool(torch.isfinite(loss).all())
            attn, mlp = sum(calls.calls["attn"]), sum(calls.calls["mlp"])  # forwards of each, recomputes included
            counts = dict(recomputes=attn + mlp - 2 * s.micro_batches * len(calls.calls["attn"]), attn_calls=attn,
                          mlp_calls=mlp, d2h_bytes=ctx.d2h_bytes, h2d_bytes=ctx.h2d_bytes)
        snaps = {x: tr.marks[x][1] for x in ("load", "forward", "backward", "zero_grad")}
        snaps.update(backward_peak=tr.peaks["backward"][1], optimizer_peak=tr.peaks["optimizer"][1])
        if self.load_alloc is not None:
            tr.allocator["load"] = self.load_alloc
        source = "fake-tensor" if self.fake else ("cuda-allocator" if device.type == "cuda" else "tracked-cpu")
        return Ledger(source, s.name if isinstance(cfg, Strategy) else cfg.strategy,
                      {x: tr.classify(snaps[x], CLASSES) for x in STAGES},
                      host={x: tr.marks[x][2] for x in tr.marks}, forward_peak=tr.peaks["forward"][0],
                      allocator=dict(tr.allocator), finite=finite, updates=count["updates"],
                      skipped=count["skipped"] if scaler.is_enabled() else None,
                      rounded={x: sum(-(-tr.nbytes[n] // 512) * 512 for n in snaps[x]) for x in STAGES}, counts=counts)


def track(w, cfg: LedgerConfig | Strategy = LedgerConfig(), device="cpu", fake: bool = False,
          options: LedgerConfig | None = None) -> Ledger:
    """Ledger of one steady-state step of ``w`` (a ``Workload`` or a ``ConfigWorkload``) under ``cfg``: a
    ``LedgerConfig`` (one of the chapter's strategies, with its settings) or any ``Strategy``, whose
    settings come from ``options`` (default ``LedgerConfig()``). Real tensors, or fake ones (``fake=True``:
    no memory is allocated, so the full qwen05 fits on any CPU in seconds), on a fresh ``Session``."""
    if options is None:
        options = cfg if isinstance(cfg, LedgerConfig) else LedgerConfig()
    return Session(w, device, fake, options).measure(cfg)
