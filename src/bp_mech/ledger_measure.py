"""Part 02 · 43 — the ledger measured: one steady-state training step, its storages tracked.

``track`` runs one steady-state training step of a workload and fills a ``Ledger``
(``bp_mech.ledger``) from the storages alive at each lifecycle stage, counted and classified by
the package's storage tracker (``bp_mech.tracking.StorageTracker``). The strategies are the book's
own mechanisms, so a word means one thing everywhere: checkpointing is
``bp_mech.checkpointing.configure`` (Part 02 · 19), offload is ``bp_mech.offload.ActivationOffload``
(Part 02 · 42) and AdamW is ``bp_mech.workload.make_adamw``'s, as in the GPU runs (fused on CUDA,
foreach on the CPU).

* ``fake=False``: real tensors; storages tracked on the CPU (memory source ``tracked-cpu``)
  or, on CUDA, tracked *and* read from the caching allocator beside them (``cuda-allocator``);
* ``fake=True``: the same step under ``FakeTensorMode`` (no memory is allocated, so the full
  qwen05 runs on any CPU in seconds): the estimate (``fake-tensor``).

``train_step`` is the step with its lifecycle marks: it opens the tracker's phases (forward,
backward, optimizer, zero_grad), marks the stages, names the logits/loss region (from ``lm_head``
on) and the autograd nodes of that region, and promotes gradients and optimizer state as they
appear.
"""

from __future__ import annotations

import contextlib

import torch

from bp_mech import checkpointing
from bp_mech.ledger import CLASSES, STAGES, Ledger, LedgerConfig
from bp_mech.offload import ActivationOffload, OffloadConfig
from bp_mech.tracking import StorageTracker


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


def train_step(model, opt, batch: dict, cfg: LedgerConfig, tr: StorageTracker, scaler=None, hooks=None) -> torch.Tensor:
    """One update of ``cfg.strategy``: zero_grad is the previous step's last act, so the step starts
    with no gradients. Checkpointing is configured on the model beforehand (``track``); ``hooks`` are
    the offload's saved-tensor hooks (``offload_hooks``), entered around each forward. Calls
    ``tr.start``/``tr.mark`` at the lifecycle stages. Returns the (summed) loss."""
    device = next(model.parameters()).device
    k = cfg.micro_batches if cfg.strategy == "accumulation" else 1
    B = batch["input_ids"].shape[0]
    if B % k:
        raise ValueError(f"accumulation needs micro_batches ({k}) to divide the batch ({B})")
    if (cfg.strategy == "offload") != (hooks is not None):
        raise ValueError(f"strategy {cfg.strategy!r} with offload hooks {hooks!r}: offload needs them, the rest none")
    host = (lambda: hooks.pool.in_use) if hooks is not None else (lambda: 0)  # bytes of offloaded copies held
    lm_in = {}

    def pre_hook(_mod, inputs):
        tr.region, lm_in["node"] = "loss", inputs[0].grad_fn

    handles = [model.lm_head.register_forward_pre_hook(pre_hook)]
    handles += [p.register_post_accumulate_grad_hook(lambda p: tr.relabel(p.grad, "gradients"))
                for p in model.parameters() if p.requires_grad]
    losses = []
    try:
        for i in range(k):
            mb = {n: v[i * B // k:(i + 1) * B // k] for n, v in batch.items()}  # (B/k, T) views
            tr.start("forward")
            amp = torch.autocast(device.type, dtype=getattr(torch, cfg.amp_dtype), enabled=cfg.strategy == "amp")
            with hooks if hooks is not None else contextlib.nullcontext(), amp:  # no padding: the causal
                # mask is None (SDPA's is_causal), as create_causal_mask returns it; said explicitly so that
                # fake tensors (which transformers takes for tracing) do not materialise a (B, 1, T, T) mask
                loss = model(**mb, attention_mask={"full_attention": None}).loss / k  # logits dropped here
            tr.end_forward()
            tr.mark("forward", host())
            graph_hooks = _walk_graph(loss, lm_in["node"], tr)
            tr.start("backward")
            (scaler.scale(loss) if scaler else loss).backward()
            for h in graph_hooks:
                h.remove()
            tr.loss_nodes = set()  # the nodes reach every AccumulateGrad, i.e. hold every parameter
            tr.mark("backward", host())
            losses.append(loss.detach())
        tr.start("optimizer")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        for state in opt.state.values():
            for v in state.values():
                tr.relabel(v, "optimizer_states")
        tr.start("zero_grad")
        opt.zero_grad(set_to_none=True)
        tr.mark("zero_grad", host())
        tr.start("idle")
    finally:
        for h in handles:
            h.remove()
    return torch.stack(losses).sum() if len(losses) > 1 else losses[0]


def _build(w, device, fake: bool):
    """(model, batch) on ``device``: the real workload, or a fake-tensor twin of it."""
    from bp_mech.workload import build_model, make_batches, qwen2_config

    if not fake:
        return build_model(w, device), make_batches(w, 1, device=device)[0]
    from transformers import Qwen2ForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, w.dtype))  # (.to() cannot swap fake parameters)
    try:
        model = Qwen2ForCausalLM(qwen2_config(w.arch)).train()  # fake parameters, nothing allocated
    finally:
        torch.set_default_dtype(prev)
    ids = torch.randint(0, 256, (w.batch, w.seq), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}


