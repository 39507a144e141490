"""Public model shapes the book and the benchmark plan: the fields of each model's published ``config.json``
that set its memory (the weights are never read), as Transformers configs built offline."""

from __future__ import annotations

SHAPES = {
    # Qwen/Qwen2.5-7B's config.json
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0,
                       rms_norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-70B's config.json
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0,
                        rms_norm_eps=1e-5),
}


def public_config(name: str):
    """The Transformers config of a public shape (``SHAPES``), built offline.

    Example:
        >>> public_config("qwen2.5-7b").num_hidden_layers
        28
    """
    from transformers import AutoConfig

    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
