"""Measurements for the checks of Part 02 · 43 (``ex43``): what PyTorch allocates, never the answer file.

Real ``transformers`` Qwen2 modules of a given shape ``(hidden, heads, kv heads, intermediate, vocab, layers,
tied)``: unique parameter storages, ``.grad`` storages after a backward, AdamW's two moments after one step, the
storages a ``Qwen2DecoderLayer`` hands to ``saved_tensors_hooks``; those of a ``torch.nn`` GELU MLP; the "after
forward" total of a real steady-state step (``planner.lifecycle.track``). Each is cached: the checks and a
shrinking failure share the models.
"""

import functools

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

# (hidden, heads, kv heads, intermediate, vocab, layers, tied): the chapter's shapes (grouped-query, plain multi-head
# and multi-query attention, tied and untied, one to three layers), then a pool hypothesis draws from: one query
# head, head dims 2 to 8, odd sizes. A fixed pool, so that the measured models are reused.
SHAPES = [(48, 6, 2, 100, 97, 2, True), (32, 4, 4, 72, 61, 3, False), (64, 8, 1, 120, 130, 1, True)]
POOL = [(2, 1, 1, 3, 5, 1, True), (8, 2, 2, 9, 11, 1, False), (12, 3, 1, 20, 7, 2, True), (16, 4, 2, 24, 33, 1, True),
        (16, 2, 1, 5, 17, 2, False), (24, 3, 3, 40, 29, 1, False), (32, 4, 4, 13, 64, 2, True),
        (8, 4, 1, 16, 3, 1, True), (6, 1, 1, 31, 40, 2, False), (24, 4, 2, 7, 50, 1, False)]
FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
          "num_hidden_layers", "tie_word_embeddings")


def shape_config(shape) -> Qwen2Config:
    """The Qwen2 config of a check's shape (SDPA attention, no KV cache).

    Args:
        shape: (hidden, heads, kv heads, intermediate, vocab, layers, tied).

    Returns:
        A ``Qwen2Config``.
    """
    return Qwen2Config(**dict(zip(FIELDS, shape)), max_position_embeddings=256, use_cache=False,
                       attn_implementation="sdpa")


def shape_of(cfg) -> tuple:
    """The shape of a config, ``shape_config``'s inverse (the key the measurements are cached by)."""
    return tuple(getattr(cfg, f) for f in FIELDS)


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


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what memory actually holds)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}.values())


def _saved(run, skip) -> int:
    """Bytes of the distinct storages ``run()`` hands to ``saved_tensors_hooks``, those of ``skip`` left out."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        run()
    skip = {t.untyped_storage().data_ptr() for t in skip}
    return _unique_bytes(t for t in saved if t.untyped_storage().data_ptr() not in skip)


@functools.cache
def measure_state(shape, dtype=torch.float32) -> tuple[int, int, int]:
    """(parameter, gradient, AdamW moment) bytes of a real ``Qwen2ForCausalLM`` of ``shape`` cast to ``dtype``:
    unique storages after a backward and one ``AdamW.step()``."""
    cfg = shape_config(shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    moments = (t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return (_unique_bytes(model.parameters()), _unique_bytes(p.grad for p in model.parameters()),
            _unique_bytes(moments))


def measure_block_saved_bytes(cfg, batch: int, seq: int) -> int:
    """Distinct storages a real float32 Qwen2DecoderLayer saves for backward, minus its weights and cos/sin."""
    return _block(shape_of(cfg), batch, seq)


@functools.cache
def _block(shape, batch: int, seq: int) -> int:
    cfg = shape_config(shape)
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(cfg, layer_idx=0).train()
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = Qwen2RotaryEmbedding(cfg)(x, pos)
    return _saved(lambda: layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos),
                  (*layer.parameters(), cos, sin))


@functools.cache
def measure_gelu_mlp_saved_bytes(C: int, I: int, B: int, T: int, dtype=torch.float32, approximate="none",
                                 bias=True) -> int:
    """Distinct storages ``Linear(C, I) -> GELU -> Linear(I, C)`` hands to ``saved_tensors_hooks``, weights
    and biases left out."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(C, I, bias=bias), torch.nn.GELU(approximate=approximate),
                              torch.nn.Linear(I, C, bias=bias)).to(dtype).train()
    x = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    return _saved(lambda: mlp(x), mlp.parameters())


@functools.cache
def measure_forward_bytes(shape, batch: int, seq: int) -> int:
    """The "after forward" total of a real steady-state plain float32 step on the CPU (the chapter's tracker)."""
    from bp_mech.planner import lifecycle
    from bp_mech.planner.build import ConfigWorkload
    return lifecycle.track(ConfigWorkload(shape_config(shape), batch, seq)).total("forward")
