"""Checks of exercises/ex11_gradient_accumulation.py: one declaration per function (``engine.Contract``).

References: PyTorch's own ``F.cross_entropy(..., ignore_index=-100)`` over the *whole* effective batch (its
mean is token-weighted by definition), float64 autograd of it, and for the prediction a measurement of the
naive to the token-weighted gradient; never the answer file. The domains are the docstrings': batches
right-padded unevenly (micro-batches with different target counts: a mean of means is wrong), prompts masked
in the labels only (a count from the inputs is wrong), token id 0 as a real target, a micro-batch and rows
without any target, labels of shape (1, 1), a frozen parameter, a ``.grad`` already holding a gradient, a
model that raises on micro-batch 2, logits of magnitude 1000 (a log of a softmax underflows) in four dtypes,
``n_total`` an int or a 0-dim tensor, any keys and trailing shapes in ``split``, k < 1 and E % k != 0. The
engine derives the rest: inputs unchanged, strided views, dtypes, exact types, state restored.
"""

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed
from bp_mech.checks.engine import Contract, Raises, check, checks
from bp_mech.checks.ex11_measure import (  # noqa: F401  (PAD, ToyLM: the tests build batches and models alike)
    E, PAD, PADS, PROMPTS, REF, T, V, Raising, ToyLM, full_batch_loss, measure_naive_weights, padded_batch,
    per_sequence_loss, torch_count)

SEEDS, VIEWS = st.integers(0, 2**16), st.sampled_from(("slice", "transpose"))


# --- split -----------------------------------------------------------------------------------


def _split(c):
    g, e = torch.Generator().manual_seed(c["seed"]), c["E"]
    ids = torch.randint(0, V, (e, T), generator=g)
    return {"batch": {"input_ids": ids, "labels": torch.randint(0, V, (e, T), generator=g),
                      "attention_mask": (ids != PAD).long(), "row_id": torch.arange(e),
                      "extra": torch.randn(e, T, 2, generator=g, dtype=torch.float64)}, "k": c["k"]}


def _split_ref(batch, k):
    e = batch["input_ids"].shape[0]
    if k < 1 or e % k:
        return Raises(ValueError, f"k={k} over {e} rows (k < 1 or E % k != 0)")
    b = e // k
    return ([{key: v[j * b:(j + 1) * b] for key, v in batch.items()} for j in range(k)],)


def _split_cases(e):
    return st.fixed_dictionaries({"seed": SEEDS, "E": st.just(e), "view": VIEWS, "k": st.sampled_from(
        [d for d in range(1, e + 1) if e % d == 0] * 2 + [0, e + 1])})


SPLIT = Contract(
    "split", _split, _split_ref, ("the result",), returns=list, ref_name="the rows j E/k ... (j+1) E/k - 1",
    dtypes={torch.float32: 1e-7, torch.bfloat16: 1e-2}, draw=st.integers(1, 8).flatmap(_split_cases),
    examples={"": [{"seed": 1, "E": E, "k": k} for k in (1, 2, 4, 8, 3, 0, -2)]})


# --- count_targets ---------------------------------------------------------------------------


def _count(c):
    if "pads" in c:
        labels = padded_batch(c["seed"], c["pads"], c.get("prompts"))["labels"][c.get("rows", slice(None))]
        if c.get("hole"):
            labels[0, 3] = -100  # an ignored position inside a row counts as not a target
        return {"labels": labels[: c.get("cut", T)][:, : c.get("cut", T)]}
    g = torch.Generator().manual_seed(c["seed"])
    y = torch.randint(0, V - 1, (c["B"], c["T"]), generator=g)
    return {"labels": y.masked_fill(torch.rand(c["B"], c["T"], generator=g) < c["p"], -100)}


def _integer(case, call, at):
    got = call()
    if got.is_floating_point() or got.is_complex() or got.dtype == torch.bool:
        raise AssertionError(f"count_targets: returned a {str(got.dtype)[6:]} tensor, expected a 0-dim integer "
                             f"tensor at {at}")


COUNT = Contract(
    "count_targets", _count, lambda labels: (torch.tensor(torch_count(labels)),), ("the count",),
    ref_name="torch's cross_entropy count (labels[:, 1:] != -100)", promise=_integer,
    draw=st.fixed_dictionaries({"seed": SEEDS, "B": st.integers(1, 5), "T": st.integers(1, 9), "view": VIEWS,
                                "p": st.sampled_from((0.0, 0.3, 1.0))}),
    examples={"": [{"seed": s, "pads": p, "hole": True} for s, p in ((2, PADS), (3, [0] * E), (4, [T - 2] * E))],
              "prompt_masked": [{"seed": 5, "pads": PADS, "prompts": PROMPTS}, {"seed": 5, "pads": PADS,
                                "prompts": PROMPTS, "rows": slice(6, None)}, {"seed": 5, "pads": PADS, "cut": 1}]},
    note=lambda c: ("prompts masked in the labels only, token id 0 a target" if c.get("prompts") else
                    c.get("pads") and "right-padded rows, -100 inside row 0"))


