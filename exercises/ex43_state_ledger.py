"""Exercises for Part 02 · 43 — the training-state ledger.

Write the ledger's formulas for a Qwen2 model (``transformers.Qwen2Config``, or any
object with the same attribute names): the bytes of the parameters, of their gradients,
of AdamW's state, and of the activations one decoder layer saves for backward.

Check your solutions with ``bp-mech check 43`` (or ``pytest tests/test_exercises.py -m
ch43 --impl exercises``). The checks build real ``transformers`` Qwen2 models of several
shapes (tied and untied embeddings, grouped-query and plain multi-head attention) and
compare your numbers with what PyTorch actually allocates: unique parameter storages,
``.grad`` storages after a backward, AdamW's ``exp_avg`` and ``exp_avg_sq`` after one
step, and the storages a real ``Qwen2DecoderLayer`` hands to
``torch.autograd.graph.saved_tensors_hooks``; the first three in float32 and in 16-bit
models (bfloat16, float16). Byte counts must be exact.

Notation: C = hidden_size, H = num_attention_heads, KV = num_key_value_heads,
d = C / H (head dim), C_kv = KV * d, I = intermediate_size, V = vocab_size,
L = num_hidden_layers.
"""


def param_bytes(cfg, bytes_per_value: int = 4) -> int:
    """Bytes of a ``Qwen2ForCausalLM``'s parameters.

    A decoder layer holds q_proj (C x C weight + C bias), k_proj and v_proj (C_kv x C
    weight + C_kv bias each), o_proj (C x C, no bias), gate_proj and up_proj (I x C),
    down_proj (C x I) and two RMSNorm gains (C each). Around the layers: the token
    embedding (V x C), a final RMSNorm (C) and lm_head (V x C, no bias). With
    ``cfg.tie_word_embeddings`` lm_head *is* the embedding: one tensor, counted once.

    Args:
        cfg: a Qwen2Config (hidden_size, num_attention_heads, num_key_value_heads,
            intermediate_size, vocab_size, num_hidden_layers, tie_word_embeddings).
        bytes_per_value: 4 for float32, 2 for bfloat16/float16.

    Returns:
        The number of bytes, an int.
    """
    raise NotImplementedError("ex43: param_bytes")


def grad_bytes(cfg, bytes_per_value: int = 4) -> int:
    """Bytes of the gradients after ``loss.backward()``: one ``.grad`` per parameter
    tensor that requires grad, same shape and dtype. A tied weight receives
    contributions from two places (embedding lookup and lm_head) but has a single
    ``.grad``.

    Args:
        cfg: a Qwen2Config.
        bytes_per_value: bytes per gradient element: a ``.grad`` has its parameter's
            dtype (4 for a float32 model, 2 for a bfloat16 or float16 one).

    Returns:
        The number of bytes, an int.
    """
    raise NotImplementedError("ex43: grad_bytes")


def adam_state_bytes(cfg, bytes_per_value: int = 4) -> int:
    """Bytes of AdamW's moment buffers after the first ``step()``: ``exp_avg`` (m) and
    ``exp_avg_sq`` (v), each shaped like its parameter (Loshchilov & Hutter 2019, Alg.
    2). Leave out the per-tensor ``step`` counters (4-byte scalars).

    Args:
        cfg: a Qwen2Config.
        bytes_per_value: bytes per moment element: ``torch.optim.AdamW`` makes its
            moments in the dtype of the parameters (4 for float32, 2 for a bfloat16 or
            float16 model).

    Returns:
        The number of bytes, an int.
    """
    raise NotImplementedError("ex43: adam_state_bytes")


def block_saved_bytes(cfg, batch: int, seq: int) -> int:
    """Bytes one ``Qwen2DecoderLayer`` (float32, SDPA attention, causal, no mask) saves
    for backward, with n = batch * seq tokens.

    Count each *storage* once (several ops may save the same tensor, or views of it),
    include the layer's own input, and leave out the layer's weights and the RoPE
    cos/sin (made once per forward, shared by all layers). Walk the layer op by op and
    ask what each backward needs:

    * RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))`` (twice): x, the (n, 1) reciprocal
      rms, x * rsqrt(...) (for the gain's gradient), and its output, which the next
      projections save;
    * attention: the RoPE'd q (n x C) and k (n x C_kv), v (n x C_kv); the fused SDPA
      kernel saves q, k, v, its output (n x C, stored so that o_proj's input is the same
      storage) and the log-sum-exp, float32 of shape (batch, H, seq) — no seq x seq
      matrix;
    * the residual sum entering the second RMSNorm is that norm's x;
    * SwiGLU: gate output, silu output, up output and their product (n x I each).

    Args:
        cfg: a Qwen2Config.
        batch: B, sequences.
        seq: T, tokens per sequence.

    Returns:
        The number of bytes, an int (the layer runs in float32: 4 bytes per element).
    """
    raise NotImplementedError("ex43: block_saved_bytes")
