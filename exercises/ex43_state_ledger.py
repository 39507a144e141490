"""Exercises for Part 02 · 43 — the training-state ledger.

Write the ledger's formulas for a Qwen2 model (``transformers.Qwen2Config``, or any
object with the same attribute names): the bytes of the parameters, of their gradients,
of AdamW's state, and of the activations one decoder layer saves for backward; then the
same walk for a GELU MLP (a variant the chapter does not print), and a prediction of the
ledger's "after forward" line that a real step measures.

Check your solutions with ``bp-mech check 43`` (or ``pytest tests/test_exercises.py -m
ch43 --impl exercises``). The checks build real ``transformers`` Qwen2 models of several
shapes (tied and untied embeddings, grouped-query and plain multi-head attention) and
compare your numbers with what PyTorch actually allocates: unique parameter storages,
``.grad`` storages after a backward, AdamW's ``exp_avg`` and ``exp_avg_sq`` after one
step, and the storages a real ``Qwen2DecoderLayer`` hands to
``torch.autograd.graph.saved_tensors_hooks``; the first three in float32 and in 16-bit
models (bfloat16, float16) and float64. Byte counts must be exact.

The contract every function here is held to (the checks explore it on drawn shapes):
the result is exactly a Python ``int`` (not a float, not a tensor); ``cfg`` is not
modified (a config is shared by the model and the whole run); ``bytes_per_value`` scales
the count (1, 2, 4, 8).

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
        bytes_per_value: 8 for float64, 4 for float32, 2 for bfloat16/float16.

    Returns:
        The number of bytes, exactly an ``int``; ``cfg`` is left as it was.
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
            float16 model, 8 for float64).

    Returns:
        The number of bytes, exactly an ``int``; ``cfg`` is left as it was.
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
        The number of bytes, exactly an ``int`` (the layer runs in float32: 4 bytes per
        element); ``cfg`` is left as it was. Any batch >= 1 and seq >= 1.
    """
    raise NotImplementedError("ex43: block_saved_bytes")


def gelu_mlp_saved_bytes(hidden: int, intermediate: int, batch: int, seq: int,
                         bytes_per_value: int = 4) -> int:
    """Bytes a non-gated GELU MLP saves for backward (a variant: GPT's, BERT's MLP).

    The module is ``torch.nn.Sequential(nn.Linear(C, I), nn.GELU(), nn.Linear(I, C))``
    on an input x of shape (batch, seq, C), all in one dtype, n = batch * seq tokens:

        h = x W_up^T + b_up      (n x I)
        g = GELU(h)              (n x I; exact erf or tanh approximation)
        y = g W_down^T + b_down  (n x C)

    Walk it as Exercise 43.4 walks the Qwen2 layer: what does each backward need? Count
    each storage once (a tensor saved by two ops, or a view of one, is one storage),
    include the module's own input x, leave out the weights and biases. The answer does
    not depend on the GELU approximation nor on the biases.

    Args:
        hidden: C.
        intermediate: I.
        batch: B >= 1.
        seq: T >= 1.
        bytes_per_value: the module's dtype: 8 float64, 4 float32, 2 bfloat16/float16.

    Returns:
        The number of bytes, exactly an ``int``.
    """
    raise NotImplementedError("ex43: gelu_mlp_saved_bytes")


def predict_forward_bytes(cfg, batch: int, seq: int) -> int:
    """Predict the ledger's "after forward" total of a config (predict, then measure).

    The workload: a steady-state float32 training step of a Qwen2 model built from
    ``cfg`` (plain, no strategy; AdamW has stepped once before; ``zero_grad`` with
    ``set_to_none=True`` ran before this forward), on a batch of ``batch`` rows of
    ``seq`` tokens. The quantity: the bytes the ledger holds when the forward has
    returned the loss ("after forward"). Decide from the chapter's ledger which lines
    are alive at that moment and how big each is; your own ``param_bytes`` and
    ``block_saved_bytes`` may help.

    The check runs that step for real on the CPU (``planner.lifecycle.track``: the
    storage tracker of the chapter) at configs the chapter did not show, and accepts the
    prediction within 2 % of the measured total: the small lines a prediction may leave
    out (the RoPE cos/sin tables, the token ids and targets, AdamW's 4-byte step
    counters, the loss scalars) are under 1 % there, while leaving out or adding any
    large line misses by more than 2 % at one of the configs at least.

    Args:
        cfg: a Qwen2Config.
        batch: B.
        seq: T.

    Returns:
        The predicted bytes, exactly an ``int``; ``cfg`` is left as it was.
    """
    raise NotImplementedError("ex43: predict_forward_bytes")
