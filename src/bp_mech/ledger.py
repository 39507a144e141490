"""Part 02 · 43 — the training-state ledger: what a ledger is, and what it should hold by formula.

A ledger splits the memory of one steady-state training step (AdamW, its moments already
allocated by a warm-up step) by **lifecycle stage** (``STAGES``) and by **object class**
(``CLASSES``). This module defines that table (``Ledger``) and fills it from theory:
``theoretical`` derives every line for the Qwen2 block (SwiGLU, RMSNorm, GQA, fused SDPA,
tied embeddings, fp32 logits) from what each operator saves for backward. The exercise
answers of the chapter (``param_bytes``, ``grad_bytes``, ``adam_state_bytes``,
``block_saved_bytes``) are its building blocks; they live in ``bp_mech.state_bytes`` (with
``layer_saved_storages``, ``gpt_activation_bytes``, ``attention_probs_bytes``) and are re-exported here.

``bp_mech.bench.lifecycle`` fills the same table from a real or a fake-tensor step (the storage
tracker of ``bp_mech.bench.tracking``); ``bp_mech.experiments.ledger`` compares the three sources
(TRAIN-STATE-LEDGER).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bp_mech.state_bytes import (_dims, _layer_params, _outer_saved_storages, adam_state_bytes, attention_probs_bytes,
                                 block_saved_bytes, gpt_activation_bytes, grad_bytes, layer_saved_storages, param_bytes)

__all__ = ["STAGES", "CLASSES", "STAGE_LABELS", "CLASS_LABELS", "Counts", "Ledger", "unmodelled", "theoretical",
           # re-exported from bp_mech.state_bytes
           "param_bytes", "grad_bytes", "adam_state_bytes", "block_saved_bytes", "layer_saved_storages",
           "gpt_activation_bytes", "attention_probs_bytes"]

STAGES = ("load", "forward", "backward_peak", "backward", "optimizer_peak", "zero_grad")
CLASSES = ("parameters", "gradients", "optimizer_states", "saved_activations", "logits_loss", "other")
STAGE_LABELS = dict(load="after model load", forward="after forward", backward_peak="peak in backward",
                    backward="after backward", optimizer_peak="in the optimizer step", zero_grad="after zero_grad")
CLASS_LABELS = dict(parameters="parameters", gradients="gradients", optimizer_states="optimizer states",
                    saved_activations="saved activations", logits_loss="logits & loss", other="other temporaries")


@dataclass(frozen=True)
class Counts:
    """What a measured step did, counted: sublayer forwards (recomputes included) and offload copies.

    Args:
        recomputes: attention and MLP forwards beyond one per micro-batch.
        attn_calls: attention forwards over all layers.
        mlp_calls: MLP forwards over all layers.
        d2h_bytes: bytes the offload copied to the host.
        h2d_bytes: bytes it copied back.

    Example:
        >>> c = Counts(recomputes=4, attn_calls=4, mlp_calls=4, d2h_bytes=0, h2d_bytes=0)  # 2 layers, each run twice
        >>> c.attn_calls + c.mlp_calls - c.recomputes  # sublayer forwards without the recomputes
        4
    """

    recomputes: int  # attention and MLP forwards beyond one per micro-batch
    attn_calls: int  # attention forwards over all layers
    mlp_calls: int  # MLP forwards over all layers
    d2h_bytes: int  # bytes the offload copied to the host
    h2d_bytes: int  # bytes it copied back


@dataclass
class Ledger:
    """Device bytes per stage and class (+ host bytes of offloaded activations).

    Args:
        source: formula | fake-tensor | tracked-cpu | cuda-allocator.
        strategy: the strategy's name (``bench.strategy``), e.g. "plain" or "checkpoint-all".
        stages: stage (``STAGES``) -> class (``CLASSES``) -> bytes.
        host: stage -> host bytes in use (the offload pool's).
        forward_peak: peak inside the forward (not a ledger stage, counts for the peak).
        allocator: CUDA only: stage -> allocator bytes.
        rounded: stage -> bytes in 512-byte allocator blocks.
        finite: the step's loss was finite (None: fake tensors have no values).
        moment: formula only: which candidate moment is the backward peak.
        updates: optimizer steps run, warm-up included (0: formula).
        skipped: amp: of those, the ones the GradScaler skipped (inf/NaN).
        counts: measured: sublayer forwards and recomputes, offload copies (None: formula).

    Example:
        >>> stages = {s: {c: 0 for c in CLASSES} for s in STAGES}
        >>> stages["forward"]["saved_activations"] = 100
        >>> led = Ledger("formula", "plain", stages, forward_peak=150)
        >>> led.total("forward"), led.peak, led.peak_stage
        (100, 150, 'forward_peak')
    """

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
        """Device bytes of one stage, all classes together.

        Args:
            stage: one of ``STAGES``.

        Returns:
            The sum of ``stages[stage]``, in bytes.

        Example:
            >>> led = Ledger("formula", "plain", {"load": {"parameters": 64, "other": 8}})
            >>> led.total("load")
            72
        """
        return sum(self.stages[stage].values())

    def totals(self) -> dict[str, int]:
        """Device bytes per stage.

        Returns:
            Stage -> ``total(stage)``, for every stage of ``STAGES``, in that order.

        Example:
            >>> led = Ledger("formula", "plain", {s: {"parameters": 64} for s in STAGES})
            >>> list(led.totals().values()) == [64] * len(STAGES)
            True
        """
        return {s: self.total(s) for s in STAGES}

    @property
    def peak(self) -> int:
        """The step's peak in bytes: the largest stage total, or ``forward_peak`` if larger."""
        return max(self.forward_peak, *self.totals().values())

    @property
    def peak_stage(self) -> str:
        """The stage holding the peak ("forward_peak" if it lies inside the forward)."""
        best = max(STAGES, key=self.total)
        return "forward_peak" if self.forward_peak > self.total(best) else best


# --- the theoretical ledger -----------------------------------------------------------

def unmodelled(strategy) -> str | None:
    """Why ``theoretical`` has no formula for ``strategy``, or None when it has one.

    It has one for plain, and for each of checkpoint-all, offload, fp16 / bf16 and micro<k> alone.

    Args:
        strategy: a ``bench.strategy.Strategy``.

    Returns:
        None, or the reason as a sentence.

    Example:
        >>> from bp_mech.bench.strategy import parse
        >>> unmodelled(parse("checkpoint-all")) is None, unmodelled(parse("checkpoint-all+fp16"))
        (True, 'the formula takes one strategy at a time (project 76 measures the combinations)')
    """
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
    """The formula ledger of one steady-state step (derivation in the chapter).

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

    Args:
        arch: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: B, sequences per update (split into k micro-batches under micro<k>).
        seq: T, tokens per sequence.
        strategy: a ``bench.strategy.Strategy`` (None: plain; ``unmodelled`` says which it covers).
        device: where the step runs ("cpu" or "cuda").
        adamw: "fused" | "foreach" (None: fused on CUDA, foreach on the CPU, as ``make_adamw``).
        offload_min_bytes: the offload's threshold (None: ``offload.min_bytes(device)``).

    Returns:
        A ``Ledger`` with source "formula", every stage of ``STAGES``, ``forward_peak`` and ``moment``.

    Raises:
        ValueError: if ``unmodelled(strategy)`` gives a reason.

    Example:
        >>> from bp_mech.bench.strategy import parse
        >>> from bp_mech.bench.workload import ARCHITECTURES
        >>> a = ARCHITECTURES["qwen05"]  # Qwen2.5-0.5B, B = 2, T = 512
        >>> plain, ckpt = theoretical(a, 2, 512, device="cuda"), theoretical(a, 2, 512, parse("checkpoint-all"), "cuda")
        >>> plain.moment, ckpt.moment, ckpt.total("forward") < plain.total("forward")
        ('the log-softmax backward', 'the end of the backward (tied embedding)', True)
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
