"""Part 02 · 43 — the training state by formula: the byte counts the ledger's formula
is built from.

Per Qwen2 model (a ``Qwen2Config`` or an ``ARCHITECTURES`` dict; SwiGLU, RMSNorm, GQA,
fused SDPA, tied embeddings): the bytes of its parameters, gradients and AdamW state,
and of the activations one decoder layer saves for backward, in total and storage by
storage. These are the exercise answers of the chapter (``param_bytes``, ``grad_bytes``,
``adam_state_bytes``, ``block_saved_bytes``) and the building blocks of
``bp_mech.ledger.theoretical`` (with ``dims``, ``layer_params`` and
``outer_saved_storages``).

Notation: C = hidden_size, H = num_attention_heads, d = C / H,
C_kv = num_key_value_heads * d, I = intermediate_size, V = vocab_size,
L = num_hidden_layers, n = B * T tokens.
"""

from __future__ import annotations


def dims(cfg) -> dict:
    """The sizes of a Qwen2 config, by the notation above.

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.

    Returns:
        A dict: ``C``, ``H``, ``hd`` (d), ``Ckv``, ``I``, ``V``, ``L`` (ints) and
        ``tied`` (a bool).

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> d = dims(ARCHITECTURES["tiny"])
        >>> d["C"], d["hd"], d["Ckv"], d["tied"]
        (64, 16, 32, True)
    """
    g = (lambda k: cfg[k]) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    C, H, KV = g("hidden_size"), g("num_attention_heads"), g("num_key_value_heads")
    return dict(C=C, H=H, hd=C // H, Ckv=KV * (C // H), I=g("intermediate_size"),
                V=g("vocab_size"), L=g("num_hidden_layers"),
                tied=bool(g("tie_word_embeddings")))


def layer_params(d) -> int:
    """The parameters of one decoder layer: q/k/v (with bias), o, gate/up/down, two
    RMSNorm gains.

    Args:
        d: the sizes, ``dims(cfg)``.

    Returns:
        The number of parameters, an int.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> layer_params(dims(ARCHITECTURES["tiny"]))
        46336
    """
    C, Ckv, I = d["C"], d["Ckv"], d["I"]
    return (C * C + C) + 2 * (C * Ckv + Ckv) + C * C + 3 * C * I + 2 * C


def param_bytes(cfg, bytes_per_value: int = 4) -> int:
    """Unique parameters: embedding (once if tied to lm_head), L layers, final norm.

    A layer holds q_proj (C x C + C bias), k_proj and v_proj (C_kv x C + C_kv bias
    each), o_proj (C x C), gate/up/down (3 C I) and two RMSNorm gains (2 C).

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        bytes_per_value: 4 for float32, 2 for bfloat16/float16.

    Returns:
        The number of bytes, an int.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> tiny, qwen05 = ARCHITECTURES["tiny"], ARCHITECTURES["qwen05"]
        >>> param_bytes(tiny), param_bytes(qwen05) // 4
        (469248, 494032768)
    """
    d = dims(cfg)
    n = d["V"] * d["C"] * (1 if d["tied"] else 2) + d["L"] * layer_params(d) + d["C"]
    return n * bytes_per_value


def grad_bytes(cfg, bytes_per_value: int = 4) -> int:
    """One gradient per unique parameter (a tied weight has one .grad).

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        bytes_per_value: bytes per gradient element (a ``.grad`` has its parameter's
            dtype).

    Returns:
        The number of bytes, an int (``param_bytes``).

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> grad_bytes(ARCHITECTURES["tiny"]) == param_bytes(ARCHITECTURES["tiny"])
        True
    """
    return param_bytes(cfg, bytes_per_value)


def adam_state_bytes(cfg, bytes_per_value: int = 4) -> int:
    """AdamW's two moments (exp_avg, exp_avg_sq) per parameter; the step counters come
    on top.

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        bytes_per_value: bytes per moment element (AdamW keeps its moments in the
            parameters' dtype).

    Returns:
        The number of bytes, an int (2 ``param_bytes``).

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> tiny = ARCHITECTURES["tiny"]
        >>> adam_state_bytes(tiny) == 2 * param_bytes(tiny)
        True
    """
    return 2 * param_bytes(cfg, bytes_per_value)


