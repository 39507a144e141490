"""The chunked loss over the vocabulary (``bp_mech.chunked_loss``): the same loss and gradients as
lm_head + cross-entropy (float64: tight), with padding and a token-weighted divisor, under autocast
within 16-bit rounding, and no (N, V) float32 tensor alive at any time of forward or backward."""

import pytest
import torch
import torch.nn.functional as F

from bp_mech import chunked_loss
from bp_mech.instruments.tracking import StorageTracker

B, T, C, V = 3, 11, 16, 50


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, C, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, C, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 6:] = chunked_loss.IGNORE  # padding
    return h, w, labels


def _reference(h, w, labels, num_items=None):
    """Transformers' ForCausalLMLoss on the full logits."""
    z = (h @ w.t()).float() if h.dtype != torch.float64 else h @ w.t()
    t = chunked_loss.shifted_targets(labels).reshape(-1)
    if num_items is None:
        return F.cross_entropy(z.reshape(-1, V), t, ignore_index=chunked_loss.IGNORE)
    return F.cross_entropy(z.reshape(-1, V), t, ignore_index=chunked_loss.IGNORE, reduction="sum") / num_items


@pytest.mark.parametrize("chunk", [1, 4, 7, B * T, 1000])
@pytest.mark.parametrize("num_items", [None, 40])
def test_loss_and_gradients_equal_the_full_logits_in_float64(chunk, num_items):
    h, w, labels = _inputs()
    ref = _reference(h, w, labels, num_items)
    ref_grads = torch.autograd.grad(ref, [h, w])
    got = chunked_loss.chunked_loss(h, w, labels, chunk, torch.tensor(num_items) if num_items else None)
    grads = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float64
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads[0][1, 5:].abs().max() == 0  # padded targets (and the last position) send nothing back


def test_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 3, 6, chunked_loss.IGNORE, 2, 2, 5, 1, chunked_loss.IGNORE])
    assert torch.autograd.gradcheck(lambda h, w: chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, t, 4), (h, w))


@pytest.mark.parametrize("low,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_under_autocast_within_half_precision(low, tol):
    h, w, labels = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=low):
        ref = _reference(h, w, labels)
        got = chunked_loss.chunked_loss(h, w, labels, 5)
    ref_grads, grads = torch.autograd.grad(ref, [h, w]), torch.autograd.grad(got, [h, w])
    assert abs(got.item() - ref.item()) <= tol * abs(ref.item())
    for a, b in zip(grads, ref_grads):
        assert got.dtype == a.dtype == b.dtype == torch.float32 and ((a - b).abs().max() / b.abs().max()).item() <= 5 * tol


def test_no_full_logits_exist_at_once():
    """The largest storage created in forward and backward is one chunk's logits, not (N, V)."""
    n, chunk, c, v = 64, 8, 8, 512
    h = torch.randn(n, c, requires_grad=True)
    w = torch.randn(v, c, requires_grad=True)
    t = torch.randint(0, v, (n,))
    tr = StorageTracker()
    with tr:
        chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, t, chunk).backward()
    assert max(tr.nbytes.values()) == max(chunk * v * 4, w.numel() * 4)  # a chunk's logits, or dW
    assert tr.peak < n * v * 4
    plain = StorageTracker()
    with plain:
        F.cross_entropy(h @ w.t(), t, reduction="sum").backward()
    assert plain.peak >= 2 * n * v * 4 > 4 * tr.peak