WARMUP_TRIES = 4  # AMP: a warm-up step the GradScaler skips (inf/NaN) allocates no AdamW state; retry


def make_optimizer(params, cfg: LedgerConfig, device):
    """AdamW of flavour ``cfg.for_device(device).adamw``: by default ``workload.make_adamw``'s for the
    device (fused on CUDA, foreach on the CPU), the AdamW of the GPU runs of 11, 19, 42 and AMP; another
    flavour only when asked for (a fake-tensor estimate of a GPU run asks for the fused one)."""
    from bp_mech.workload import make_adamw

    flavour = cfg.for_device(device).adamw
    if flavour == LedgerConfig().for_device(device).adamw:
        return make_adamw(params, cfg.lr, device)
    return torch.optim.AdamW(params, lr=cfg.lr, **{flavour: True})


def track(w, cfg: LedgerConfig = LedgerConfig(), device="cpu", fake: bool = False) -> Ledger:
    """Ledger of one steady-state step of workload ``w``: real tensors, or fake ones (``fake=True``:
    no memory is allocated, so the full qwen05 fits on any CPU in seconds). Fake tensors run on the
    CPU; ``cfg`` is resolved for the CPU unless it says otherwise (pass ``cfg.for_device("cuda")`` to
    estimate a GPU run: fused AdamW, CUDA's offload threshold).

    Steps: warm-up updates until AdamW's moments exist (an AMP step the GradScaler skips allocates
    none), then the measured update; ``Ledger.updates`` counts them all, ``skipped`` the skipped ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu" if fake else device)
    cfg = cfg.for_device(device)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    if fake and cfg.strategy == "offload":  # the dispatch cache's keys hold the storages an op was given:
        mode.cache_enabled = False  # those the offload views with ``set_`` would never be freed
    with mode:
        model, batch = _build(w, device, fake)
        load_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        opt = make_optimizer(model.parameters(), cfg, device)
        scaler = torch.amp.GradScaler(device.type) if cfg.strategy == "amp" and not fake else None
        hooks = offload_hooks(model, cfg, device) if cfg.strategy == "offload" else None
        count = dict(updates=0, skipped=0)

        def update(tracker):  # one train_step; a step the GradScaler skips (inf/NaN) lowers its scale
            scale = scaler.get_scale() if scaler else None
            loss = train_step(model, opt, batch, cfg, tracker, scaler, hooks)
            count["updates"] += 1
            count["skipped"] += int(scaler is not None and scaler.get_scale() < scale)
            return loss

        with checkpointing.configure(model, cfg.checkpoint):  # Part 02 · 19's configuration ("plain": none)
            for _ in range(WARMUP_TRIES):  # warm-up: allocates AdamW's moments, unless the scaler skips it
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
            with tr:
                loss = update(tr)
        finite = None if fake else bool(torch.isfinite(loss).all())
    snaps = {s: tr.marks[s][1] for s in ("load", "forward", "backward", "zero_grad")}
    snaps.update(backward_peak=tr.peaks["backward"][1], optimizer_peak=tr.peaks["optimizer"][1])
    if load_alloc is not None:
        tr.allocator["load"] = load_alloc
    return Ledger("fake-tensor" if fake else ("cuda-allocator" if device.type == "cuda" else "tracked-cpu"),
                  cfg.strategy, {s: tr.classify(snaps[s], CLASSES) for s in STAGES},
                  host={s: tr.marks[s][2] for s in tr.marks}, forward_peak=tr.peaks["forward"][0],
                  allocator=dict(tr.allocator), finite=finite, updates=count["updates"],
                  skipped=count["skipped"] if scaler else None,
                  rounded={s: sum(-(-tr.nbytes[x] // 512) * 512 for x in snaps[s]) for s in STAGES})
