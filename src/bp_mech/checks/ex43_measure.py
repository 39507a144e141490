"""Measurements for the checks of Part 02 · 43 (``ex43``, ``ex43_contract``): what PyTorch allocates.

Real ``transformers`` Qwen2 modules of a given shape ``(hidden, heads, kv heads, intermediate, vocab, layers,
tied)``: unique parameter storages, ``.grad`` storages after a backward, AdamW's two moments after one step,
and the storages a ``Qwen2DecoderLayer`` hands to ``saved_tensors_hooks``. Never the answer file.
"""

import functools

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RotaryEmbedding,
)


def shape_config(shape) -> Qwen2Config:
    """The Qwen2 config of a check's shape (SDPA attention, no KV cache).

    Args:
        shape: (hidden, heads, kv heads, intermediate, vocab, layers, tied).

    Returns:
        A ``Qwen2Config``.
    """
    C, H, KV, I, V, L, tied = shape
    return Qwen2Config(hidden_size=C, num_attention_heads=H, num_key_value_heads=KV, intermediate_size=I,
                       vocab_size=V, num_hidden_layers=L, tie_word_embeddings=tied, max_position_embeddings=256,
                       use_cache=False, attn_implementation="sdpa")


def _model(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype).train()


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what memory actually holds)."""
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def describe_shape(shape, extra=""):
    """A check's shape in words, for a failure message.

    Args:
        shape: (hidden, heads, kv heads, intermediate, vocab, layers, tied).
        extra: appended as is.

    Returns:
        The words, a str.
    """
    C, H, KV, I, V, L, tied = shape
    return f"hidden {C}, heads {H}, kv heads {KV}, intermediate {I}, vocab {V}, layers {L}, tied={tied}{extra}"


def describe_dtype(shape, dtype, nb):
    """``describe_shape`` with the dtype and ``bytes_per_value`` the check asked for.

    Args:
        shape: as ``describe_shape``'s.
        dtype: the torch dtype.
        nb: the bytes per value.

    Returns:
        The words, a str.
    """
    return describe_shape(shape, f"; {str(dtype)[6:]}, bytes_per_value={nb}")


@functools.cache
def measure_state(shape, dtype=torch.float32) -> tuple[int, int, int]:
    """(parameter, gradient, AdamW moment) bytes of a real ``Qwen2ForCausalLM`` of ``shape`` in ``dtype``:
    unique storages after a backward and one ``AdamW.step()`` (cached: the checks share the models)."""
    cfg = shape_config(shape)
    model = _model(cfg, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _backward(model, cfg)
    opt.step()
    moments = (t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return (_unique_bytes(model.parameters()), _unique_bytes(p.grad for p in model.parameters()),
            _unique_bytes(moments))


def _backward(model, cfg, B=2, T=12):
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()


def measure_block_saved_bytes(cfg, batch: int, seq: int) -> int:
    """Distinct storages a real Qwen2DecoderLayer saves for backward, minus its weights and cos/sin."""
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(cfg, layer_idx=0).train()
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = Qwen2RotaryEmbedding(cfg)(x, pos)
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)
    assert y.shape == x.shape
    return _unique_bytes(t for t in saved if t.untyped_storage().data_ptr() not in skip)
