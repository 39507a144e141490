"""Part 02 · 10 — the two hand-written attention strategies, and what each saves for the backward.

Built from the mechanism in ``bp_mech.attention_backward`` (RoPE, GQA, causal softmax
and their backward), the two strategies differ only in what the forward keeps for the
backward:

* ``saved_probs``: P itself, B·H·T·T numbers;
* ``recompute``: Q, K, V, O and the row log-sum-exp L (B·H·T); the backward rebuilds P
  one tile at a time as exp(S − L) and uses rowsum(dP ⊙ P) = rowsum(dO ⊙ O)
  (FlashAttention, Dao et al. 2022), so no T×T matrix ever exists.

Both run inside one ``torch.autograd.Function`` whose forward calls
``ctx.save_for_backward`` on exactly what the strategy keeps, so ``saved_bytes`` can
count it with saved-tensor hooks; ``saved_bytes_formula`` is the cross-check. The
framework's versions they are checked against: ``bp_mech.attention_framework``; the
experiment that checks and measures them: ``bp_mech.experiments.attention_backward``.
"""

from __future__ import annotations

import torch

from bp_mech.attention_backward import (attention_backward, attention_forward, blockwise_backward,
                                        blockwise_forward, gqa_expand, gqa_reduce)
from bp_mech.attention_config import AttnConfig
from bp_mech.attention_rope import rope_backward, rope_forward
from bp_mech.instruments.counters import SavedBytesCounter


# --- the two strategies with RoPE and GQA: forward -> (O, saved), backward(saved) --------
# q (B, H, T, d) and k, v (B, Hkv, T, d) before RoPE; cos, sin broadcast to (B, H, T, d).

def saved_probs_forward(q, k, v, cos, sin, block=None):
    """Strategy ``saved_probs``, forward: RoPE, GQA, causal attention; it keeps P (B, H, T, T).

    Args:
        q: queries (B, H, T, d), before RoPE.
        k, v: keys, values (B, Hkv, T, d), keys before RoPE.
        cos, sin: RoPE tables broadcasting to (B, H, T, d), e.g. (T, d) from
            ``rope_cos_sin``.
        block: unused (both strategies take the same arguments).

    Returns:
        ``(O, saved)``: the output (B, H, T, d) and ``saved = (q̃, k̃, v, P, cos,
        sin)``: the RoPE'd q̃ (B, H, T, d) and k̃ (B, Hkv, T, d), v, the probabilities P
        (B, H, T, T), the tables.

    Example:
        >>> q, k, v = (torch.ones(1, h, 5, 4) for h in (4, 2, 2))
        >>> O, saved = saved_probs_forward(q, k, v, torch.ones(5, 4), torch.zeros(5, 4))
        >>> tuple(O.shape), [tuple(t.shape) for t in saved]
        ((1, 4, 5, 4), [(1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4), (1, 4, 5, 5), (5, 4), (5, 4)])
    """
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, P, _ = attention_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]))
    return o, (qr, kr, v, P, cos, sin)


def saved_probs_backward(saved, dO, block=None):
    """Strategy ``saved_probs``, backward: ``attention_backward`` from P, GQA sums, RoPE backward.

    Args:
        saved: the tuple ``saved_probs_forward`` returned.
        dO: dL/dO (B, H, T, d).
        block: unused.

    Returns:
        ``(dq, dk, dv)``: (B, H, T, d), (B, Hkv, T, d), (B, Hkv, T, d), the gradients of
        the inputs before RoPE.

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> kw = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(0),
        ...           requires_grad=True)
        >>> q, k, v, dO = (torch.randn(1, h, 5, 4, **kw) for h in (4, 2, 2, 4))
        >>> O, saved = saved_probs_forward(q, k, v, *rope_cos_sin(5, 4, 1e4, torch.float64))
        >>> all(map(torch.allclose, saved_probs_backward(saved, dO), torch.autograd.grad(O, (q, k, v), dO)))
        True
    """
    qr, kr, v, P, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = attention_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), P, dO)
    return rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin), gqa_reduce(dv, Hkv)


