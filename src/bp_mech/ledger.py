"""Part 02 · 43 — the training-state ledger: what a ledger is, and what it should hold by formula.

A ledger splits the memory of one steady-state training step (AdamW, its moments already
allocated by a warm-up step) by **lifecycle stage** (``STAGES``) and by **object class**
(``CLASSES``). This module defines that table (``Ledger``) and fills it from theory:
``theoretical`` derives every line for the Qwen2 block (SwiGLU, RMSNorm, GQA, fused SDPA,
tied embeddings, fp32 logits) from what each operator saves for backward. The exercise
answers of the chapter (``param_bytes``, ``grad_bytes``, ``adam_state_bytes``,
``block_saved_bytes``) are its building blocks.

``bp_mech.bench.lifecycle`` fills the same table from a real or a fake-tensor step (the storage
tracker of ``bp_mech.bench.tracking``); ``bp_mech.experiments.ledger`` compares the three sources
(TRAIN-STATE-LEDGER).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STAGES = ("load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")
STAGE_LABELS = dict(load="after model load", forward="after forward", backward_peak="peak in backward",
                    backward="after backward", optimizer_peak="in the optimizer step", zero_grad="after zero_grad")
CLASS_LABELS = dict(parameters="parameters", gradients="gradients", optimizer_states="optimizer states",
                    saved_activations="saved activations", logits_loss="logits & loss", other="other temporaries")


@dataclass(frozen=True)
class Counts:
    """What a measured step did, counted: sublayer forwards (recomputes included) and offload copies."""

    recomputes: int  # attention and MLP forwards beyond one per micro-batch
    attn_calls: int  # attention forwards over all layers
    mlp_calls: int  # MLP forwards over all layers
    d2h_bytes: int  # bytes the offload copied to the host
    h2d_bytes: int  # bytes it copied back


@dataclass
class Ledger:
    """Device bytes per stage and class (+ host bytes of offloaded activations)."""

    source: str  # formula | fake-tensor | tracked-cpu | cuda-allocator
    strategy: str
    stages: dict[str, dict[str, int]]  # stage -> class -> bytes
    host: dict[str, int] = field(default_factory=dict)  # stage -> host bytes in use (the offload pool's)
    forward_peak: int = 0  # peak inside the forward (not a ledger stage, counts for the peak)
    allocator: dict[str, int] = field(default_factory=dict)  # CUDA only: stage -> allocator bytes
    rounded: dict[str, int] = field(default_factory=dict)  # stage -> bytes in 512-byte allocator blocks
    finite: bool | None = None  # the step's loss was finite (None: fake tensors have no values)
    moment: str | None = None  # formula only: which candidate moment is the backward peak
    updates: int = 0  # optimizer steps run, warm-up included (0: formula)
    skipped: int | None = None  # amp: of those, the ones the GradScaler skipped (inf/NaN)
    counts: Counts | None = None  # measured: sublayer forwards and recomputes, offload copies (None: formula)

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


def layer_saved_storages(cfg, batch: int, seq: int) -> list[int]:
    """``block_saved_bytes`` (float32) storage by storage, in bytes: what an offload that moves whole
    storages and keeps the small ones (Part 02 · 42) sees. n = B*T tokens:
    two RMSNorms (x, x/rms, normed output: 4nC each; 1/rms: 4n), attention (RoPE'd q 4nC and k 4nC_kv,
    v 4nC_kv, SDPA output 4nC, log-sum-exp 4BHT), SwiGLU (gate, SiLU, up, product: 4nI each)."""
    d, n = _dims(cfg), batch * seq
    C, Ckv, I = d["C"], d["Ckv"], d["I"]
    return [4 * n * C] * 6 + [4 * n] * 2 + [4 * n * C, 4 * n * Ckv, 4 * n * Ckv, 4 * n * C,
                                           4 * batch * d["H"] * seq] + [4 * n * I] * 4


def _outer_saved_storages(d, batch: int, seq: int) -> list[int]:
    """Saved outside the layers (float32): RoPE cos and sin (T, d) each, the final norm (x, x/rms,
    normed output, 1/rms)."""
    n = batch * seq
    return [4 * seq * d["hd"]] * 2 + [4 * n * d["C"]] * 3 + [4 * n]


def gpt_activation_bytes(cfg, batch: int, seq: int) -> float:
    """The GPT constant per layer, s b h (34 + 5 a s / h) bytes (Korthikanti et al. 2022, eq. 2):
    16-bit activations, a 4h GELU MLP, LayerNorm, dropout masks and the materialised s x s scores."""
    d = _dims(cfg)
    return seq * batch * d["C"] * (34 + 5 * d["H"] * seq / d["C"])


def attention_probs_bytes(cfg, batch: int, seq: int, bytes_per_value: int = 4) -> int:
    """What one layer adds if SDPA falls back to its math kernel: the (B, H, T, T) probabilities."""
    return batch * _dims(cfg)["H"] * seq * seq * bytes_per_value


def unmodelled(strategy) -> str | None:
    """Why ``theoretical`` has no formula for ``strategy`` (a ``bench.strategy.Strategy``), or None when
    it has one: plain, and each of checkpoint-all, offload, fp16 / bf16 and micro<k> alone."""
    if strategy.chunked_loss is not None:
        return "the formula has no chunked loss (project 74 derives its own rule for it)"
    if strategy.checkpoint not in ("plain", "checkpoint-all"):
        return "the formula checkpoints every decoder layer or none (no selective checkpointing)"
    parts = [strategy.checkpoint != "plain", strategy.offload, strategy.amp is not None, strategy.micro_batches > 1]
    if sum(parts) > 1:
        return "the formula takes one strategy at a time (project 76 measures the combinations)"
    return None


def theoretical(arch, batch: int, seq: int, strategy=None, device="cpu", adamw: str | None = None,
                offload_min_bytes: int | None = None) -> Ledger:
    """The formula ledger of one steady-state step (derivation in the chapter) of ``strategy`` (a
    ``bench.strategy.Strategy``, None: plain; ``unmodelled`` says which it covers) on ``device``, with
    AdamW ``adamw`` ("fused" | "foreach"; None: fused on CUDA, foreach on the CPU, as ``make_adamw``)
    and the offload's ``offload_min_bytes`` (None: ``offload.min_bytes(device)``).

    n = B T / k tokens per micro-batch, W = ``param_bytes``, M = 2W (+ 4-byte steps), E = 4 V C:
      after load       W (+ the RoPE buffers)
      after forward    W + M + batch + saved + log-softmax output 4 n V (+ targets, scalars)
      peak in backward the largest of: the log-softmax backward (saved + 3 x 4 n V); each layer's
                       MLP backward (gradients so far + its live tensors); with tied embeddings the
                       end (all gradients + lm_head's, held by the engine, + the embedding's)
      after backward   W + M + W (gradients)
      optimizer step   + W with the foreach AdamW (one temporary per tensor, all at once); + 0 fused
      after zero_grad  W + M
    saved = L A + RoPE + final norm (plain, amp, accumulation); L layer inputs (checkpoint); with
    offload only the saved storages under ``offload_min_bytes`` (``layer_saved_storages``), which
    Part 02 · 42's ``ActivationOffload`` leaves on the device (parameters it keeps cost nothing extra).
    """
    from bp_mech.offload import min_bytes

    if strategy is not None and (why := unmodelled(strategy)):
        raise ValueError(f"no formula for {strategy.name!r}: {why}")
    on_cpu = torch.device(device).type == "cpu"
    fused = (adamw or ("foreach" if on_cpu else "fused")) == "fused"
    threshold = min_bytes(device) if offload_min_bytes is None else offload_min_bytes
    kind = "plain" if strategy is None else ("checkpoint" if strategy.checkpoint != "plain" else
                                           "offload" if strategy.offload else "amp" if strategy.amp else
                                           "accumulation" if strategy.micro_batches > 1 else "plain")
    name = "plain" if strategy is None else strategy.name
    d = _dims(arch)
    C, Ckv, I, V, L, hd = d["C"], d["Ckv"], d["I"], d["V"], d["L"], d["hd"]
    k = strategy.micro_batches if kind == "accumulation" else 1
    b, n, amp = batch // k, batch * seq // k, kind == "amp"  # per micro-batch
    W = param_bytes(arch)  # weights = gradients (fp32)
    n_tensors = 2 + L * 12 + (0 if d["tied"] else 1)
    params = W + 4 * hd  # + RoPE inv_freq buffers
    wl = 2 * (2 * C * C + 2 * C * Ckv + 3 * C * I) if amp else 0  # autocast's half weight copies, per layer
    wcopy = L * wl + (2 * V * C if amp else 0)  # + lm_head's; each is freed by its layer's backward
    # two moments + a 4-byte step per tensor, on the device (CPU, or fused), a host scalar (foreach on CUDA)
    M = 2 * W + (4 * n_tensors if on_cpu or fused else 0)
    batch_b = 16 * batch * seq  # input_ids + labels, int64
    E = 4 * V * C  # embedding / lm_head weight (tied)
    A = block_saved_bytes(arch, b, seq, amp)
    R = 8 * seq * hd  # RoPE cos + sin, fp32, shared by the layers
    F = 4 * n * ((2 if amp else 3) * C + 1)  # final norm
    Pl = 4 * _layer_params(d)
    stay = lambda sizes: sum(x for x in sizes if x < threshold)  # noqa: E731 (offload keeps them)
    layer_stays, outer = stay(layer_saved_storages(arch, b, seq)), _outer_saved_storages(d, b, seq)
    saved = {"checkpoint": L * 4 * n * C + 8 * seq + R + F,
             "offload": L * layer_stays + stay(outer)
             }.get(kind, L * A + R + F)
    logits_saved = [4 * n * V, 8 * n, 4]  # log-softmax output, targets (int64), a scalar
    logits_fwd = (stay(logits_saved) if kind == "offload" else sum(logits_saved)) + 4 + (2 * n * C if amp else 0)
    g_prev = W if k > 1 else 0  # accumulation: the last micro-batch starts with gradients
    losses = 4 * k
    opt_tmp = 0 if fused else W  # foreach: one temporary per tensor at once; fused: in place

    def row(**kw):
        return {c: kw.get(c, 0) for c in CLASSES}

    base = dict(parameters=params + wcopy, optimizer_states=M, gradients=g_prev)
    stages = {"load": row(parameters=params),
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
        if kind == "checkpoint":
            sv, tmp = (l + 1) * 4 * n * C + 8 * seq + R + A - 4 * n * C - 4 * n * I, 4 * n * C + 12 * n * I
        elif kind == "offload":  # the small storages of layers 0..l stay; a and u come back (unpacked)
            sv, tmp = (l + 1) * layer_stays, 4 * n * C + 20 * n * I
            # RoPE cos/sin: saved by every layer, so back on the device from the top layer's attention
            # backward to layer 0's (the copy lives while a saved view of it waits)
            rope = [x for x in outer[:2] if x >= threshold]
            sv, tmp = sv + stay(outer[:2]), tmp + (sum(rope) if l < L - 1 else 0)
        else:  # (amp: half-precision MLP gradients, approximate; the log-softmax moment dominates)
            sv, tmp = (l + 1) * A + R - half * n * I, 4 * n * C + 3 * half * n * I
        events[f"layer {l}'s MLP backward"] = row(**g, saved_activations=sv, other=batch_b + tmp, logits_loss=losses)
    if d["tied"]:  # the end: lm_head's gradient (held by the engine) + the embedding's + their sum
        events["the end of the backward (tied embedding)"] = row(
            **dict(base, parameters=params, gradients=W + 2 * E + (E if k > 1 else 0)), other=batch_b,
            logits_loss=losses)
    moment = max(events, key=lambda e: sum(events[e].values()))
    stages["backward_peak"] = events[moment]
    fpeak = sum(stages["forward"].values()) + 4 * n * V + 8 * b * (seq + 1) + (2 * n * V if amp else 0)
    return Ledger("formula", name, {x: stages[x] for x in STAGES}, forward_peak=fpeak, moment=moment)
