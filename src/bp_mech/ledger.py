"""Part 02 · 43 — TRAIN-STATE-LEDGER: where a training step's memory goes, stage by stage.

A ledger splits the memory of one steady-state training step (AdamW, its moments already
allocated by a warm-up step) by **lifecycle stage** (``STAGES``) and by **object class**
(``CLASSES``), from three independent sources:

* ``theoretical``: a formula for the Qwen2 block (SwiGLU, RMSNorm, GQA, fused SDPA, tied
  embeddings, fp32 logits) derived from what each operator saves for backward;
* ``track(..., fake=True)``: the same step run under ``FakeTensorMode`` (no real memory),
  bytes counted by the storage tracker below (memory source ``fake-tensor``);
* ``track(..., fake=False)``: the step run for real, storages tracked on the CPU
  (``tracked-cpu``) or, on CUDA, the allocator's own counters beside them.

The tracker is a ``TorchDispatchMode`` that gives every storage an operator creates a
class from where it was born (forward body, logits/loss, backward node, recomputation,
optimizer) and promotes it when its role becomes known: alive at the end of the forward ->
saved activation, ever a ``p.grad`` -> gradient, in ``optimizer.state`` -> optimizer state.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

STAGES = ("load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")
CANDIDATES = ("plain", "checkpoint", "offload", "amp", "accumulation")
STAGE_LABELS = dict(load="after model load", forward="after forward", backward_peak="peak in backward",
                    backward="after backward", optimizer_peak="in the optimizer step", zero_grad="after zero_grad")
CLASS_LABELS = dict(parameters="parameters", gradients="gradients", optimizer_states="optimizer states",
                    saved_activations="saved activations", logits_loss="logits & loss", other="other temporaries")


@dataclass(frozen=True)
class LedgerConfig:
    strategy: str = "plain"  # one of CANDIDATES
    micro_batches: int = 2  # accumulation: micro-batches per update (must divide the batch)
    amp_dtype: str = "float16"  # autocast dtype of the amp strategy
    foreach: bool | None = None  # AdamW foreach; None = torch's default (True on CUDA, False on CPU)
    lr: float = 1e-4  # AdamW learning rate (memory does not depend on it)


@dataclass
class Ledger:
    """Device bytes per stage and class (+ host bytes of offloaded activations)."""

    source: str  # formula | fake-tensor | tracked-cpu | cuda-allocator
    strategy: str
    stages: dict[str, dict[str, int]]  # stage -> class -> bytes
    host: dict[str, int] = field(default_factory=dict)  # stage -> bytes held in host memory
    forward_peak: int = 0  # peak inside the forward (not a ledger stage, counts for the peak)
    allocator: dict[str, int] = field(default_factory=dict)  # CUDA only: stage -> allocator bytes
    rounded: dict[str, int] = field(default_factory=dict)  # stage -> bytes in 512-byte allocator blocks
    finite: bool | None = None  # the step's loss was finite (None: fake tensors have no values)
    moment: str | None = None  # formula only: which candidate moment is the backward peak

    def total(self, stage: str) -> int:
        return sum(self.stages[stage].values())

    def totals(self) -> dict[str, int]:
        return {s: self.total(s) for s in STAGES}

    @property
    def peak(self) -> int:
        return max(self.forward_peak, *self.totals().values())

    @property
    def peak_stage(self) -> str:
        """The stage holding the peak ("forward_peak" if it lies inside the forward)."""
        best = max(STAGES, key=self.total)
        return "forward_peak" if self.forward_peak > self.total(best) else best


# --- the tracker ----------------------------------------------------------------------

class _Tracker(TorchDispatchMode):
    """Live storage bytes by class; a snapshot of the live set at each phase's peak."""

    def __init__(self, device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.serial = WeakIdKeyDictionary()  # storage -> serial number
        self.refs, self.nbytes, self.label = {}, {}, {}  # serial -> weakref / bytes / class
        self.live, self.host = {}, {}  # serial -> bytes (device, host) of storages alive now
        self.current = 0  # device bytes alive now
        self.phase, self.region, self.packing = "idle", "body", False
        self.born: list[int] = []  # serials created in the current forward
        self.peaks: dict[str, tuple[int, list]] = {}  # phase -> (bytes, serials alive)
        self.marks: dict[str, tuple[int, list, int]] = {}  # stage -> (bytes, serials, host bytes)
        self.loss_nodes: set = set()  # autograd nodes of lm_head + loss (kept alive: identity)
        self.allocator: dict[str, int] = {}

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
        if self.packing or t.device.type != self.device.type:  # offloaded copy, or a host tensor
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

    def mark(self, stage: str) -> None:
        self.marks[stage] = (self.current, list(self.live), sum(self.host.values()))
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


def _offload(tr: _Tracker, device):
    """Native ``save_on_cpu(pin_memory=True)``; its host copies are tagged as host bytes. On a CPU
    run its unpack ``.to(device)`` is a no-op, so we clone to stand in for the GPU's H2D copy."""
    native = torch.autograd.graph.save_on_cpu(pin_memory=True)

    def pack(t):
        tr.packing = True
        try:
            return native.pack_hook(t)
        finally:
            tr.packing = False

    def unpack(packed):
        t = native.unpack_hook(packed)
        return t.clone() if torch.device(device).type == "cpu" else t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def train_step(model, opt, batch: dict, cfg: LedgerConfig, tr: _Tracker, scaler=None) -> torch.Tensor:
    """One update of ``cfg.strategy`` (checkpointing is switched on on the model beforehand).
    Calls ``tr.start``/``tr.mark`` at the lifecycle stages. Returns the (summed) loss."""
    device = next(model.parameters()).device
    k = cfg.micro_batches if cfg.strategy == "accumulation" else 1
    B = batch["input_ids"].shape[0]
    if B % k:
        raise ValueError(f"accumulation needs micro_batches ({k}) to divide the batch ({B})")
    lm_in = {}

    def pre_hook(_mod, inputs):
        tr.region, lm_in["node"] = "loss", inputs[0].grad_fn

    hooks = [model.lm_head.register_forward_pre_hook(pre_hook)]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: tr.relabel(p.grad, "gradients"))
              for p in model.parameters() if p.requires_grad]
    losses = []
    try:
        for i in range(k):
            mb = {n: v[i * B // k:(i + 1) * B // k] for n, v in batch.items()}  # (B/k, T) views
            tr.start("forward")
            offload = _offload(tr, device) if cfg.strategy == "offload" else contextlib.nullcontext()
            amp = torch.autocast(device.type, dtype=getattr(torch, cfg.amp_dtype), enabled=cfg.strategy == "amp")
            with offload, amp:  # no padding: the causal mask is None (SDPA's is_causal), as
                # create_causal_mask returns it; said explicitly so that fake tensors (which
                # transformers takes for tracing) do not materialise a (B, 1, T, T) mask instead
                loss = model(**mb, attention_mask={"full_attention": None}).loss / k  # logits dropped here
            tr.end_forward()
            tr.mark("forward")
            tr.loss_nodes = set()
            graph_hooks = _walk_graph(loss, lm_in["node"], tr)
            tr.start("backward")
            (scaler.scale(loss) if scaler else loss).backward()
            for h in graph_hooks:
                h.remove()
            tr.mark("backward")
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
        tr.mark("zero_grad")
        tr.start("idle")
    finally:
        for h in hooks:
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


def track(w, cfg: LedgerConfig = LedgerConfig(), device="cpu", fake: bool = False) -> Ledger:
    """Ledger of one steady-state step of workload ``w``: real tensors, or fake ones (``fake=True``:
    no memory is allocated, so the full qwen05 fits on any CPU in seconds; fake runs use the CPU's
    kernels, pass ``cfg.foreach=True`` to mimic AdamW's CUDA default)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu" if fake else device)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, batch = _build(w, device, fake)
        load_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if cfg.strategy == "checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=cfg.foreach)
        scaler = torch.amp.GradScaler(device.type) if cfg.strategy == "amp" and not fake else None
        train_step(model, opt, batch, cfg, _Tracker(device), scaler)  # warm-up: allocates AdamW's moments
        tr = _Tracker(device)
        for t in [*model.parameters(), *model.buffers()]:
            tr.add(t, "parameters")
        tr.mark("load")
        for t in (v for st in opt.state.values() for v in st.values()):
            tr.add(t, "optimizer_states")
        for t in batch.values():
            tr.add(t, "other")
        with tr:
            loss = train_step(model, opt, batch, cfg, tr, scaler)
        finite = None if fake else bool(torch.isfinite(loss).all())
    snaps = {s: tr.marks[s][1] for s in ("load", "forward", "backward", "zero_grad")}
    snaps.update(backward_peak=tr.peaks["backward"][1], optimizer_peak=tr.peaks["optimizer"][1])
    if load_alloc is not None:
        tr.allocator["load"] = load_alloc
    return Ledger("fake-tensor" if fake else ("cuda-allocator" if device.type == "cuda" else "tracked-cpu"),
                  cfg.strategy, {s: tr.classify(snaps[s]) for s in STAGES},
                  host={s: tr.marks[s][2] for s in tr.marks}, forward_peak=tr.peaks["forward"][0],
                  allocator=dict(tr.allocator), finite=finite,
                  rounded={s: sum(-(-tr.nbytes[x] // 512) * 512 for x in snaps[s]) for s in STAGES})


# --- the theoretical ledger -----------------------------------------------------------

def _dims(cfg) -> dict:
    """Sizes of a Qwen2 config (a ``Qwen2Config`` or an ``ARCHITECTURES`` dict)."""
    g = (lambda k: cfg[k]) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    C, H, KV = g("hidden_size"), g("num_attention_heads"), g("num_key_value_heads")
    return dict(C=C, H=H, hd=C // H, Ckv=KV * (C // H), I=g("intermediate_size"), V=g("vocab_size"),
                L=g("num_hidden_layers"), tied=bool(g("tie_word_embeddings")))


def _layer_params(d) -> int:
    """q/k/v (with bias), o, gate/up/down, two RMSNorm gains."""
    C, Ckv, I = d["C"], d["Ckv"], d["I"]
    return (C * C + C) + 2 * (C * Ckv + Ckv) + C * C + 3 * C * I + 2 * C


def param_bytes(cfg, bytes_per_value: int = 4) -> int:
    """Unique parameters: embedding (once if tied to lm_head), L layers, final norm."""
    d = _dims(cfg)
    n = d["V"] * d["C"] * (1 if d["tied"] else 2) + d["L"] * _layer_params(d) + d["C"]
    return n * bytes_per_value


def grad_bytes(cfg, bytes_per_value: int = 4) -> int:
    """One gradient per unique parameter (a tied weight has one .grad)."""
    return param_bytes(cfg, bytes_per_value)


def adam_state_bytes(cfg, bytes_per_value: int = 4) -> int:
    """AdamW's two moments (exp_avg, exp_avg_sq) per parameter; the step counters come on top."""
    return 2 * param_bytes(cfg, bytes_per_value)


def block_saved_bytes(cfg, batch: int, seq: int, half: bool = False) -> int:
    """Bytes one Qwen2 decoder layer saves for backward (fused SDPA), its input included, its
    weights and the shared RoPE cos/sin excluded. ``half``: under fp16/bf16 autocast.

    fp32, n = B*T tokens: 4 n (8C + 2Ckv + 4I + 2) + 4 B H T, from
      RMSNorm x2: input x, 1/rms (n,1), x/rms, normed output (the q/k/v or gate/up input): 3C + 1 each
      attention: RoPE'd q (C) and k (Ckv), v (Ckv), SDPA output (C, also o_proj's input), lse (B,H,T)
      residual sum entering the second norm is that norm's x (counted above)
      SwiGLU: gate out, silu out, up out, their product (down_proj's input): 4 I
    autocast: the norms stay fp32 (x, x/rms, 1/rms), each linear saves its own half-precision
    copy of its input (q, k, v: 3 copies; gate, up: 2), SDPA saves half q/k/v/out, the MLP is half:
      n (30C + 4Ckv + 8I + 8) + 4 B H T.
    """
    d, n = _dims(cfg), batch * seq
    C, Ckv, I, lse = d["C"], d["Ckv"], d["I"], 4 * batch * d["H"] * seq
    if half:
        return n * (30 * C + 4 * Ckv + 8 * I + 8) + lse
    return 4 * n * (8 * C + 2 * Ckv + 4 * I + 2) + lse


def gpt_activation_bytes(cfg, batch: int, seq: int) -> float:
    """The GPT constant per layer, s b h (34 + 5 a s / h) bytes (Korthikanti et al. 2022, eq. 2):
    16-bit activations, a 4h GELU MLP, LayerNorm, dropout masks and the materialised s x s scores."""
    d = _dims(cfg)
    return seq * batch * d["C"] * (34 + 5 * d["H"] * seq / d["C"])


def attention_probs_bytes(cfg, batch: int, seq: int, bytes_per_value: int = 4) -> int:
    """What one layer adds if SDPA falls back to its math kernel: the (B, H, T, T) probabilities."""
    return batch * _dims(cfg)["H"] * seq * seq * bytes_per_value


def theoretical(arch, batch: int, seq: int, cfg: LedgerConfig = LedgerConfig(), device="cpu") -> Ledger:
    """The formula ledger of one steady-state step (derivation in the chapter).

    n = B T / k tokens per micro-batch, W = ``param_bytes``, M = 2W (+ 4-byte steps), E = 4 V C:
      after load       W (+ the RoPE buffers)
      after forward    W + M + batch + saved + log-softmax output 4 n V (+ targets, scalars)
      peak in backward the largest of: the log-softmax backward (saved + 3 x 4 n V); each layer's
                       MLP backward (gradients so far + its live tensors); with tied embeddings the
                       end (all gradients + lm_head's, held by the engine, + the embedding's)
      after backward   W + M + W (gradients)
      optimizer step   + W (foreach: one temporary per tensor, CUDA's default) or 2 x the largest
                       tensor (single-tensor loop, the CPU's)
      after zero_grad  W + M
    saved = L A + RoPE + final norm (plain, amp, accumulation); L layer inputs (checkpoint); 0 (offload).
    """
    d = _dims(arch)
    C, Ckv, I, V, L, hd = d["C"], d["Ckv"], d["I"], d["V"], d["L"], d["hd"]
    s = cfg.strategy
    k = cfg.micro_batches if s == "accumulation" else 1
    b, n, amp = batch // k, batch * seq // k, s == "amp"  # per micro-batch
    W = param_bytes(arch)  # weights = gradients (fp32)
    n_tensors = 2 + L * 12 + (0 if d["tied"] else 1)
    params = W + 4 * hd  # + RoPE inv_freq buffers
    wl = 2 * (2 * C * C + 2 * C * Ckv + 3 * C * I) if amp else 0  # autocast's half weight copies, per layer
    wcopy = L * wl + (2 * V * C if amp else 0)  # + lm_head's; each is freed by its layer's backward
    on_cpu = torch.device(device).type == "cpu"
    M = 2 * W + (4 * n_tensors if on_cpu else 0)  # two moments (+ a 4-byte step per tensor, a host scalar on CUDA)
    batch_b = 16 * batch * seq  # input_ids + labels, int64
    E = 4 * V * C  # embedding / lm_head weight (tied)
    A = block_saved_bytes(arch, b, seq, amp)
    R = 8 * seq * hd  # RoPE cos + sin, fp32, shared by the layers
    F = 4 * n * ((2 if amp else 3) * C + 1)  # final norm
    Pl = 4 * _layer_params(d)
    saved = {"checkpoint": L * 4 * n * C + 8 * seq + R + F, "offload": 0}.get(s, L * A + R + F)
    logits_fwd = 4 * n * V + 8 * n + 8 + (2 * n * C if amp else 0)  # log-softmax out, targets, scalars
    logits_fwd = 4 if s == "offload" else logits_fwd  # offload: all of it saved, so on the host
    g_prev = W if k > 1 else 0  # accumulation: the last micro-batch starts with gradients
    losses = 4 * k
    foreach = cfg.foreach if cfg.foreach is not None else not on_cpu
    opt_tmp = W if foreach else 2 * 4 * max(V * C, C * I)  # foreach: one sqrt per tensor at once

    def row(**kw):
        return {c: kw.get(c, 0) for c in CLASSES}

    base = dict(parameters=params + wcopy, optimizer_states=M, gradients=g_prev)
    st = {"load": row(parameters=params),
          "forward": row(**base, saved_activations=saved, logits_loss=logits_fwd + losses - 4, other=batch_b),
          "backward": row(parameters=params, optimizer_states=M, gradients=W, logits_loss=losses, other=batch_b),
          "optimizer_peak": row(parameters=params, optimizer_states=M, gradients=W, logits_loss=losses,
                                other=batch_b + opt_tmp),
          "zero_grad": row(parameters=params, optimizer_states=M, logits_loss=losses, other=batch_b)}
    # backward peak: the largest of the candidate moments
    half = 2 if amp else 4
    events = {"the log-softmax backward": row(**base, saved_activations=saved, other=batch_b,
                                              logits_loss=12 * n * V + losses + (2 * n * C if amp else 0))}
    for l in range(L):  # layer l's MLP backward (mul node): dy, d(a*u), da, du alive
        # gradients so far (with k > 1 each new one is added in place into .grad and freed)
        grads = W + E + 4 * C * I if k > 1 else E + 4 * C + (L - 1 - l) * Pl + 4 * C * I
        g = dict(base, gradients=grads, parameters=params + (l + 1) * wl - (4 * C * I if amp else 0))
        if s == "checkpoint":
            sv, tmp = (l + 1) * 4 * n * C + 8 * seq + R + A - 4 * n * C - 4 * n * I, 4 * n * C + 12 * n * I
        elif s == "offload":
            sv, tmp = 0, 4 * n * C + 20 * n * I  # + the unpacked a and u
        else:  # (amp: half-precision MLP gradients, approximate; the log-softmax moment dominates)
            sv, tmp = (l + 1) * A + R - half * n * I, 4 * n * C + 3 * half * n * I
        events[f"layer {l}'s MLP backward"] = row(**g, saved_activations=sv, other=batch_b + tmp, logits_loss=losses)
    if d["tied"]:  # the end: lm_head's gradient (held by the engine) + the embedding's + their sum
        events["the end of the backward (tied embedding)"] = row(
            **dict(base, parameters=params, gradients=W + 2 * E + (E if k > 1 else 0)), other=batch_b,
            logits_loss=losses)
    moment = max(events, key=lambda e: sum(events[e].values()))
    st["backward_peak"] = events[moment]
    fpeak = sum(st["forward"].values()) + 4 * n * V + 8 * b * (seq + 1) + (2 * n * V if amp else 0)
    return Ledger("formula", s, {x: st[x] for x in STAGES}, forward_peak=fpeak, moment=moment)


# --- the experiment ---------------------------------------------------------------------

TOL = 0.05  # the formula must agree with the measured and the estimated ledger within 5 % per stage


def stage_errors(ledger: Ledger, reference: Ledger) -> dict[str, float]:
    """Relative error of ``ledger`` against ``reference``, per stage and for the peak."""
    out = {s: ledger.total(s) / reference.total(s) - 1 for s in STAGES}
    out["peak"] = ledger.peak / reference.peak - 1
    return out


def _metrics(led: Ledger, formula: Ledger | None = None) -> dict:
    m = dict(source=led.source, stages=led.stages, totals=led.totals(), forward_peak=led.forward_peak,
             host=led.host, rounded_512=led.rounded, allocator=led.allocator)
    if formula is not None:
        m["formula_error"] = stage_errors(formula, led)
    return m


def _decision(errors: dict) -> str:
    return "accept" if max(abs(v) for v in errors.values()) <= TOL else "tune"


def run(ctx) -> list:
    """Per strategy: the measured ledger (CPU tracker or CUDA allocator), the fake-tensor estimate
    and the formula, each its own record; decision: does the formula hold within ``TOL``?"""
    from bp_mech.measure import guarded
    from bp_mech.workload import ARCHITECTURES

    w, recs, gpu = ctx.workload, [], ctx.device == "cuda"
    for s in ctx.progress(CANDIDATES, desc="strategies"):
        cfg = LedgerConfig(strategy=s)
        if s == "accumulation" and w.batch % cfg.micro_batches:
            why = f"batch {w.batch} is not divisible into {cfg.micro_batches} micro-batches"
            recs.append(ctx.record(s, failure=why))
            continue
        formula = theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, cfg, ctx.device)
        est = track(w, LedgerConfig(strategy=s, foreach=True if gpu else None), fake=True)  # CPU kernels
        meas, failure = guarded(track, w, cfg, ctx.device)
        if meas is None:
            recs.append(ctx.record(s, failure=failure, memory_source=ctx.memory_source))
        else:
            al = meas.allocator
            err = stage_errors(formula, meas)
            recs.append(ctx.record(
                s, all_finite=meas.finite, update_count=2, memory_source=ctx.memory_source,
                peak_allocated=max(v for k, v in al.items() if k.endswith("_peak")) if gpu else meas.peak,
                peak_reserved=max(v for k, v in al.items() if k.endswith("_reserved")) if gpu else None,
                decision=_decision(err), next_step=None if _decision(err) == "accept" else
                "find the ledger line the formula misses (largest stage error in metrics.formula_error)",
                metrics=_metrics(meas, formula)))
        err = stage_errors(formula, est)
        recs.append(ctx.record(f"{s}-estimated", evidence_level="estimated", memory_source="fake-tensor",
                               peak_allocated=est.peak, decision=_decision(err), metrics=_metrics(est, formula)))
        recs.append(ctx.record(f"{s}-formula", evidence_level="theoretical", memory_source="formula",
                               peak_allocated=formula.peak, metrics=_metrics(formula)))
    return recs


def plan(ctx) -> dict:
    """The dry-run plan: what is measured where, and the formula's peak per strategy (no model)."""
    from bp_mech.workload import ARCHITECTURES

    w = ctx.workload
    peaks = {dev: {s: theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, LedgerConfig(strategy=s), dev).peak
                   for s in CANDIDATES} for dev in ("cpu", "cuda")}
    return dict(sources=["measured (" + ctx.memory_source + ")", "estimated (fake-tensor)", "theoretical (formula)"],
                stages=list(STAGES), classes=list(CLASSES), tolerance=TOL,
                formula_peak_bytes_cpu=peaks["cpu"], formula_peak_bytes_cuda=peaks["cuda"],
                records_per_strategy=["<strategy>", "<strategy>-estimated", "<strategy>-formula"])


