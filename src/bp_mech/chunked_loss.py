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
softmax in float32, as Transformers' loss does. ``chunked(model, chunk)`` is the strategy's switch:
inside it ``model(input_ids=..., labels=...)`` returns this loss (``logits`` is None: they never exist
at once); ``chunk=None`` is off (``contextlib.nullcontext``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # label of a position that is not a target (padding), as in Transformers
DEFAULT_CHUNK = 256  # tokens per chunk: qwen05's (256, 151936) float32 logits are 156 MB


def _up(z: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64), as Transformers upcasts the logits for the loss."""
    return z if z.dtype == torch.float64 else z.float()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i [lse(h_i W^T) - (h_i W^T)_{y_i}]`` over targets ``y_i != IGNORE``, in float32 (float64
    for float64 inputs), chunked.

    Args of ``apply``: hidden (N, C), weight (V, C), targets (N,) int64, chunk (tokens per chunk).
    Saves h, W (references, not copies), targets and lse (N,) float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
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
                dzl = dz if ctx.low is None else dz.to(ctx.low)
                if dh is not None:
                    dh[s:s + ctx.chunk] = dzl @ w  # (n, C)
                if dw is not None:
                    dw += (dzl.t() @ hl).to(dw.dtype)  # (V, C), accumulated in the weight's dtype
        return dh, dw, None, None


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets (B, T): labels shifted left by one, IGNORE at the end (Transformers' shift)."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = DEFAULT_CHUNK,
                 num_items_in_batch=None) -> torch.Tensor:
    """Transformers' causal-LM loss of ``lm_head`` (weight (V, C), no bias) on ``hidden`` (B, T, C):
    the mean over target tokens, or the sum divided by ``num_items_in_batch`` when given (token-
    weighted accumulation, Part 02 · 11), without the (B, T, V) logits."""
    t = shifted_targets(labels).reshape(-1)
    total = ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, t, chunk)
    n = (t != IGNORE).sum() if num_items_in_batch is None else num_items_in_batch
    return total / (n.to(total.device) if torch.is_tensor(n) else n)


class ChunkedHead(nn.Module):
    """The model's ``lm_head`` (kept as ``linear``) turned into its loss: ``head(hidden, labels)``."""

    def __init__(self, linear: nn.Linear, chunk: int):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("the chunked loss supports an lm_head without bias")
        self.linear, self.chunk = linear, chunk  # chunk: tokens per chunk

    def forward(self, hidden, labels, num_items_in_batch=None):
        return chunked_loss(hidden, self.linear.weight, labels, self.chunk, num_items_in_batch)


def _forward(model, head: ChunkedHead):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            raise ValueError("under the chunked loss the model computes its loss only: pass labels")
        hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state  # (B, T, C)
        return CausalLMOutputWithPast(loss=head(hidden, labels, num_items_in_batch), logits=None)
    return forward


@contextlib.contextmanager
def _chunked(model, chunk: int):
    head = ChunkedHead(model.lm_head, chunk)
    model.lm_head, model.forward = head, _forward(model, head)  # (a tied weight stays the same Parameter)
    try:
        yield model
    finally:
        model.lm_head = head.linear
        del model.forward  # the class's forward again


def chunked(model, chunk: int | None = DEFAULT_CHUNK):
    """Inside the block, ``model(input_ids=, labels=)`` computes its loss in chunks of ``chunk`` tokens
    (``model.lm_head`` is the ``ChunkedHead`` there, called with the final hidden states; the output's
    ``logits`` is None); after it, the model is as before. ``chunk=None``: off, ``nullcontext(model)``."""
    if chunk is None:
        return contextlib.nullcontext(model)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        raise ValueError("the chunked loss computes plain logits; this model soft-caps them (final_logit_softcapping)")
    return _chunked(model, chunk)
