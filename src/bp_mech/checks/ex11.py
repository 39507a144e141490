"""Checks of exercises/ex11_gradient_accumulation.py (never against the answer file).

The references are PyTorch's own: ``F.cross_entropy(..., reduction="mean", ignore_index=-100)``
over the *whole* effective batch (its mean is token-weighted by definition) and float64 autograd
of that full-batch loss. The batches are right-padded unevenly, so the micro-batches hold
different numbers of target tokens and a mean of micro-batch means gives wrong numbers; the
supervised fine-tuning batches also mask prompt tokens in the labels only (the inputs there are
real tokens, so a count taken from the inputs is wrong), hold token id 0 as a real target, and put
a micro-batch with no target at all. Logits come in float64, float32, bfloat16 and float16.
The contract checks (drawn by hypothesis) and the shared cases are in ``ex11_contract``; the
variant's values and the prediction's measurement are checked here.
"""

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import assert_close, assert_value, call, describe
from bp_mech.checks.ex11_contract import (  # the shared cases live there (it must not import this module)
    PAD,
    PADS,
    PROMPTS,
    REF,
    TOL,
    TOL_HALF,
    E,
    T,
    ToyLM,
    V,
    backward_contract,
    torch_count,
    check_accumulated_backward__contract,
    check_accumulated_backward_per_sequence__contract,
    check_count_targets__contract,
    check_micro_batch_loss__contract,
    check_split__contract,
    full_batch_loss,
    measure_naive_weights,
    one_thread,
    padded_batch,
    per_sequence_loss,
)
from bp_mech.checks.properties import assert_raises, assert_type, explore


