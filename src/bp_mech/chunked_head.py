"""The chunked loss of ``bp_mech.chunked_loss`` in a Transformers causal LM's place: the strategy's switch.

``chunked(model, chunk)`` replaces the model's ``lm_head`` with a ``ChunkedHead`` (the same weight, turned
into its loss) and its ``forward`` with the trunk followed by that head: inside the block
``model(input_ids=..., labels=...)`` returns the chunked loss (``logits`` is None: they never exist at
once); after it the model is as before; ``chunk=None`` is off (``contextlib.nullcontext``).
``unsupported(model)`` says why a model's loss is not the cross-entropy of its head's plain logits (a
soft-capped or scaled head, an auxiliary loss, a head with a bias), where the switch refuses.
"""

from __future__ import annotations

import contextlib

from torch import nn

from bp_mech.chunked_loss import DEFAULT_CHUNK, chunked_loss
from bp_mech.instruments import anatomy


class ChunkedHead(nn.Module):
    """The model's ``lm_head`` (kept as ``linear``) turned into its loss: ``head(hidden, labels)``.

    Args:
        linear: the ``lm_head``, an ``nn.Linear`` (V, C) without bias (else ``ValueError``).
        chunk: tokens per chunk.

    Example:
        >>> ChunkedHead(nn.Linear(4, 11), chunk=3)
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
            >>> import torch
            >>> head = ChunkedHead(nn.Linear(4, 11, bias=False), chunk=3)
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
        >>> import torch
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
