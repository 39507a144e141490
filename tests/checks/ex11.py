"""Checks of exercises/ex11_gradient_accumulation.py (never against the answer file).

The references are PyTorch's own: ``F.cross_entropy(..., reduction="mean", ignore_index=-100)``
over the *whole* effective batch (its mean is token-weighted by definition) and float64
autograd of that full-batch loss. The batches are right-padded unevenly, so the micro-batches
hold different numbers of target tokens and a mean of micro-batch means gives wrong numbers.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

TOL = 1e-10  # float64: accumulation and the full batch agree to rounding
V, C, E, T = 29, 12, 8, 10  # vocab, width, effective batch, sequence length
PADS = [0, 6, 1, 8, 3, 0, 7, 2]  # padded tail per row: uneven for k = 2 and k = 4


class ToyLM(torch.nn.Module):
    """A small float64 causal LM: embedding, running mean over earlier positions, tanh mixer, head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.emb = torch.nn.Parameter(r(V, C) * 0.5)
        self.mix = torch.nn.Parameter(r(C, C) / C ** 0.5)
        self.head = torch.nn.Parameter(r(V, C) / C ** 0.5)

    def forward(self, input_ids):
        h = self.emb[input_ids]  # (B, T, C)
        t = h.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=h.dtype)) / torch.arange(1, t + 1, dtype=h.dtype)[:, None]
        h = h + torch.tanh((causal @ h) @ self.mix.T)
        return SimpleNamespace(logits=h @ self.head.T)  # (B, T, V)


def padded_batch(seed: int = 0, pads=PADS) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (E, T), generator=g)
    labels = ids.clone()
    for r, p in enumerate(pads):
        if p:
            ids[r, T - p:] = 0
            labels[r, T - p:] = -100
    return {"input_ids": ids, "labels": labels}


def full_batch_loss(logits, labels):
    """The reference: torch's token mean over the shifted, non-ignored targets of the whole batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="mean")


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check_split(m):
    b = padded_batch(1)
    for k in (1, 2, 4, 8):
        parts = m.split(b, k)
        assert isinstance(parts, list) and len(parts) == k, f"split(k={k}): expected a list of {k} micro-batches"
        for key in b:
            assert all(p[key].shape[0] == E // k for p in parts), f"split(k={k}): micro-batches of unequal size"
            assert torch.equal(torch.cat([p[key] for p in parts]), b[key]), f"split(k={k}): rows lost or reordered"
    for bad in (3, 0):
        try:
            m.split(b, bad)
        except ValueError:
            continue
        raise AssertionError(f"split(k={bad}) of {E} rows must raise ValueError")


def check_count_targets(m):
    for seed, pads in ((2, PADS), (3, [0] * E), (4, [T - 2] * E)):
        b = padded_batch(seed, pads)
        labels = b["labels"].clone()
        labels[0, 3] = -100  # an ignored position inside a row counts as not a target
        z = torch.randn(E, T, V, dtype=torch.float64)
        want = round((F.cross_entropy(z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum")
                      / F.cross_entropy(z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))).item())
        got = m.count_targets(labels)
        assert int(got) == want, f"count_targets: {int(got)}, expected {want} (targets are labels[:, 1:] != -100)"


def check_micro_batch_loss(m):
    g = torch.Generator().manual_seed(5)
    b = padded_batch(5)
    z = torch.randn(E, T, V, generator=g, dtype=torch.float64) * 2
    want = full_batch_loss(z, b["labels"])
    n = round((F.cross_entropy(z[:, :-1].reshape(-1, V), b["labels"][:, 1:].reshape(-1), reduction="sum")
               / want).item())
    for k in (2, 4):
        rows = range(0, E, E // k)
        total = sum(m.micro_batch_loss(z[r:r + E // k], b["labels"][r:r + E // k], n) for r in rows)
        err = _rel(torch.as_tensor(total), want)
        assert err <= TOL, (f"micro_batch_loss (k={k}): the shares sum to {float(total):.6f}, full-batch mean "
                            f"is {want.item():.6f} (rel. error {err:.1e}); divide by the whole batch's count")


def check_accumulated_backward(m):
    for seed in (6, 7):
        b = padded_batch(seed)
        ref = ToyLM(seed)
        want_loss = full_batch_loss(ref(b["input_ids"]).logits, b["labels"])
        want = torch.autograd.grad(want_loss, list(ref.parameters()))
        for k in (1, 2, 4):
            model = ToyLM(seed)
            loss = m.accumulated_backward(model, b, k)
            assert loss is not None, "accumulated_backward: return the accumulated loss"
            err = _rel(torch.as_tensor(loss).detach(), want_loss.detach())
            assert err <= TOL, f"accumulated_backward (k={k}): loss {float(loss):.6f} vs full batch " \
                               f"{want_loss.item():.6f} (rel. error {err:.1e})"
            for (name, p), w in zip(model.named_parameters(), want):
                assert p.grad is not None, f"accumulated_backward (k={k}): {name}.grad is None; call backward"
                err = _rel(p.grad, w)
                assert err <= TOL, (f"accumulated_backward (k={k}): {name}.grad differs from the full batch "
                                    f"(rel. error {err:.1e} > {TOL:g}); token-weight the micro-batch losses "
                                    "and let the gradients add up")


CHECKS = [check_split, check_count_targets, check_micro_batch_loss, check_accumulated_backward]