def block_saved_bytes(cfg, batch: int, seq: int, half: bool = False) -> int:
    """Bytes one Qwen2 decoder layer saves for backward (fused SDPA), its input
    included.

    Its weights and the shared RoPE cos/sin are excluded.
    fp32, n = B*T tokens: 4 n (8C + 2Ckv + 4I + 2) + 4 B H T, from
      RMSNorm x2: input x, 1/rms (n,1), x/rms, normed output (the q/k/v or
        gate/up input): 3C + 1 each
      attention: RoPE'd q (C) and k (Ckv), v (Ckv), SDPA output (C, also o_proj's
        input), lse (B,H,T)
      residual sum entering the second norm is that norm's x (counted above)
      SwiGLU: gate out, silu out, up out, their product (down_proj's input): 4 I
    autocast: the norms stay fp32 (x, x/rms, 1/rms), each linear saves its own
    half-precision copy of its input (q, k, v: 3 copies; gate, up: 2), SDPA saves half
    q/k/v/out, the MLP is half:
      n (30C + 4Ckv + 8I + 8) + 4 B H T.

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: B, sequences.
        seq: T, tokens per sequence.
        half: under fp16/bf16 autocast.

    Returns:
        The number of bytes, an int.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> tiny = ARCHITECTURES["tiny"]
        >>> block_saved_bytes(tiny, 2, 8), block_saved_bytes(tiny, 2, 8, half=True)
        (82304, 55680)
    """
    d, n = dims(cfg), batch * seq
    C, Ckv, I, lse = d["C"], d["Ckv"], d["I"], 4 * batch * d["H"] * seq
    if half:
        return n * (30 * C + 4 * Ckv + 8 * I + 8) + lse
    return 4 * n * (8 * C + 2 * Ckv + 4 * I + 2) + lse


def layer_saved_storages(cfg, batch: int, seq: int) -> list[int]:
    """``block_saved_bytes`` (float32) storage by storage, in bytes.

    What an offload that moves whole storages and keeps the small ones (Part 02 · 42)
    sees. n = B*T tokens: two RMSNorms (x, x/rms, normed output: 4nC each; 1/rms: 4n),
    attention (RoPE'd q 4nC and k 4nC_kv, v 4nC_kv, SDPA output 4nC, log-sum-exp 4BHT),
    SwiGLU (gate, SiLU, up, product: 4nI each).

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: B, sequences.
        seq: T, tokens per sequence.

    Returns:
        A list of 17 ints: the norms' 6 (n, C) storages, their 2 1/rms, then attention's
        5, SwiGLU's 4.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> sizes = layer_saved_storages(ARCHITECTURES["tiny"], 2, 8)
        >>> total = block_saved_bytes(ARCHITECTURES["tiny"], 2, 8)
        >>> len(sizes), sum(sizes) == total, min(sizes)
        (17, True, 64)
    """
    d, n = dims(cfg), batch * seq
    C, Ckv, I = d["C"], d["Ckv"], d["I"]
    norms = [4 * n * C] * 6 + [4 * n] * 2
    lse = 4 * batch * d["H"] * seq  # SDPA's log-sum-exp
    attention = [4 * n * C, 4 * n * Ckv, 4 * n * Ckv, 4 * n * C, lse]
    return norms + attention + [4 * n * I] * 4


def outer_saved_storages(d, batch: int, seq: int) -> list[int]:
    """The storages saved outside the layers (float32), in bytes: RoPE cos and sin
    (T, d) each, the final norm (x, x/rms, normed output, 1/rms).

    Args:
        d: the sizes, ``dims(cfg)``.
        batch: B, sequences.
        seq: T, tokens per sequence.

    Returns:
        A list of 6 ints: cos, sin, the final norm's three (n, C) storages and its
        1/rms.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> outer_saved_storages(dims(ARCHITECTURES["tiny"]), 2, 8)
        [512, 512, 4096, 4096, 4096, 64]
    """
    n = batch * seq
    return [4 * seq * d["hd"]] * 2 + [4 * n * d["C"]] * 3 + [4 * n]


def gpt_activation_bytes(cfg, batch: int, seq: int) -> float:
    """The GPT constant per layer, s b h (34 + 5 a s / h) bytes (Korthikanti et al.
    2022, eq. 2).

    It assumes 16-bit activations, a 4h GELU MLP, LayerNorm, dropout masks and the
    materialised s x s scores (s = seq, b = batch, h = hidden_size, a = heads): a
    reference, not this model's count.

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: b, sequences.
        seq: s, tokens per sequence.

    Returns:
        The number of bytes, a float.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> gpt_activation_bytes(ARCHITECTURES["tiny"], 2, 8)  # 8*2*64*(34+5*4*8/64)
        37376.0
    """
    d = dims(cfg)
    return seq * batch * d["C"] * (34 + 5 * d["H"] * seq / d["C"])


def attention_probs_bytes(cfg, batch: int, seq: int, bytes_per_value: int = 4) -> int:
    """What one layer adds if SDPA falls back to its math kernel: the (B, H, T, T)
    probabilities.

    Args:
        cfg: a ``Qwen2Config`` or an ``ARCHITECTURES`` dict.
        batch: B, sequences.
        seq: T, tokens per sequence.
        bytes_per_value: 4 for float32, 2 for 16 bits.

    Returns:
        The number of bytes, an int.

    Example:
        >>> from bp_mech.instruments.workload import ARCHITECTURES
        >>> attention_probs_bytes(ARCHITECTURES["tiny"], 2, 8)  # 2 * 4 * 8 * 8 * 4
        2048
    """
    return batch * dims(cfg)["H"] * seq * seq * bytes_per_value
