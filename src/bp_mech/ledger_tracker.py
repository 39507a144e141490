"""Part 02 · 43 — TRAIN-STATE-LEDGER: the ledger measured, by tracking every tensor storage.

``track`` runs one steady-state training step of a workload and fills a ``Ledger``
(``bp_mech.ledger_formula``) from the storages alive at each lifecycle stage. The strategies are
the book's own mechanisms, so a word means one thing everywhere: checkpointing is
``bp_mech.checkpointing.configure`` (Part 02 · 19), offload is ``bp_mech.offload.ActivationOffload``
(Part 02 · 42) and AdamW is ``bp_mech.workload.make_adamw``'s, as in the GPU runs (fused on CUDA,
foreach on the CPU).

* ``fake=False``: real tensors; storages tracked on the CPU (memory source ``tracked-cpu``)
  or, on CUDA, tracked *and* read from the caching allocator beside them (``cuda-allocator``);
* ``fake=True``: the same step under ``FakeTensorMode`` (no memory is allocated, so the full
  qwen05 runs on any CPU in seconds): the estimate (``fake-tensor``).

The tracker is a ``TorchDispatchMode`` that gives every storage an operator creates a
class from where it was born (forward body, logits/loss, backward node, recomputation,
optimizer) and promotes it when its role becomes known: alive at the end of the forward ->
saved activation, ever a ``p.grad`` -> gradient, in ``optimizer.state`` -> optimizer state.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from functools import partial

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from bp_mech import checkpointing
from bp_mech.ledger_formula import CLASSES, STAGES, Ledger, LedgerConfig
from bp_mech.measure import host_side
from bp_mech.offload import ActivationOffload, OffloadConfig


class _Tracker(TorchDispatchMode):
    """Live storage bytes by class; a snapshot of the live set at each phase's peak."""

    def __init__(self, device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.serial = WeakIdKeyDictionary()  # storage -> serial number
        self.refs, self.nbytes, self.label = {}, {}, {}  # serial -> weakref / bytes / class
        self.live, self.host = {}, {}  # serial -> bytes (device, host) of storages alive now
        self.current = 0  # device bytes alive now
        self.phase, self.region = "idle", "body"
        self.host_depth = 0  # > 0 inside ``measure.host_side()``: what is allocated there is host memory
        self.born: list[int] = []  # serials created in the current forward
        self.peaks: dict[str, tuple[int, list]] = {}  # phase -> (bytes, serials alive)
        self.marks: dict[str, tuple[int, list, int]] = {}  # stage -> (bytes, serials, host bytes in use)
        self.loss_nodes: set = set()  # autograd nodes of lm_head + loss (kept alive: identity)
        self.allocator: dict[str, int] = {}  # CUDA only: stage, "<phase>_peak", "<phase>_reserved" -> bytes

    def _free(self, s, _ref) -> None:
        self.refs.pop(s, None)
        self.host.pop(s, None)
        if self.live.pop(s, None) is not None:
            self.current -= self.nbytes[s]

    def add(self, t, label: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        if st in self.serial:
            return
        s = len(self.nbytes)
        self.serial[st], self.nbytes[s], self.label[s] = s, st.nbytes(), label
        self.refs[s] = weakref.ref(st, partial(self._free, s))
        if self.host_depth or t.device.type != self.device.type:  # an offload's host buffer, or a host tensor
            self.host[s] = st.nbytes()
        else:
            self.live[s] = st.nbytes()
            self.current += st.nbytes()
            if self.phase == "forward":
                self.born.append(s)

    def relabel(self, t, label: str) -> None:
        s = self.serial.get(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
        if s is not None:
            self.label[s] = label

    def _label(self, func, args) -> str:
        if self.phase == "forward":
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if func is torch.ops.aten._to_copy.default and src is not None and \
                    self.label.get(self.serial.get(src.untyped_storage())) == "parameters":
                return "parameters"  # autocast's low-precision weight copy
            return "logits_loss" if self.region == "loss" else "other"
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None and torch.is_grad_enabled():  # checkpointing re-runs a layer's forward
                return "saved_activations"
            return "logits_loss" if node in self.loss_nodes else "other"
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors:
            label = self._label(func, args)
            for t in tensors:
                self.add(t, label)
            peak = self.peaks.get(self.phase)
            if peak is None or self.current > peak[0]:
                self.peaks[self.phase] = (self.current, list(self.live))
        return out

    # stages
    def start(self, phase: str) -> None:
        self._sync_peak()
        self.phase, self.region = phase, "body"
        self.peaks[phase] = max(self.peaks.get(phase, (0, [])), (self.current, list(self.live)), key=lambda p: p[0])
        if phase == "forward":
            self.born = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sync_peak(self) -> None:
        if self.device.type == "cuda" and self.phase != "idle":
            torch.cuda.synchronize(self.device)
            for key, val in ((f"{self.phase}_peak", torch.cuda.max_memory_allocated(self.device)),
                             (f"{self.phase}_reserved", torch.cuda.max_memory_reserved(self.device))):
                self.allocator[key] = max(self.allocator.get(key, 0), val)

    def end_forward(self) -> None:
        for s in self.born:  # what survives the forward is what autograd saved
            if s in self.live and self.label[s] == "other":
                self.label[s] = "saved_activations"

    def mark(self, stage: str, host: int = 0) -> None:
        """Snapshot the live device storages; ``host``: host bytes holding this step's state now."""
        self.marks[stage] = (self.current, list(self.live), host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocator[stage] = torch.cuda.memory_allocated(self.device)

    def classify(self, serials) -> dict[str, int]:
        out = dict.fromkeys(CLASSES, 0)
        for s in serials:
            out[self.label[s]] += self.nbytes[s]
        return out


def _walk_graph(loss: torch.Tensor, lm_input_node, tr: _Tracker) -> list:
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


class _FakeOffload(ActivationOffload):
    """``ActivationOffload`` under fake tensors, whose storages all report ``data_ptr() == 0``: the
    same rules (parameters and storages under ``min_bytes`` stay, one host copy per storage, views
    rebuilt), storages told apart by identity (``StorageWeakRef.cdata``) instead of address."""

    def _reset(self):
        with warnings.catch_warnings():  # the parent reads the (meaningless) fake data_ptr of the parameters
            warnings.simplefilter("ignore", UserWarning)
            super()._reset()
        self._param_ptrs = {StorageWeakRef(p.untyped_storage()).cdata for p in self.params}

    def _keep(self, t) -> bool:
        if (not isinstance(t, FakeTensor) or t.layout != torch.strided or t.is_conj() or t.is_neg()
                or t.device.type != self.device.type):
            return True
        st = t.untyped_storage()
        if isinstance(t, torch.nn.Parameter) or StorageWeakRef(st).cdata in self._param_ptrs:
            self.kept_params += 1
            return True
        if st.nbytes() < self.cfg.min_bytes:
            self.kept_small, self.kept_small_bytes = self.kept_small + 1, self.kept_small_bytes + st.nbytes()
            return True
        return False

    def _pack(self, t):
        if self._keep(t):
            return t
        st = t.untyped_storage()
        ref, slot = self._by_storage.get(StorageWeakRef(st).cdata, (None, None))
        if slot is None or ref.expired() or slot.version != t._version:
            with host_side():
                slot = self._offload(st, t._version)
            self._by_storage[StorageWeakRef(st).cdata] = (StorageWeakRef(st), slot)
        else:
            self.shared_views += 1
        slot.pending += 1
        self.offloaded += 1
        return slot, t.dtype, t.storage_offset(), t.size(), t.stride()


def offload_hooks(model, cfg: LedgerConfig, device, fake: bool = False) -> ActivationOffload:
    """Part 02 · 42's offload for the ledger: ``min_bytes`` from ``cfg`` (``offload.min_bytes(device)``
    unless set). Its pool is reused across steps, so a steady-state step allocates no host memory."""
    kind = _FakeOffload if fake else ActivationOffload
    return kind(model.parameters(), OffloadConfig(min_bytes=cfg.for_device(device).offload_min_bytes), device)


def train_step(model, opt, batch: dict, cfg: LedgerConfig, tr: _Tracker, scaler=None, hooks=None) -> torch.Tensor:
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
        for st in opt.state.values():
            for v in st.values():
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
        hooks = offload_hooks(model, cfg, device, fake) if cfg.strategy == "offload" else None
        count = dict(updates=0, skipped=0)

        def update(tracker):  # one train_step; a step the GradScaler skips (inf/NaN) lowers its scale
            scale = scaler.get_scale() if scaler else None
            loss = train_step(model, opt, batch, cfg, tracker, scaler, hooks)
            count["updates"] += 1
            count["skipped"] += int(scaler is not None and scaler.get_scale() < scale)
            return loss

        with checkpointing.configure(model, cfg.checkpoint):  # Part 02 · 19's configuration ("plain": none)
            for _ in range(WARMUP_TRIES):  # warm-up: allocates AdamW's moments, unless the scaler skips it
                update(_Tracker(device))
                if opt.state:
                    break
            tr = _Tracker(device)
            for t in [*model.parameters(), *model.buffers()]:
                tr.add(t, "parameters")
            tr.mark("load")
            for t in (v for st in opt.state.values() for v in st.values()):
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
                  cfg.strategy, {s: tr.classify(snaps[s]) for s in STAGES},
                  host={s: tr.marks[s][2] for s in tr.marks}, forward_peak=tr.peaks["forward"][0],
                  allocator=dict(tr.allocator), finite=finite, updates=count["updates"],
                  skipped=count["skipped"] if scaler else None,
                  rounded={s: sum(-(-tr.nbytes[x] // 512) * 512 for x in snaps[s]) for s in STAGES})
