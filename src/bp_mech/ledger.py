"""Part 02 · 43 — the training-state ledger: what a ledger is, and what it should hold by
formula.

A ledger splits the memory of one steady-state training step (AdamW, its moments already
allocated by a warm-up step) by **lifecycle stage** (``STAGES``) and by **object class**
(``CLASSES``). That table (``Ledger``, with ``STAGES`` and ``CLASSES``) is defined in
``bp_mech.ledger_table``; this module fills it from theory:
``theoretical`` derives every line for the Qwen2 block (SwiGLU, RMSNorm, GQA, fused SDPA,
tied embeddings, fp32 logits) from what each operator saves for backward. Its building blocks
are the exercise answers of the chapter (``param_bytes``, ``grad_bytes``, ``adam_state_bytes``,
``block_saved_bytes``), which live in ``bp_mech.state_bytes`` with ``layer_saved_storages``,
``gpt_activation_bytes`` and ``attention_probs_bytes``.

``bp_mech.planner.lifecycle`` fills the same table from a real or a fake-tensor step (the
storage tracker of ``bp_mech.instruments.tracking``); ``bp_mech.experiments.ledger`` compares the
three sources (TRAIN-STATE-LEDGER).
"""

from __future__ import annotations

import torch

from bp_mech.ledger_table import CLASSES, STAGES, Ledger
from bp_mech.state_bytes import (block_saved_bytes, dims, layer_params, layer_saved_storages,
                                 outer_saved_storages, param_bytes)


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

