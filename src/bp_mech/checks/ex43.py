"""Checks of exercises/ex43_state_ledger.py against what PyTorch allocates (never the answer file).

Every check builds real ``transformers`` Qwen2 modules of several shapes (tied and untied
embeddings, grouped-query and multi-head attention) and measures: unique parameter
storages, ``.grad`` storages after a backward, AdamW's two moments after one step, and the
storages a ``Qwen2DecoderLayer`` hands to ``saved_tensors_hooks``. Byte counts must match
exactly: a ledger line is a count, not an estimate. Parameters, gradients and AdamW's moments are
measured in float32 (4 bytes per value) and in bfloat16 and float16 (2 bytes: a model cast with
``.to(dtype)``, whose gradients and moments take its dtype).
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from bp_mech.checks.common import call

# (hidden, heads, kv heads, intermediate, vocab, layers, tied)
SHAPES = [(48, 6, 2, 100, 97, 2, True), (32, 4, 4, 72, 61, 3, False), (64, 8, 1, 120, 130, 1, True)]
DTYPES = [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)]  # (model dtype, bytes_per_value)


def _config(shape) -> Qwen2Config:
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


def _describe(shape, extra=""):
    C, H, KV, I, V, L, tied = shape
    return f"hidden {C}, heads {H}, kv heads {KV}, intermediate {I}, vocab {V}, layers {L}, tied={tied}{extra}"


def _equal(fn, got, want, at):
    try:
        value = int(got)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{fn}: returned {got!r:.60}, expected an int number of bytes at {at}") from None
    assert value == want, f"{fn}: {value} bytes, PyTorch allocates {want} ({value - want:+d}) at {at}"


def _dtype_at(shape, dtype, nb):
    return _describe(shape, f"; {str(dtype)[6:]}, bytes_per_value={nb}")


def check_param_bytes(m):
    for shape in SHAPES:
        cfg = _config(shape)
        for dtype, nb in DTYPES:
            at = _dtype_at(shape, dtype, nb)
            model = _model(cfg, dtype)
            _equal("param_bytes", call("param_bytes", m.param_bytes, cfg, nb, at=at), _unique_bytes(model.parameters()),
                   at)


def _backward(model, cfg, B=2, T=12):
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()


def check_grad_bytes(m):
    for shape in SHAPES:
        cfg = _config(shape)
        for dtype, nb in DTYPES[:2]:
            at = _dtype_at(shape, dtype, nb)
            model = _model(cfg, dtype)
            _backward(model, cfg)
            want = _unique_bytes(p.grad for p in model.parameters())
            _equal("grad_bytes", call("grad_bytes", m.grad_bytes, cfg, nb, at=at), want, at)


def check_adam_state_bytes(m):
    for shape in SHAPES:
        cfg = _config(shape)
        for dtype, nb in DTYPES[:2]:
            at = _dtype_at(shape, dtype, nb)
            model = _model(cfg, dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _backward(model, cfg)
            opt.step()
            moments = (t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
            want = _unique_bytes(moments)
            _equal("adam_state_bytes", call("adam_state_bytes", m.adam_state_bytes, cfg, nb, at=at), want, at)


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


def check_block_saved_bytes(m):
    for shape, (B, T) in zip(SHAPES, [(2, 16), (3, 10), (1, 33)]):
        cfg = _config(shape)
        at = _describe(shape, f"; batch {B}, seq {T}")
        got = call("block_saved_bytes", m.block_saved_bytes, cfg, B, T, at=at)
        _equal("block_saved_bytes", got, measure_block_saved_bytes(cfg, B, T), at)


CHECKS = [check_param_bytes, check_grad_bytes, check_adam_state_bytes, check_block_saved_bytes]
