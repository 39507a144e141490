"""A memory-lean loss over the vocabulary: lm_head + cross-entropy in chunks of tokens.

The plain causal-LM loss materialises the logits ``z = h W^T`` of every token at once, (N, V), and
upcasts them to float32 for the cross-entropy; autograd then keeps the float32 log-softmax output
(4 N V bytes) until backward, and backward builds its gradient of the same size. At V = 151936
that is often the largest line of the ledger (Part 02 · 43).

``ChunkedLinearCrossEntropy`` computes the same sum of token losses without it. With
``lse_i = log sum_v exp(z_iv)`` the loss of token i with target y_i is ``lse_i - z_{i,y_i}``, and

    d loss_i / d z_i = softmax(z_i) - onehot(y_i) = exp(z_i - lse_i) - onehot(y_i)

so backward needs only h, W, the targets and one float per token (lse). Forward runs over chunks of
``chunk`` tokens: logits of one chunk, its lse and its loss, then the chunk is dropped; backward
recomputes each chunk's logits (one extra lm_head matmul per step, the time this costs) and turns
them into ``dz`` in place, then ``dh = dz W`` and ``dW += dz^T h``. Alive at once: one chunk's
(chunk, V) float32 logits instead of (N, V) (the idea of Liger-Kernel's fused linear cross-entropy
and of Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", without fusion).

Under autocast the two matmuls run in the autocast dtype, as lm_head does in the plain step, and the
softmax in float32, as Transformers' loss does. The strategy's switch, which puts this loss in a
Transformers model's place, is ``bp_mech.chunked_head.chunked``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position that is not a target (padding), as in Transformers
DEFAULT_CHUNK = 256  # tokens per chunk: qwen05's (256, 151936) float32 logits are 156 MB


def _up(z: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64), as Transformers upcasts the logits for the loss."""
    return z if z.dtype == torch.float64 else z.float()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed token loss of ``lm_head`` + cross-entropy, computed in chunks of tokens.

    ``sum_i [lse(h_i W^T) - (h_i W^T)_{y_i}]`` over targets ``y_i != IGNORE``, in float32 (float64
    for float64 inputs). Saves h, W (references, not copies), targets and lse (N,) float32.
    Called as ``ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)``, whose arguments are:

    Args:
        hidden: h, (N, C), the final hidden states of N tokens.
        weight: W, (V, C), the ``lm_head`` weight (no bias).
        targets: (N,) int64 token ids; ``IGNORE`` marks a position that is not a target.
        chunk: tokens per chunk.

    Example:
        >>> h, W, t = torch.zeros(5, 2), torch.ones(3, 2), torch.tensor([0, 1, 2, IGNORE, 0])
        >>> round(ChunkedLinearCrossEntropy.apply(h, W, t, 2).item(), 4)  # 4 targets, uniform logits: 4 ln 3
        4.3944
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        """The loss, one chunk of (chunk, V) logits at a time; saves lse (N,) for backward.

        Args:
            ctx: the autograd context.
            hidden: h, (N, C).
            weight: W, (V, C).
            targets: (N,) int64; ``IGNORE`` positions add nothing.
            chunk: tokens per chunk.

        Returns:
            The sum of token losses, a 0-dim tensor in float32 (float64 for float64 inputs).

        Example:
            >>> _ = torch.manual_seed(0)
            >>> h, W = torch.randn(7, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
            >>> t = torch.tensor([1, 2, IGNORE, 3, 4, 5, 6])
            >>> ref = F.cross_entropy(h @ W.T, t, reduction="sum")
            >>> torch.allclose(ChunkedLinearCrossEntropy.apply(h, W, t, 3), ref)
            True
        """
        low = _autocast_dtype(hidden.device.type)  # autocast is on in forward, off in backward: remember it
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32 (float64 for float64 inputs)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)  # (N,)
        for s in range(0, hidden.shape[0], chunk):
            z = _up(F.linear(hidden[s:s + chunk], weight))  # (n, V): the only logits alive
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            t = targets[s:s + chunk]
            valid = t != IGNORE
            picked = z.gather(1, t.clamp(min=0)[:, None])[:, 0]  # z_{i, y_i}
            total += ((lse[s:s + chunk] - picked) * valid).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.low = chunk, low
        return total

    @staticmethod
    def backward(ctx, grad_total):
        """d loss / d (h, W), recomputing one chunk of logits at a time.

        Per chunk: recompute the logits z, turn them in place into dz = (softmax(z) - onehot(y)) * grad_total
        (0 on ``IGNORE`` rows), then dh = dz W and dW += dz^T h (in the forward's autocast dtype, if any).

        Args:
            ctx: the autograd context, with what forward saved.
            grad_total: d out / d loss, a 0-dim tensor.

        Returns:
            (dh, dW, None, None): dh (N, C) and dW (V, C), each None when not needed; none for targets, chunk.

        Example:
            >>> _ = torch.manual_seed(0)
            >>> h, W = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in [(7, 4), (11, 4)])
            >>> t = torch.tensor([1, 2, IGNORE, 3, 4, 5, 6])
            >>> ref = torch.autograd.grad(F.cross_entropy(h @ W.T, t, reduction="sum"), (h, W))
            >>> ours = torch.autograd.grad(ChunkedLinearCrossEntropy.apply(h, W, t, 3), (h, W))
            >>> all(torch.allclose(a, b) for a, b in zip(ours, ref))
            True
        """
        hidden, weight, targets, lse = ctx.saved_tensors
        dev = hidden.device.type
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        w = weight if ctx.low is None else weight.to(ctx.low)  # one half copy, as autocast makes in forward
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[s:s + ctx.chunk], targets[s:s + ctx.chunk]
            hl = h if ctx.low is None else h.to(ctx.low)
            with torch.autocast(dev, enabled=False):
                dz = _up(F.linear(hl, w))  # the recompute: this chunk's logits again
                dz.sub_(lse[s:s + ctx.chunk, None]).exp_()  # softmax
                valid = t != IGNORE
                dz[torch.arange(len(t), device=dz.device), t.clamp(min=0)] -= 1.0  # - onehot(y)
                dz.mul_((valid * grad_total)[:, None])  # padding sends nothing back
                dzl = dz.to(w.dtype)  # the matmuls' dtype: autocast's, or half weights' own (no copy in float32)
                if dh is not None:
                    dh[s:s + ctx.chunk] = dzl @ w  # (n, C)
                if dw is not None:
                    dw += (dzl.t() @ hl).to(dw.dtype)  # (V, C), accumulated in the weight's dtype
        return dh, dw, None, None


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: labels shifted left by one, IGNORE at the end (Transformers' shift).

    Args:
        labels: (B, T) int64 token ids (any leading dims; the shift is along the last).

    Returns:
        Targets of the same shape: ``targets[..., t] = labels[..., t + 1]``, ``IGNORE`` at t = T - 1.

    Example:
        >>> shifted_targets(torch.tensor([[5, 6, 7]])).tolist()
        [[6, 7, -100]]
    """
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = DEFAULT_CHUNK,
                 num_items_in_batch=None) -> torch.Tensor:
    """Transformers' causal-LM loss of ``lm_head`` on ``hidden``, without the (B, T, V) logits.

    The mean over target tokens, or the sum divided by ``num_items_in_batch`` when given (token-
    weighted accumulation, Part 02 · 11).

    Args:
        hidden: (B, T, C), the final hidden states.
        weight: (V, C), the ``lm_head`` weight (no bias).
        labels: (B, T) int64, unshifted as passed to the model; ``IGNORE`` marks a non-target.
        chunk: tokens per chunk.
        num_items_in_batch: the divisor (int or 0-dim tensor); None divides by this batch's targets.

    Returns:
        The loss, a 0-dim tensor in float32 (float64 for float64 inputs).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> h, W, y = torch.randn(2, 5, 4), torch.randn(11, 4), torch.randint(0, 11, (2, 5))
        >>> ref = F.cross_entropy((h @ W.T)[:, :-1].reshape(-1, 11), y[:, 1:].reshape(-1))
        >>> torch.allclose(chunked_loss(h, W, y, chunk=3), ref)
        True
    """
    t = shifted_targets(labels).reshape(-1)
    total = ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, t, chunk)
    n = (t != IGNORE).sum() if num_items_in_batch is None else num_items_in_batch
    return total / (n.to(total.device) if torch.is_tensor(n) else n)