# --- micro_batch_loss ------------------------------------------------------------------------


def _loss(c):
    g = torch.Generator().manual_seed(c["seed"])
    z = torch.randn(c["B"], c["T"], c["V"], generator=g, dtype=torch.float64) * c.get("scale", 1.0)
    y = torch.randint(0, c["V"], (c["B"], c["T"]), generator=g)
    if c.get("scale", 1.0) >= 100:  # targets far from the argmax: a softmax underflows to exactly 0 there
        y[:, 1:] = z[:, :-1].argmin(-1)
    y = y.masked_fill(torch.rand(c["B"], c["T"], generator=g) < c["p"], -100)
    n = max(int((y[:, 1:] != -100).sum()) + c.get("extra", 3), 1)  # the whole batch's count: more targets
    return {"logits": z.to(c.get("dtype", torch.float64)), "labels": y,
            "n_total": torch.tensor(n) if c.get("as_tensor") else n}


def _loss_ref(logits, labels, n_total):
    z = logits.detach().double().requires_grad_()
    share = full_batch_loss(z, labels, "sum") / int(n_total)
    return share.detach(), torch.autograd.grad(share, z)[0]


def _differentiated(f):
    """The driver: the share, and its gradient w.r.t. the logits (None where autograd cannot give one)."""
    def run(logits, labels, n_total):
        z = logits.detach().requires_grad_()
        share = f(z, labels, n_total)
        if not (torch.is_tensor(share) and share.requires_grad):
            return share, None
        try:
            return share.detach(), torch.autograd.grad(share, z)[0]
        except RuntimeError:  # (an input modified in place after its use: reported as such)
            return share.detach(), None
    return run


def _loss_cases(**more):
    return st.fixed_dictionaries({
        "seed": SEEDS, "B": st.integers(1, 3), "T": st.integers(1, 6), "view": VIEWS, "V": st.integers(2, 9),
        "p": st.sampled_from((0.0, 0.4, 1.0)), "extra": st.sampled_from((0, 3)), "as_tensor": st.booleans(),
        "scale": st.sampled_from((1.0, 1e3)), **more})


def _lcase(seed, B, T, V, **more):
    return {"seed": seed, "B": B, "T": T, "V": V, "p": 0.3, **more}


def _loss_note(c):
    return ", ".join(w for w in (c.get("scale", 1) >= 100 and "logits of magnitude 1000: a softmax underflows to 0",
                                 c.get("p") == 1.0 and "no target: the share is 0, not NaN",
                                 c.get("dtype") and "16-bit logits: compute the loss in float32, as transformers' "
                                                    "ForCausalLMLoss does") if w)


LOSS = Contract(
    "micro_batch_loss", _loss, _loss_ref, ("the share", "d(share)/d(logits)"), use=_differentiated,
    ref_name=f"float64 {REF}, divided by n_total", dtypes={torch.float32: 1e-4}, draw=_loss_cases(), note=_loss_note,
    examples={"": [_lcase(5, 4, 10, 29), _lcase(6, 4, 10, 29, as_tensor=True, extra=0), _lcase(7, 2, 5, 7, p=1.0),
                   _lcase(8, 3, 6, 9, scale=1e3), _lcase(9, 1, 1, 2, p=0.0)]})


def _upcast(f):
    """The driver of 16-bit logits: the share's dtype, and its value."""
    def run(logits, labels, n_total):
        share = f(logits, labels, n_total)
        return (str(share.dtype), share.item()) if torch.is_tensor(share) and share.dim() == 0 else (share, None)
    return run


HALF = Contract(
    "micro_batch_loss", _loss, lambda logits, labels, n_total: ("torch.float32", _loss_ref(logits, labels, n_total)[
        0].item()), ("the share's dtype", "the share"), use=_upcast, tol=1e-5, note=_loss_note,
    ref_name=f"float64 {REF} of the same 16-bit logits (in float32)",
    examples={"half_precision": [_lcase(s, 8, 10, 29, dtype=d, scale=x) for s, d, x in (
        (7, torch.bfloat16, 3.0), (8, torch.float16, 3.0), (9, torch.bfloat16, 1e3), (10, torch.float16, 1e3))]})


# --- accumulated_backward and the per-sequence variant ---------------------------------------