def theoretical(arch, batch: int, seq: int, strategy=None, device="cpu",
                adamw: str | None = None,
                offload_min_bytes: int | None = None) -> Ledger:
    """The formula ledger of one steady-state step (derivation in the chapter).

    n = B T / k tokens per micro-batch, W = ``param_bytes``, M = 2W (+ 4-byte steps),
    E = 4 V C:
      after load       W (+ the RoPE buffers)
      after forward    W + M + batch + saved + log-softmax output 4 n V
                       (+ targets, scalars)
      peak in backward the largest of: the log-softmax backward (saved + 3 x 4 n V);
                       each layer's MLP backward (gradients so far + its live
                       tensors); with tied embeddings the end (all gradients +
                       lm_head's, held by the engine, + the embedding's)
      after backward   W + M + W (gradients)
      optimizer step   + W with the foreach AdamW (one temporary per tensor, all at
                       once); + 0 fused
      after zero_grad  W + M
    saved = L A + RoPE + final norm (plain, amp, accumulation); L layer inputs
    (checkpoint); with offload only the saved storages under ``offload_min_bytes``
    (``layer_saved_storages``), which Part 02 · 42's ``ActivationOffload`` leaves on
    the device (parameters it keeps cost nothing extra).

    Args:
        arch: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: B, sequences per update (split into k micro-batches under micro<k>).
        seq: T, tokens per sequence.
        strategy: a ``bench.strategy.Strategy`` (None: plain; ``unmodelled`` says
            which it covers).
        device: where the step runs ("cpu" or "cuda").
        adamw: "fused" | "foreach" (None: fused on CUDA, foreach on the CPU, as
            ``make_adamw``).
        offload_min_bytes: the offload's threshold (None: ``offload.min_bytes``).

    Returns:
        A ``Ledger`` with source "formula", every stage of ``STAGES``,
        ``forward_peak`` and ``moment``.

    Raises:
        ValueError: if ``unmodelled(strategy)`` gives a reason.

    Example:
        >>> from bp_mech.bench.strategy import parse
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> a = ARCHITECTURES["qwen05"]  # Qwen2.5-0.5B, B = 2, T = 512
        >>> plain = theoretical(a, 2, 512, device="cuda")
        >>> ckpt = theoretical(a, 2, 512, parse("checkpoint-all"), "cuda")
        >>> plain.moment, ckpt.moment, ckpt.total("forward") < plain.total("forward")
        ('the log-softmax backward', 'the end of the backward (tied embedding)', True)
    """
    from bp_mech.offload import min_bytes

    if strategy is not None and (why := unmodelled(strategy)):
        raise ValueError(f"no formula for {strategy.name!r}: {why}")
    on_cpu = torch.device(device).type == "cpu"
    fused = (adamw or ("foreach" if on_cpu else "fused")) == "fused"
    threshold = min_bytes(device) if offload_min_bytes is None else offload_min_bytes
    s = strategy
    kind = ("plain" if s is None else "checkpoint" if s.checkpoint != "plain"
            else "offload" if s.offload else "amp" if s.amp
            else "accumulation" if s.micro_batches > 1 else "plain")
    name = "plain" if strategy is None else strategy.name
    d = dims(arch)
    C, Ckv, I, V, L, hd = d["C"], d["Ckv"], d["I"], d["V"], d["L"], d["hd"]
    k = strategy.micro_batches if kind == "accumulation" else 1
    b, n, amp = batch // k, batch * seq // k, kind == "amp"  # per micro-batch
    W = param_bytes(arch)  # weights = gradients (fp32)
    n_tensors = 2 + L * 12 + (0 if d["tied"] else 1)
    params = W + 4 * hd  # + RoPE inv_freq buffers
    # autocast's half weight copies, per layer, and lm_head's; each is freed by its
    # layer's backward
    wl = 2 * (2 * C * C + 2 * C * Ckv + 3 * C * I) if amp else 0
    wcopy = L * wl + (2 * V * C if amp else 0)
    # two moments + a 4-byte step per tensor, on the device (CPU, or fused), a host
    # scalar (foreach on CUDA)
    M = 2 * W + (4 * n_tensors if on_cpu or fused else 0)
    batch_b = 16 * batch * seq  # input_ids + labels, int64
    E = 4 * V * C  # embedding / lm_head weight (tied)
    A = block_saved_bytes(arch, b, seq, amp)
    R = 8 * seq * hd  # RoPE cos + sin, fp32, shared by the layers
    F = 4 * n * ((2 if amp else 3) * C + 1)  # final norm
    Pl = 4 * layer_params(d)

    def stay(sizes):  # what offload keeps on the device
        return sum(x for x in sizes if x < threshold)

    layer_stays = stay(layer_saved_storages(arch, b, seq))
    outer = outer_saved_storages(d, b, seq)
    saved = {"checkpoint": L * 4 * n * C + 8 * seq + R + F,
             "offload": L * layer_stays + stay(outer)}.get(kind, L * A + R + F)
    # log-softmax output, targets (int64), a scalar
    logits_saved = [4 * n * V, 8 * n, 4]
    kept = stay(logits_saved) if kind == "offload" else sum(logits_saved)
    logits_fwd = kept + 4 + (2 * n * C if amp else 0)
    g_prev = W if k > 1 else 0  # accumulation: the last micro-batch starts with grads
    losses = 4 * k
    opt_tmp = 0 if fused else W  # foreach: a temporary per tensor at once; fused: none

    def row(**kw):
        return {c: kw.get(c, 0) for c in CLASSES}

    base = dict(parameters=params + wcopy, optimizer_states=M, gradients=g_prev)
    state = dict(parameters=params, optimizer_states=M, logits_loss=losses)
    stages = {
        "load": row(parameters=params),
        "forward": row(**base, saved_activations=saved,
                       logits_loss=logits_fwd + losses - 4, other=batch_b),
        "backward": row(**state, gradients=W, other=batch_b),
        "optimizer_peak": row(**state, gradients=W, other=batch_b + opt_tmp),
        "zero_grad": row(**state, other=batch_b)}
    # backward peak: the largest of the candidate moments
    half = 2 if amp else 4
    lsm = 12 * n * V + losses + (2 * n * C if amp else 0)
    events = {"the log-softmax backward": row(**base, saved_activations=saved,
                                              other=batch_b, logits_loss=lsm)}
    for l in range(L):  # layer l's MLP backward (mul node): dy, d(a*u), da, du alive
        # gradients so far (with k > 1 each new one is added in place into .grad and
        # freed)
        grads = W + E + 4 * C * I if k > 1 else E + 4 * C + (L - 1 - l) * Pl + 4 * C * I
        wl_l = params + (l + 1) * wl - (4 * C * I if amp else 0)
        g = dict(base, gradients=grads, parameters=wl_l)
        if kind == "checkpoint":
            sv = (l + 1) * 4 * n * C + 8 * seq + R + A - 4 * n * C - 4 * n * I
            tmp = 4 * n * C + 12 * n * I
        elif kind == "offload":
            # the small storages of layers 0..l stay; a and u come back (unpacked)
            sv, tmp = (l + 1) * layer_stays, 4 * n * C + 20 * n * I
            # RoPE cos/sin: saved by every layer, so back on the device from the top
            # layer's attention backward to layer 0's (the copy lives while a saved
            # view of it waits)
            rope = [x for x in outer[:2] if x >= threshold]
            sv, tmp = sv + stay(outer[:2]), tmp + (sum(rope) if l < L - 1 else 0)
        else:
            # (amp: half-precision MLP gradients, approximate; the log-softmax moment
            # dominates)
            sv, tmp = (l + 1) * A + R - half * n * I, 4 * n * C + 3 * half * n * I
        events[f"layer {l}'s MLP backward"] = row(
            **g, saved_activations=sv, other=batch_b + tmp, logits_loss=losses)
    if d["tied"]:
        # the end: lm_head's gradient (held by the engine) + the embedding's + their sum
        end_grads = W + 2 * E + (E if k > 1 else 0)
        events["the end of the backward (tied embedding)"] = row(
            **dict(base, parameters=params, gradients=end_grads), other=batch_b,
            logits_loss=losses)
    moment = max(events, key=lambda e: sum(events[e].values()))
    stages["backward_peak"] = events[moment]
    fpeak = (sum(stages["forward"].values()) + 4 * n * V + 8 * b * (seq + 1)
             + (2 * n * V if amp else 0))
    return Ledger("formula", name, {x: stages[x] for x in STAGES}, forward_peak=fpeak,
                  moment=moment)
