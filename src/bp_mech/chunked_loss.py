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

from bp_mech.instruments import anatomy

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


class ChunkedHead(nn.Module):
    """The model's ``lm_head`` (kept as ``linear``) turned into its loss: ``head(hidden, labels)``.

    Args:
        linear: the ``lm_head``, an ``nn.Linear`` (V, C) without bias (else ``ValueError``).
        chunk: tokens per chunk.

    Example:
        >>> ChunkedHead(torch.nn.Linear(4, 11), chunk=3)
        Traceback (most recent call last):
        ValueError: the chunked loss supports an lm_head without bias
    """

    def __init__(self, linear: nn.Linear, chunk: int):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("the chunked loss supports an lm_head without bias")
        self.linear, self.chunk = linear, chunk  # chunk: tokens per chunk

    def forward(self, hidden, labels, num_items_in_batch=None):
        """``chunked_loss`` with this head's weight and chunk.

        Args:
            hidden: (B, T, C), the final hidden states.
            labels: (B, T) int64, unshifted.
            num_items_in_batch: as in ``chunked_loss``.

        Returns:
            The loss, a 0-dim tensor.

        Example:
            >>> head = ChunkedHead(torch.nn.Linear(4, 11, bias=False), chunk=3)
            >>> round(head(torch.zeros(2, 5, 4), torch.zeros(2, 5, dtype=torch.long)).item(), 4)  # ln 11
            2.3979
        """
        return chunked_loss(hidden, self.linear.weight, labels, self.chunk, num_items_in_batch)


def _forward(model, head: ChunkedHead):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    trunk = anatomy.trunk(model)

    def forward(input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            raise ValueError("under the chunked loss the model computes its loss only: pass labels")
        hidden = trunk(input_ids=input_ids, **kwargs).last_hidden_state  # (B, T, C)
        return CausalLMOutputWithPast(loss=head(hidden, labels, num_items_in_batch), logits=None)
    return forward


@contextlib.contextmanager
def _chunked(model, chunk: int):
    head = ChunkedHead(anatomy.output_head(model), chunk)
    model.set_output_embeddings(head)  # (a tied weight stays the same Parameter)
    model.forward = _forward(model, head)
    try:
        yield model
    finally:
        model.set_output_embeddings(head.linear)
        del model.forward  # the class's forward again


# config fields of a model whose loss is not the cross-entropy of its head's plain logits
_HEAD_CHANGES = {"final_logit_softcapping": "soft-caps its logits (final_logit_softcapping)",
                 "logit_scale": "scales its logits (logit_scale)",
                 "output_router_logits": "adds its router's auxiliary loss (output_router_logits)"}


def unsupported(model) -> str | None:
    """Why the chunked loss cannot stand in for ``model``'s loss, or None when it can.

    It computes the cross-entropy of ``h W^T`` with ``h`` the trunk's last hidden states
    (``anatomy.trunk``) and ``W`` the output head's weight (``anatomy.output_head``): a model that
    soft-caps or scales its logits, adds an auxiliary loss, or has a head with a bias or no single
    weight trains on another loss.

    Args:
        model: a Transformers causal LM.

    Returns:
        The reason, one line, or None.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> unsupported(build_model(parse_workload("tiny-b1s8"))) is None
        True
    """
    cfg = model.config.get_text_config()
    for field, why in _HEAD_CHANGES.items():
        if getattr(cfg, field, None):
            return f"this model {why}; the chunked loss computes plain logits"
    scaling = getattr(cfg, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        return f"this model divides its logits by logits_scaling={scaling}; the chunked loss computes plain logits"
    try:
        head = anatomy.output_head(model)
    except ValueError as e:
        return str(e)
    if not isinstance(head, nn.Linear):
        return f"its output head is a {type(head).__name__}, not one Linear"
    if head.bias is not None:
        return "its output head has a bias; the chunked loss supports an lm_head without bias"
    return None


def chunked(model, chunk: int | None = DEFAULT_CHUNK):
    """The chunked loss as a strategy: a context manager that switches ``model`` to it.

    Inside the block, ``model(input_ids=, labels=)`` computes its loss in chunks of ``chunk`` tokens
    (``model.lm_head`` is the ``ChunkedHead`` there, called with the final hidden states; the output's
    ``logits`` is None); after it, the model is as before. ``chunk=None``: off, ``nullcontext(model)``.

    Args:
        model: a Transformers causal LM whose loss is the cross-entropy of its head's plain logits
            (``unsupported(model)`` is None).
        chunk: tokens per chunk (>= 1), or None for off.

    Returns:
        A context manager whose ``with`` value is ``model`` itself.

    Raises:
        ValueError: ``chunk`` < 1, or a model whose loss it cannot stand in for (``unsupported``).

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> model, ids = build_model(parse_workload("tiny-b1s8")), torch.arange(8)[None]
        >>> with chunked(model, chunk=3) as m:
        ...     out = m(input_ids=ids, labels=ids)
        >>> out.logits is None, torch.allclose(out.loss, model(input_ids=ids, labels=ids).loss, atol=1e-5)
        (True, True)
    """
    if chunk is None:
        return contextlib.nullcontext(model)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    why = unsupported(model)
    if why:
        raise ValueError(why)
    return _chunked(model, chunk)
