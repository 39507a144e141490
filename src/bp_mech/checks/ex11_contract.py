"""Checks of exercises/ex11_gradient_accumulation.py beyond the values: the contract, the variant, the prediction.

Drawn by hypothesis (seeded, derandomized): batch sizes and splits, padding and prompt masks, logits of
magnitude 1 and 1000 in four dtypes, strided views, and gradients already in ``.grad``. The references are
PyTorch's: ``F.cross_entropy`` over the whole batch in float64 and autograd of it (never the answer file).

- ``split``, ``count_targets``, ``micro_batch_loss``: inputs not modified, strided views give the same result,
  exact return types, finite at logits of magnitude 1000, 0 (not NaN) without targets.
- ``accumulated_backward`` and the variant ``accumulated_backward_per_sequence``: the batch is not modified,
  the gradients add to an existing ``.grad``, a model's exception propagates, the loss is returned detached;
  the variant against float64 autograd of the per-sequence loss of the full batch.
- ``predict_naive_weights``: measured as the ratio of the naive to the token-weighted gradient of each
  micro-batch on a model whose micro-batches touch disjoint parameters.
"""

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks import properties
from bp_mech.checks.common import assert_close, assert_value, describe
from bp_mech.checks.properties import (
    assert_detached,
    assert_finite,
    assert_type,
    call_unmodified,
    explore,
    strided,
)

TOL = 1e-10  # float64: accumulation and the full batch agree to rounding
TOL_HALF = 1e-5  # 16-bit logits: a float32 computation differs from float64 by float32 rounding only
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
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
        self.emb = torch.nn.Parameter(r(V, C) * 0.5, requires_grad=not freeze_embedding)
        self.mix = torch.nn.Parameter(r(C, C) / C ** 0.5)
        self.head = torch.nn.Parameter(r(V, C) / C ** 0.5)

    def forward(self, input_ids):
        h = self.emb[input_ids]  # (B, T, C)
        t = h.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=h.dtype)) / torch.arange(1, t + 1, dtype=h.dtype)[:, None]
        h = h + torch.tanh((causal @ h) @ self.mix.T)
        return SimpleNamespace(logits=h @ self.head.T)  # (B, T, V)


def padded_batch(seed: int = 0, pads=PADS, prompts=None) -> dict:
    """Right padding (input PAD, label -100) and, with ``prompts``, prompt tokens masked in the labels only."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (E, T), generator=g)
    ids[0, 4] = 0  # token id 0 is a real token and a real target
    labels = ids.clone()
    for r, p in enumerate(pads):
        if p:
            ids[r, T - p:] = PAD
            labels[r, T - p:] = -100
    for r, p in enumerate(prompts or ()):
        labels[r, :p] = -100  # the input keeps the prompt token; only the label is masked
    return {"input_ids": ids, "labels": labels}


def full_batch_loss(logits, labels):
    """The reference: torch's token mean over the shifted, non-ignored targets of the whole batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="mean")