def conformance():
    """The tracker against PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` on the
    same steady-state plain step of tiny-b2s64: the model's forward peak, its state when backward
    starts (our "after forward"), its backward peak and its state after backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import build_model, make_batches, parse_workload

    w = parse_workload("tiny-b2s64")
    led = track(w)
    model, batch = build_model(w), make_batches(w, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, batch, LedgerConfig(), _Tracker("cpu"))  # warm-up, as in track()
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        train_step(model, opt, batch, LedgerConfig(), _Tracker("cpu"))
    snap = {k: v[-1][torch.device("cpu")]["Total"] for k, v in mt.memory_tracking[model].snapshots.items()}
    pairs = {"forward_peak": (led.forward_peak, snap[_ModState.PEAK_FW]),
             "forward": (led.total("forward"), snap[_ModState.PRE_BW]),
             "backward_peak": (led.total("backward_peak"), snap[_ModState.PEAK_BW]),
             "backward": (led.total("backward"), snap[_ModState.POST_BW])}
    errs = {k: a / b - 1 for k, (a, b) in pairs.items()}
    worst = max(errs, key=lambda k: abs(errs[k]))
    return ConformanceRow("Part 02 · 43", "TRAIN-STATE-LEDGER", "torch MemTracker (module snapshots, plain step)",
                          abs(errs[worst]) <= 1e-3, f"max rel. difference {errs[worst]:+.1e} at {worst} "
                          f"({pairs[worst][0]} B vs {pairs[worst][1]} B) over 4 snapshots (tol 1e-3)")


def gpu_references() -> list[dict]:
    """Cached GPU records of 19, 42 and 76 beside the formula for the same workload and strategy."""
    from bp_mech import report
    from bp_mech.workload import ARCHITECTURES, parse_workload

    rows = []
    for sid in ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-MEMORY-STRATEGY"):
        for label, recs in report.cached(sid).gpu().items():
            for r in recs:
                w = parse_workload(r.workload_id)
                f = theoretical(ARCHITECTURES[w.arch], w.batch, w.seq, LedgerConfig(strategy=r.candidate), "cuda") \
                    if r.candidate in CANDIDATES and r.peak_allocated else None
                rows.append(dict(experiment=sid, run_label=label, candidate=r.candidate, workload=r.workload_id,
                                 peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved,
                                 formula_peak=f.peak if f else None,
                                 formula_error=f.peak / r.peak_allocated - 1 if f else None))
    return rows
