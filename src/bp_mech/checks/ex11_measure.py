"""The references and models of chapter 11's checks (``ex11``): PyTorch's ``F.cross_entropy`` over the whole
batch, a small float64 causal LM, padded batches with prompts masked in the labels only, and the measurement of
the naive to the token-weighted gradient. Never the answer file.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

V, C, E, T = 29, 12, 8, 10  # vocab, width, effective batch, sequence length
PAD = V - 1  # the pad input id; real tokens are 0 .. V - 2 (0 included)
PADS = [0, 6, 1, 8, 3, 0, 7, 2]  # padded tail per row: uneven for k = 2 and k = 4
PROMPTS = [3, 0, 2, 1, 5, 4, 3, 8]  # prompt tokens masked in the labels; rows 6 and 7 have no target left
REF = "F.cross_entropy over the whole batch"


class ToyLM(torch.nn.Module):
    """A small float64 causal LM: embedding, running mean over earlier positions, tanh mixer, head."""

    def __init__(self, seed: int = 0, freeze_embedding: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.emb = torch.nn.Parameter(r(V, C) * 0.5, requires_grad=not freeze_embedding)
        self.mix = torch.nn.Parameter(r(C, C) / C ** 0.5)
        self.head = torch.nn.Parameter(r(V, C) / C ** 0.5)

    def forward(self, input_ids):
        h = self.emb[input_ids]  # (B, T, C)
        t = h.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=h.dtype)) / torch.arange(1, t + 1, dtype=h.dtype)[:, None]
        h = h + torch.tanh((causal @ h) @ self.mix.T)
        return SimpleNamespace(logits=h @ self.head.T)  # (B, T, V)


class Raising(torch.nn.Module):
    """A model that raises on its ``fail_at``-th forward (an out-of-memory error, a bad batch)."""

    def __init__(self, model, fail_at):
        super().__init__()
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def forward(self, input_ids):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA out of memory (raised by the check's model)")
        return self.model(input_ids=input_ids)


def padded_batch(seed: int = 0, pads=PADS, prompts=None) -> dict:
    """Right padding (input PAD, label -100) and, with ``prompts``, prompt tokens masked in the labels only."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (len(pads), T), generator=g)
    ids[0, 4] = 0  # token id 0 is a real token and a real target
    labels = ids.clone()
    for r, p in enumerate(pads):
        if p:
            ids[r, T - p:], labels[r, T - p:] = PAD, -100
    for r, p in enumerate(prompts or ()):
        labels[r, :p] = -100  # the input keeps the prompt token; only the label is masked
    return {"input_ids": ids, "labels": labels}


def full_batch_loss(logits, labels, reduction="mean"):
    """The reference: torch's token mean (or sum) over the shifted, non-ignored targets of the whole batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction=reduction)


def torch_count(labels) -> int:
    """Targets as torch counts them: the ratio of its summed and its mean cross-entropy (0 when none)."""
    z = torch.randn(*labels.shape, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    total = full_batch_loss(z, labels, "sum")
    return 0 if total == 0 else round((total / full_batch_loss(z, labels)).item())


def per_sequence_loss(logits, labels):
    """The variant's reference: each row's mean token loss, averaged over the rows that have a target."""
    tok = full_batch_loss(logits, labels, "none").view(labels.shape[0], -1)
    n = (labels[:, 1:] != -100).sum(1)
    return (tok.sum(1)[n > 0] / n[n > 0]).mean()


def measure_naive_weights(counts) -> list[float]:
    """One row per micro-batch, row j with counts[j] targets and its own input ids, logits = table[ids]: each
    micro-batch's gradient lands on its own table rows, so naive/token-weighted is w_j, row block by block."""
    k, t = len(counts), max(counts) + 1
    ids = torch.arange(k * t).view(k, t)
    labels = torch.randint(0, V, (k, t), generator=torch.Generator().manual_seed(k))
    for j, n in enumerate(counts):
        labels[j, n + 1:] = -100
    table = torch.randn(k * t, V, dtype=torch.float64, generator=torch.Generator().manual_seed(t)).requires_grad_()
    token = torch.autograd.grad(full_batch_loss(table[ids], labels), table)[0]
    naive = torch.autograd.grad(sum(full_batch_loss(table[ids[j:j + 1]], labels[j:j + 1]) / k for j in range(k)),
                                table)[0]  # the naive loss: (1/k) sum_j S_j / n_j
    out = []
    for j, n in enumerate(counts):
        a, b = token[j * t:j * t + n], naive[j * t:j * t + n]
        out.append(((a * b).sum() / (a * a).sum()).item())
    return out