def torch_count(labels) -> int:
    """Targets as torch counts them: the ratio of its summed and its mean cross-entropy (0 when none).

    Args:
        labels: (B, T) labels, ``PAD`` where ignored.

    Returns:
        The number of targets, an int.
    """
    z = torch.randn(*labels.shape, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    args = (z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    total = F.cross_entropy(*args, reduction="sum")
    return 0 if total == 0 else round((total / F.cross_entropy(*args)).item())


SEEDS = st.integers(0, 2 ** 16)


def one_thread(check):
    """Run ``check`` on one intra-op thread (``properties.one_thread``): the old checks' tiny steps too."""
    @functools.wraps(check)
    def run(m):
        with properties.one_thread():
            return check(m)
    return run


DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _view(t, how):
    return t if how is None else strided(t, how)


@one_thread
def check_split__contract(m):
    def body(case):
        seed, e, k, how = case
        g = torch.Generator().manual_seed(seed)
        b = {"input_ids": torch.randint(0, V, (e, 3), generator=g), "labels": torch.randint(0, V, (e, 3), generator=g),
             "mask": torch.rand(e, 3, 2, generator=g), "row": torch.arange(e)}
        b = {key: _view(v, how if v.dim() >= 2 or how != "transpose" else "slice") for key, v in b.items()}
        at = f"k={k}, a batch of {e} rows{'' if how is None else f' held as {how}d non-contiguous views'}"
        parts = call_unmodified("split", m.split, b, k, names=("batch", "k"), at=at)
        assert_type("split", "the result", parts, list, at)
        assert len(parts) == k and all(isinstance(p, dict) for p in parts), (
            f"split: returned {len(parts)} items of types {[type(p).__name__ for p in parts]}, "
            f"expected {k} dicts at {at}")
        for key, v in b.items():
            got = torch.cat([p[key] for p in parts]) if all(key in p for p in parts) else None
            assert got is not None and torch.equal(got, v), f"split: {key!r} rows lost, changed or reordered at {at}"
    explore(st.tuples(SEEDS, *_e_and_k(), st.sampled_from([None, "slice", "transpose"])), body)


def _e_and_k():
    e = st.shared(st.integers(1, 8), key="E")
    return e, e.flatmap(lambda n: st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))


def _labels(g, b, t, p_ignore, v=V - 1):
    y = torch.randint(0, v, (b, t), generator=g)
    return y.masked_fill(torch.rand(b, t, generator=g) < p_ignore, -100)


@one_thread
def check_count_targets__contract(m):
    def body(case):
        seed, b, t, p, how = case
        labels = _view(_labels(torch.Generator().manual_seed(seed), b, t, p), how)
        at = f"labels shape {(b, t)}, {p:.0%} ignored" + ("" if how is None else f", a {how}d non-contiguous view")
        got = call_unmodified("count_targets", m.count_targets, labels, names=("labels",), at=at)
        if not (torch.is_tensor(got) and got.dim() == 0 and not got.is_floating_point() and got.dtype != torch.bool):
            raise AssertionError(f"count_targets: returned {describe(got)}, expected a 0-dim integer tensor at {at}")
        want = torch_count(labels.contiguous())
        assert int(got) == want, f"count_targets: {int(got)} targets, torch's cross_entropy counts {want} at {at}"
    explore(st.tuples(SEEDS, st.integers(1, 5), st.integers(1, 9), st.sampled_from([0.0, 0.3, 1.0]),
                      st.sampled_from([None, "slice", "transpose"])), body,
            corners=((1, 3, 5, 0.3, "slice"), (2, 3, 5, 0.3, "transpose")))  # views with some targets ignored


@one_thread
def check_micro_batch_loss__contract(m):
    def body(case):
        seed, b, t, v, scale, dtype, how, as_tensor, p = case
        g = torch.Generator().manual_seed(seed)
        labels = _labels(g, b, t, p, v)
        z = (torch.randn(b, t, v, generator=g, dtype=torch.float64) * scale).to(dtype)
        zv = _view(z, how).requires_grad_()
        count = int((labels[:, 1:] != -100).sum())
        n = count + 3  # the micro-batch's share of a larger effective batch
        at = (f"{str(dtype)[6:]} logits of shape {(b, t, v)} and magnitude {scale:g}, {count} targets, n_total={n} "
              f"as {'a tensor' if as_tensor else 'an int'}" + ("" if how is None else f", a {how}d view"))
        got = call_unmodified("micro_batch_loss", m.micro_batch_loss, zv, labels, torch.tensor(n) if as_tensor else n,
                              names=("logits", "labels", "n_total"), at=at)
        if not (torch.is_tensor(got) and got.dim() == 0):
            raise AssertionError(f"micro_batch_loss: returned {describe(got)}, expected a 0-dim tensor at {at}")
        want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert got.dtype == want_dtype, f"micro_batch_loss: returned {got.dtype}, expected {want_dtype} at {at}"
        assert_finite("micro_batch_loss", "the loss", got, at)
        if not got.requires_grad:
            raise AssertionError(f"micro_batch_loss: the share is not differentiable (no grad_fn) at {at}")
        zd = z.double()
        want = F.cross_entropy(zd[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100,
                               reduction="sum").item() / n if count else 0.0
        err = abs(got.item() - want) / max(abs(want), scale)
        tol = TOL if dtype == torch.float64 else 1e-5  # float32 arithmetic on logits of magnitude `scale`
        assert err <= tol, (f"micro_batch_loss: the share is {got.item():.8g}, float64 F.cross_entropy of the same "
                            f"logits gives {want:.8g} (error {err:.1e} of max(|loss|, magnitude) > {tol:g}) at {at}")
    explore(st.tuples(SEEDS, st.integers(1, 3), st.integers(1, 6), st.integers(2, 9), st.sampled_from([1.0, 1e3]),
                      st.sampled_from(DTYPES), st.sampled_from([None, "slice", "transpose"]), st.booleans(),
                      st.sampled_from([0.0, 0.4, 1.0])), body)


# --- accumulated_backward and the per-sequence variant ---------------------------------------


def per_sequence_loss(logits, labels):
    """The variant's reference: each row's mean token loss, averaged over the rows that have a target."""
    tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                          reduction="none").view(labels.shape[0], -1)
    n = (labels[:, 1:] != -100).sum(1)
    return (tok.sum(1)[n > 0] / n[n > 0]).mean()


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


def backward_contract(m, fn, ref_loss, case):
    """An accumulated backward ``m.<fn>(model, batch, k)`` against float64 autograd of ``ref_loss``.

    Args:
        m, fn: the module under test and the function's name; ``ref_loss(logits, labels)``: the full batch's.
        case: (seed, k, pads, prompts, pre): the batch, the micro-batches, whether ``.grad`` holds one.

    Returns:
        None; an ``AssertionError`` names what broke the contract.
    """
    seed, k, pads, prompts, pre = case
    b = padded_batch(seed, pads, prompts if prompts else None)
    ref = ToyLM(seed)
    want_loss = ref_loss(ref(b["input_ids"]).logits, b["labels"])
    want = torch.autograd.grad(want_loss, list(ref.parameters()))
    model = ToyLM(seed)
    g0 = [torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(seed + i)) if pre else None
          for i, p in enumerate(model.parameters())]
    for p, g in zip(model.parameters(), g0):
        p.grad = None if g is None else g.clone()
    at = (f"k={k}, padding {pads}" + (f", prompts {prompts} masked" if prompts else "")
          + (", .grad already holding a gradient" if pre else ""))
    loss = call_unmodified(fn, getattr(m, fn), model, b, k, names=("model", "batch", "k"), keep=("model",), at=at)
    assert_type(fn, "the returned loss", loss, torch.Tensor, at)
    assert_detached(fn, "the returned loss", loss, at)
    assert_value(fn, "the returned loss", loss, want_loss.item(), tol=TOL, ref="the full-batch loss", at=at)
    for (name, p), w, g in zip(model.named_parameters(), want, g0):
        assert_close(fn, f"{name}.grad", p.grad, w if g is None else w + g, tol=TOL,
                     ref="the gradient already there plus float64 autograd of the full-batch loss"
                     if pre else "float64 autograd of the full-batch loss", at=at + " (add to .grad, never zero it)")
    if k > 1:
        raising = Raising(ToyLM(seed), fail_at=2)
        try:
            getattr(m, fn)(raising, b, k)
        except NotImplementedError:
            raise
        except RuntimeError as e:
            if "raised by the check's model" in str(e):
                return
        raise AssertionError(f"{fn}: the model raised RuntimeError on micro-batch 2 and it did not propagate "
                             f"(a micro-batch was skipped silently) at {at}")


def _backward_cases():
    pads = st.lists(st.integers(0, T), min_size=E, max_size=E).map(lambda p: [0] + p[1:])  # row 0 keeps targets
    return st.tuples(SEEDS, st.sampled_from([1, 2, 4]), pads, st.booleans().map(lambda x: PROMPTS if x else None),
                     st.booleans())


@one_thread
def check_accumulated_backward__contract(m):
    explore(_backward_cases(), lambda c: backward_contract(m, "accumulated_backward", full_batch_loss, c), examples=6)


@one_thread
def check_accumulated_backward_per_sequence__contract(m):
    explore(_backward_cases(), lambda c: backward_contract(m, "accumulated_backward_per_sequence",
                                                            per_sequence_loss, c), examples=6)


# --- the prediction: how the mean of micro-batch means re-weights micro-batches ---------------


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
    for j in range(k):  # the naive loss: (1/k) sum_j S_j / n_j, one micro-batch at a time
        (full_batch_loss(table[ids[j:j + 1]], labels[j:j + 1]) / k).backward()
    out = []
    for j, n in enumerate(counts):
        a, b = token[j * t:j * t + n], table.grad[j * t:j * t + n]
        out.append(((a * b).sum() / (a * a).sum()).item())
    return out