@one_thread
def check_split(m):
    b = padded_batch(1)
    b = {**b, "attention_mask": (b["input_ids"] != PAD).long(), "row_id": torch.arange(E),
         "extra": torch.randn(E, T, 2)}  # keys of other shapes: (E, T), (E,), (E, T, 2)
    for k in (1, 2, 4, 8):
        at = f"k={k}, a batch of {E} rows with keys {list(b)}"
        parts = call("split", m.split, b, k, at=at)
        assert isinstance(parts, list) and len(parts) == k, (
            f"split: returned {describe(parts)} of length {len(parts) if hasattr(parts, '__len__') else '?'}, "
            f"expected a list of {k} micro-batches at {at}")
        for key in b:
            assert all(key in p for p in parts), f"split: key {key!r} missing from a micro-batch at {at}"
            sizes = [p[key].shape[0] for p in parts]
            assert sizes == [E // k] * k, f"split: {key!r} split into rows {sizes}, expected {[E // k] * k} at {at}"
            assert torch.equal(torch.cat([p[key] for p in parts]), b[key]), (
                f"split: {key!r} rows lost or reordered (concatenated micro-batches differ from the batch) at {at}")
    for bad in (3, 0, -2):
        assert_raises("split", m.split, (b, bad), ValueError, f"k={bad} (k < 1 or E % k != 0 must raise)",
                      f"{E} rows")


def _count_case(m, labels, at):
    got = call("count_targets", m.count_targets, labels.clone(), at=at)
    if not (torch.is_tensor(got) and got.dim() == 0 and not got.is_floating_point()):
        raise AssertionError(f"count_targets: returned {describe(got)}, expected a 0-dim integer tensor at {at}")
    want = torch_count(labels)
    assert int(got) == want, (f"count_targets: {int(got)} targets, torch's cross_entropy counts {want} "
                              f"(labels[:, 1:] != -100) at {at}")


@one_thread
def check_count_targets(m):
    for seed, pads in ((2, PADS), (3, [0] * E), (4, [T - 2] * E)):
        labels = padded_batch(seed, pads)["labels"]
        labels[0, 3] = -100  # an ignored position inside a row counts as not a target
        _count_case(m, labels, f"labels shape {tuple(labels.shape)}, padding {pads}")


@one_thread
def check_count_targets__prompt_masked(m):
    b = padded_batch(5, PADS, PROMPTS)
    _count_case(m, b["labels"], f"labels with prompts {PROMPTS} masked (inputs there are real tokens), "
                                f"padding {PADS}, token id 0 as a target")
    _count_case(m, b["labels"][6:], "2 rows with every label -100")
    _count_case(m, b["labels"][:1, :1], "labels shape (1, 1): no position has a predecessor")


def _shares(m, z, labels, n, k, at):
    rows = range(0, E, E // k)
    parts = [call("micro_batch_loss", m.micro_batch_loss, z[r:r + E // k], labels[r:r + E // k], n, at=at)
             for r in rows]
    for p in parts:
        if not (torch.is_tensor(p) and p.dim() == 0):
            raise AssertionError(f"micro_batch_loss: returned {describe(p)}, expected a 0-dim tensor at {at}")
    return parts


@one_thread
def check_micro_batch_loss(m):
    for seed, prompts in ((5, None), (6, PROMPTS)):
        g = torch.Generator().manual_seed(seed)
        b = padded_batch(seed, PADS, prompts)
        z = (torch.randn(E, T, V, generator=g, dtype=torch.float64) * 2).requires_grad_()
        want = full_batch_loss(z, b["labels"])
        want_grad = torch.autograd.grad(want, z)[0]
        n = torch_count(b["labels"])
        for k, n_arg in ((2, n), (4, torch.tensor(n))):
            at = (f"k={k}, n_total={n} as {type(n_arg).__name__}, float64 logits "
                  f"{'with prompts masked' if prompts else 'padded'}")
            total = sum(_shares(m, z, b["labels"], n_arg, k, at))
            assert_value("micro_batch_loss", "the sum of the shares", total, want.item(), tol=TOL,
                         ref=f"the full-batch mean ({REF})", at=at + " (divide by the whole batch's count)")
            if not total.requires_grad:
                raise AssertionError(f"micro_batch_loss: the share is not differentiable (no grad_fn) at {at}")
            grad = torch.autograd.grad(total, z)[0]
            assert_close("micro_batch_loss", "d(sum of shares)/dlogits", grad, want_grad, tol=TOL,
                         ref="float64 autograd of the full-batch mean", at=at)


@one_thread
def check_micro_batch_loss__half_precision(m):
    b = padded_batch(7, PADS, PROMPTS)
    g = torch.Generator().manual_seed(7)
    z64 = torch.randn(E, T, V, generator=g, dtype=torch.float64) * 3
    n = torch_count(b["labels"])
    for dtype, want_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                              (torch.float32, torch.float32)):
        z = z64.to(dtype)
        want = full_batch_loss(z.double(), b["labels"]).item()  # the same 16-bit values, in float64
        at = f"{str(dtype)[6:]} logits shape {tuple(z.shape)}, k=2"
        parts = _shares(m, z, b["labels"], n, 2, at)
        for p in parts:
            if p.dtype != want_dtype:
                raise AssertionError(f"micro_batch_loss: returned {p.dtype}, expected {want_dtype} "
                                     f"(compute the loss in float32, as transformers does) at {at}")
        assert_value("micro_batch_loss", "the sum of the shares", sum(parts), want, tol=TOL_HALF,
                     ref="the float64 full-batch mean of the same logits", at=at + " (upcast before the softmax)")


def _accumulation_case(m, seed, b, label, freeze=False):
    ref = ToyLM(seed, freeze)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    want_loss = full_batch_loss(ref(b["input_ids"]).logits, b["labels"])
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    want = dict(zip(names, torch.autograd.grad(want_loss, trainable)))
    for k in (1, 2, 4):
        at = f"k={k}, {label}"
        model = ToyLM(seed, freeze)
        loss = call("accumulated_backward", m.accumulated_backward, model, b, k, at=at)
        if not torch.is_tensor(loss) or loss.dim() != 0 or loss.requires_grad:
            raise AssertionError(f"accumulated_backward: returned {describe(loss)}, expected a detached 0-dim "
                                 f"tensor (the accumulated loss) at {at}")
        assert_value("accumulated_backward", "the returned loss", loss, want_loss.item(), tol=TOL,
                     ref=f"the full-batch mean ({REF})", at=at)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"accumulated_backward: frozen {name} got a .grad at {at}"
                continue
            assert_close("accumulated_backward", f"{name}.grad", p.grad, want[name], tol=TOL,
                         ref="float64 autograd of the full-batch mean", at=at)


@one_thread
def check_accumulated_backward(m):
    for seed in (6, 7):
        _accumulation_case(m, seed, padded_batch(seed), f"uneven right padding {PADS}")


@one_thread
def check_accumulated_backward__prompt_masked(m):
    b = padded_batch(8, PADS, PROMPTS)
    _accumulation_case(m, 8, b, f"prompts {PROMPTS} masked in the labels only, padding {PADS}, the last "
                                f"micro-batch (k=4) without any target, embedding frozen", freeze=True)


@one_thread
def check_accumulated_backward_per_sequence(m):
    fn = "accumulated_backward_per_sequence"
    for seed, k, prompts in ((6, 2, None), (7, 4, None), (8, 4, PROMPTS)):  # the last: a micro-batch w/o target
        backward_contract(m, fn, per_sequence_loss, (seed, k, PADS, prompts, False))
    b = padded_batch(9, [T] * E)
    assert_raises(fn, m.accumulated_backward_per_sequence, (ToyLM(9), b, 2), ValueError,
                  "R = 0 (the per-sequence mean is undefined)", f"a batch of {E} rows without any target")


@one_thread
def check_predict_naive_weights(m):
    fn = "predict_naive_weights"

    def body(counts):
        at = f"counts {counts}"
        before = list(counts)
        got = call(fn, m.predict_naive_weights, counts, at=at)
        assert counts == before, f"{fn}: counts was modified in place (now {counts}) at counts {before}"
        assert_type(fn, "the prediction", got, list, at)
        assert len(got) == len(counts) and all(type(w) is float for w in got), (
            f"{fn}: returned {got!r}, expected a list of {len(counts)} Python floats at {at}")
        want = measure_naive_weights(counts)
        for j, (w, x) in enumerate(zip(got, want)):
            assert abs(w - x) <= 1e-9 * x, (f"{fn}: predicted w_{j} = {w:.6g}, the measured ratio of the naive to "
                                            f"the token-weighted gradient is {x:.6g} at {at}")
        for bad in ([], [3, 0]):
            try:
                m.predict_naive_weights(bad)
            except ValueError:
                continue
            raise AssertionError(f"{fn}: no ValueError at counts {bad}")
    explore(st.lists(st.integers(1, 9), min_size=1, max_size=5), body)


CHECKS = [check_split, check_split__contract, check_count_targets, check_count_targets__prompt_masked,
          check_count_targets__contract, check_micro_batch_loss, check_micro_batch_loss__half_precision,
          check_micro_batch_loss__contract, check_accumulated_backward, check_accumulated_backward__prompt_masked,
          check_accumulated_backward__contract, check_accumulated_backward_per_sequence,
          check_accumulated_backward_per_sequence__contract, check_predict_naive_weights]