def _backward(c):
    model = ToyLM(c["seed"], c.get("freeze", False))
    if c.get("pre"):  # .grad already holding a gradient: the function adds to it
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(c["seed"] + i))
    model = Raising(model, 2) if c.get("raising") else model
    return {"model": model, "batch": padded_batch(c["seed"], c["pads"], c.get("prompts")), "k": c["k"]}


def _backward_ref(loss):
    def ref(model, batch, k):
        if isinstance(model, Raising):
            return Raises(RuntimeError, "a model that raised on micro-batch 2 (propagate it; skip no micro-batch)")
        n = (batch["labels"][:, 1:] != -100).sum(1)
        if not (n > 0).any():
            return Raises(ValueError, "a batch without any target (R = 0)")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        want = torch.autograd.grad(loss(model(input_ids=batch["input_ids"]).logits, batch["labels"]),
                                   [p for _, p in named])
        grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
        for (name, _), g in zip(named, want):
            grads[name] = g if grads[name] is None else grads[name] + g
        return loss(model(input_ids=batch["input_ids"]).logits, batch["labels"]).detach(), grads
    return ref


def _grads(f):
    """The driver: the returned loss and every parameter's ``.grad`` after the call; the ``.grad`` are put back
    as they were after (each call starts from the same model)."""
    def run(model, batch, k):
        before = {name: p.grad for name, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None if p.grad is None else p.grad.clone()
        try:
            loss = f(model, batch, k)
            return loss, {name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in model.named_parameters()}
        finally:
            for name, p in model.named_parameters():
                p.grad = before[name]
    return run


def _bcase(seed, k, pads=PADS, **more):
    return {"seed": seed, "k": k, "pads": pads, **more}


_PADDINGS = st.lists(st.integers(0, T), min_size=E, max_size=E).map(lambda p: [0] + p[1:])  # row 0 keeps targets
BACKWARD_CASES = st.fixed_dictionaries({"seed": SEEDS, "k": st.sampled_from((1, 2, 4)), "pads": _PADDINGS,
                                        "prompts": st.sampled_from((None, PROMPTS)), "pre": st.booleans(),
                                        "view": VIEWS})


def _backward_note(c):
    return ", ".join(w for w in (f"padding {c['pads']}", c.get("prompts") and f"prompts {PROMPTS} masked in the labels",
                                 c.get("freeze") and "embedding frozen", c.get("pre") and
                                 ".grad already holding a gradient (add to it, never zero it)") if w)


ACCUMULATED = Contract(
    "accumulated_backward", _backward, _backward_ref(full_batch_loss), ("the returned loss", "the gradients"),
    use=_grads, ref_name=f"float64 autograd of the full-batch mean ({REF})", draw=BACKWARD_CASES, note=_backward_note,
    examples={"": [_bcase(s, k) for s in (6, 7) for k in (1, 2, 4)] + [_bcase(9, 2, pre=True),
                                                                      _bcase(6, 4, raising=True)],
              "prompt_masked": [_bcase(8, k, prompts=PROMPTS, freeze=True) for k in (1, 2, 4)]})

PER_SEQUENCE = Contract(
    "accumulated_backward_per_sequence", _backward, _backward_ref(per_sequence_loss),
    ("the returned loss", "the gradients"), use=_grads, draw=BACKWARD_CASES, note=_backward_note,
    ref_name="float64 autograd of the full batch's per-sequence mean",
    examples={"": [_bcase(6, 2), _bcase(7, 4), _bcase(8, 4, prompts=PROMPTS), _bcase(9, 2, pre=True),
                   _bcase(6, 2, raising=True), _bcase(9, 2, pads=[T] * E)]})


# --- the prediction: how the mean of micro-batch means re-weights micro-batches ---------------


def _unmodified(f):
    """The driver: a list of ints modified in place is reported (the engine compares tensors only)."""
    def run(counts):
        before = list(counts)
        out = f(counts)
        if counts != before:
            raise CheckFailed(f"predict_naive_weights: counts was modified in place (now {counts}) at counts {before}")
        return out
    return run


PREDICT = Contract(
    "predict_naive_weights", lambda c: {"counts": list(c["counts"])},
    lambda counts: (measure_naive_weights(counts),) if counts and min(counts) >= 1 else Raises(
        ValueError, "an empty list or a count < 1"), ("the prediction",), returns=list, tol=1e-9, use=_unmodified,
    ref_name="the measured ratio of the naive to the token-weighted gradient",
    draw=st.fixed_dictionaries({"counts": st.lists(st.integers(1, 9), min_size=1, max_size=5)}),
    examples={"": [{"counts": c} for c in ((3, 1, 2), (5,), (1, 1, 1, 1), (), (3, 0))]})

CHECKS = checks(SPLIT, COUNT, LOSS) + check(HALF)[1:] + checks(ACCUMULATED, PER_SEQUENCE, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex11.check_micro_batch_loss__half_precision, ...