def recompute_forward(q, k, v, cos, sin, block=64):
    """Strategy ``recompute``, forward: RoPE, GQA, ``blockwise_forward``; it keeps O and L, not P.

    Args:
        q: queries (B, H, T, d), before RoPE.
        k, v: keys, values (B, Hkv, T, d), keys before RoPE.
        cos, sin: RoPE tables broadcasting to (B, H, T, d), e.g. (T, d) from
            ``rope_cos_sin``.
        block: tile edge of the blockwise forward.

    Returns:
        ``(O, saved)``: the output (B, H, T, d) and ``saved = (q̃, k̃, v, O, L, cos,
        sin)``: the RoPE'd q̃ (B, H, T, d) and k̃ (B, Hkv, T, d), v, O, the row
        log-sum-exp L (B, H, T), the tables.

    Example:
        >>> q, k, v = (torch.ones(1, h, 5, 4) for h in (4, 2, 2))
        >>> O, saved = recompute_forward(q, k, v, torch.ones(5, 4), torch.zeros(5, 4), block=2)
        >>> [tuple(t.shape) for t in saved]  # no (T, T) tensor
        [(1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4), (1, 4, 5, 4), (1, 4, 5), (5, 4), (5, 4)]
    """
    qr, kr = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    o, lse = blockwise_forward(qr, gqa_expand(kr, q.shape[1]), gqa_expand(v, q.shape[1]), block)
    return o, (qr, kr, v, o, lse, cos, sin)


def recompute_backward(saved, dO, block=64):
    """Strategy ``recompute``, backward: ``blockwise_backward``, GQA sums, RoPE.

    ``blockwise_backward`` rebuilds P one tile at a time.

    Args:
        saved: the tuple ``recompute_forward`` returned.
        dO: dL/dO (B, H, T, d).
        block: tile edge of the blockwise backward.

    Returns:
        ``(dq, dk, dv)``: (B, H, T, d), (B, Hkv, T, d), (B, Hkv, T, d), the gradients of
        the inputs before RoPE.

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> g = torch.Generator().manual_seed(1)
        >>> q, k, v, dO = (torch.randn(2, h, 7, 4, dtype=torch.float64, generator=g)
        ...                for h in (4, 2, 2, 4))
        >>> cs = rope_cos_sin(7, 4, 1e4, torch.float64)
        >>> saved = recompute_forward(q, k, v, *cs, block=3)[1]  # 3 does not divide 7
        >>> tiled = recompute_backward(saved, dO, block=3)
        >>> # the same gradients, from P
        >>> full = saved_probs_backward(saved_probs_forward(q, k, v, *cs)[1], dO)
        >>> all(torch.allclose(a, b) for a, b in zip(tiled, full))
        True
    """
    qr, kr, v, o, lse, cos, sin = saved
    H, Hkv = qr.shape[1], kr.shape[1]
    dq, dk, dv = blockwise_backward(qr, gqa_expand(kr, H), gqa_expand(v, H), o, lse, dO,
                                    block)
    return (rope_backward(dq, cos, sin), rope_backward(gqa_reduce(dk, Hkv), cos, sin),
            gqa_reduce(dv, Hkv))


STRATEGIES = {"saved_probs": (saved_probs_forward, saved_probs_backward),
              "recompute": (recompute_forward, recompute_backward)}


