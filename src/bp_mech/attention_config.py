"""Part 02 · 10 — the shape of the attention the hand-written strategies of
``bp_mech.attention_strategies`` run (``AttnConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttnConfig:
    """The shape of the attention the strategies run: batch, heads, head width, RoPE base, tile.

    Args:
        batch: B, sequences.
        heads: H, query heads.
        kv_heads: Hkv, key/value heads; query head h reads KV head h // (H // Hkv).
        head_dim: d, width of one head.
        rope_theta: RoPE base.
        block: tile edge of the recompute strategy.

    Example:
        >>> cfg = AttnConfig(batch=2, heads=4, kv_heads=2, head_dim=8, rope_theta=1e4)
        >>> cfg.block, cfg.heads // cfg.kv_heads
        (64, 2)
    """

    batch: int  # B, sequences
    heads: int  # H, query heads
    kv_heads: int  # Hkv, key/value heads; query head h reads KV head h // (H // Hkv)
    head_dim: int  # d, width of one head
    rope_theta: float  # RoPE base
    block: int = 64  # tile edge of the recompute strategy

    @classmethod
    def from_arch(cls, arch: str, batch: int, block: int = 64) -> "AttnConfig":
        """The attention of an architecture of ``bp_mech.instruments.workload.ARCHITECTURES``.

        Args:
            arch: an architecture name, e.g. ``"tiny"`` or ``"qwen05"``.
            batch: B, sequences.
            block: tile edge of the recompute strategy.

        Returns:
            Its ``AttnConfig``: heads, KV heads, head width hidden_size / heads, RoPE base.

        Example:
            >>> AttnConfig.from_arch("qwen05", batch=1)
            AttnConfig(batch=1, heads=14, kv_heads=2, head_dim=64, rope_theta=1000000.0, block=64)
        """
        from bp_mech.instruments.workload import ARCHITECTURES

        a = ARCHITECTURES[arch]
        return cls(batch, a["num_attention_heads"], a["num_key_value_heads"],
                   a["hidden_size"] // a["num_attention_heads"], a["rope_theta"], block)