class HandAttention(torch.autograd.Function):
    """A hand-written strategy under autograd; it saves exactly its ``saved`` tuple.

    Called as ``HandAttention.apply(q, k, v, cos, sin, strategy, block)``, the arguments
    of ``forward``; autograd calls ``backward`` with dL/dO.

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> kw = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(0),
        ...           requires_grad=True)
        >>> q, k, v = (torch.randn(1, h, 5, 4, **kw) for h in (4, 2, 2))
        >>> cos, sin = rope_cos_sin(5, 4, 1e4, torch.float64)
        >>> def f(q, k, v):
        ...     return HandAttention.apply(q, k, v, cos, sin, "recompute", 2)
        >>> torch.autograd.gradcheck(f, (q, k, v))
        True
    """

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, strategy: str, block: int):
        """The strategy's forward; only its ``saved`` tuple is saved for backward.

        Args:
            ctx: the autograd context (``apply`` supplies it).
            q: queries (B, H, T, d); k, v: keys, values (B, Hkv, T, d); all before RoPE.
            cos, sin: RoPE tables broadcasting to (B, H, T, d).
            strategy: a key of ``STRATEGIES``: ``"saved_probs"`` or ``"recompute"``.
            block: tile edge of ``recompute`` (unused by ``saved_probs``).

        Returns:
            O (B, H, T, d).

        Example:
            >>> q, k, v = (torch.ones(1, h, 5, 4) for h in (4, 2, 2))
            >>> cos, sin = torch.ones(5, 4), torch.zeros(5, 4)
            >>> tuple(HandAttention.apply(q, k, v, cos, sin, "saved_probs", 64).shape)
            (1, 4, 5, 4)
        """
        fwd, ctx.bwd = STRATEGIES[strategy]
        o, saved = fwd(q, k, v, cos, sin, block)
        ctx.block = block
        ctx.save_for_backward(*saved)
        return o

    @staticmethod
    def backward(ctx, dO):
        """The strategy's backward, from the tensors ``forward`` saved.

        Args:
            ctx: the context ``forward`` filled.
            dO: dL/dO (B, H, T, d).

        Returns:
            ``(dq, dk, dv, None, None, None, None)``: the gradients of q (B, H, T, d), k
            and v (B, Hkv, T, d); none for cos, sin, strategy, block.

        Example:
            >>> q, k, v = (torch.ones(1, h, 5, 4, requires_grad=True)
            ...            for h in (4, 2, 2))
            >>> cos, sin = torch.ones(5, 4), torch.zeros(5, 4)
            >>> O = HandAttention.apply(q, k, v, cos, sin, "recompute", 2)
            >>> [tuple(g.shape) for g in torch.autograd.grad(O.sum(), (q, k, v))]
            [(1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)]
        """
        return *ctx.bwd(ctx.saved_tensors, dO, ctx.block), None, None, None, None


# --- what a strategy saves: counted and by formula --------------------------------------

def saved_bytes(fn, inputs) -> int:
    """Bytes autograd keeps for the backward of ``fn``: the distinct storages its pack
    hook sees (``instruments.counters.SavedBytesCounter``: views of one storage count
    once).

    Args:
        fn: the attention, ``(q, k, v, *rest) -> O``, e.g. ``attention_fn(name)``.
        inputs: ``(q, k, v, *rest)``; q, k, v are cloned into fresh leaves that require
            grad.

    Returns:
        The bytes of the distinct storages saved while ``fn`` runs.

    Example:
        >>> from bp_mech.attention_rope import rope_cos_sin
        >>> from bp_mech.attention_framework import attention_fn
        >>> cfg = AttnConfig(1, 4, 2, 8, 1e4)
        >>> inputs = [torch.ones(1, h, 16, 8) for h in (4, 2, 2)]
        >>> rope = rope_cos_sin(16, 8, 1e4)
        >>> counted = saved_bytes(attention_fn("saved_probs"), (*inputs, *rope))
        >>> counted, counted == saved_bytes_formula(cfg, 16, "saved_probs")
        (9216, True)
    """
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    counter = SavedBytesCounter()
    with counter:  # the graph keeps every saved storage alive while fn runs
        fn(*leaves, *inputs[3:])
    return counter.bytes


def saved_bytes_formula(cfg: AttnConfig, T: int, strategy: str, itemsize: int = 4) -> int:
    """What each hand-written strategy saves, by formula (the cross-check of ``saved_bytes``).

    Both: RoPE'd q (B H T d), RoPE'd k and v (B Hkv T d each), cos and sin (T d each);
    then P (B H T T) for ``saved_probs``, O and L (B H T d + B H T) for ``recompute``.

    Args:
        cfg: the attention's shape (B, H, Hkv, d).
        T: sequence length.
        strategy: ``"saved_probs"``, or any other name for ``recompute``.
        itemsize: bytes per element (4: float32).

    Returns:
        The bytes.

    Example:
        >>> cfg = AttnConfig.from_arch("tiny", batch=1)
        >>> [saved_bytes_formula(cfg, T, "recompute") for T in (128, 256)]  # linear in T
        [116736, 233472]
    """
    B, H, Hkv, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    common = B * H * T * d + 2 * B * Hkv * T * d + 2 * T * d  # RoPE'd q, k; v; cos, sin
    probs_or_output = B * H * T * T if strategy == "saved_probs" else B * H * T * d + B * H * T  # P | O, L
    return (common + probs_or_output) * itemsize
