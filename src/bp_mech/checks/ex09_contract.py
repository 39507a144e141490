"""Checks of exercises/ex09_local_backward.py, part two: the contract around the numbers, the
LayerNorm variant and the saved-bytes prediction (never against the answer file).

``hold_contract`` is the shared property body (chapter 10's checks reuse it): on a drawn case it calls
the learner's function and requires that (1) no input changed (``call_unmodified``), (2) the result
matches the reference, (3) no output shares an input's storage, (4) the same values come back for
non-contiguous views of the inputs (``strided``: a slice of a larger storage or a transposed storage)
and (5) float32 inputs give float32 outputs within ``TOL32`` of the float64 reference. The cases are
drawn by hypothesis (``explore``): seeds, leading shapes of one to three dimensions, widths and the
kind of view.
"""

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import (
    assert_all_close,
    assert_close,
    autograd_grads,
    call,
    randn64,
)
from bp_mech.checks.properties import (
    assert_no_alias,
    assert_type,
    call_unmodified,
    explore,
    one_thread,
    strided,
)

TOL = 1e-10  # float64: hand-written and autograd agree to rounding
TOL32 = 1e-4  # float32 against the float64 reference: rounding of a few sums of ~10 terms
REF = "float64 autograd"

CASES = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "lead": st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    "width": st.sampled_from((2, 3, 5, 8)),
    "view": st.sampled_from(("slice", "transpose")),
})


def _outputs(fn, outs, got):
    """``got`` as a tuple, one per name in ``outs`` (a single tensor when there is one name)."""
    return (got,) if len(outs) == 1 and not isinstance(got, (tuple, list)) else got


def _compare(fn, outs, got, want, *, tol, ref, at, dtype=None):
    if len(outs) > 1 and (not isinstance(got, (tuple, list)) or len(got) != len(outs)):
        assert_all_close(fn, outs, got, want, tol=tol, ref=ref, at=at)  # reports the wrong return shape
    for name, a, w in zip(outs, _outputs(fn, outs, got), want):
        assert_close(fn, name, a, w, tol=tol, ref=ref, at=at, dtype=dtype)


def hold_contract(fn, f, args, names, outs, want, *, at, view="slice", tol=TOL, ref=REF, f32=True):
    """The five properties above for ``f(*args)`` (float64 ``args``; ``want``: the reference outputs)."""
    tensors = {n: a for n, a in zip(names, args) if torch.is_tensor(a)}
    got = call_unmodified(fn, f, *args, names=names, at=at)
    _compare(fn, outs, got, want, tol=tol, ref=ref, at=at)
    for name, o in zip(outs, _outputs(fn, outs, got)):
        assert_no_alias(fn, name, o, tensors, at)
    views = [strided(a, view) if torch.is_tensor(a) and a.dim() else a for a in args]
    at_v = f"{', '.join(tensors)} as non-contiguous {view} views, {at}"
    _compare(fn, outs, call(fn, f, *views, at=at_v), want, tol=tol, ref=ref, at=at_v)
    if f32:
        low = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        at_32 = f"float32 inputs, {at}"
        _compare(fn, outs, call(fn, f, *low, at=at_32), want, tol=TOL32, ref=ref, at=at_32, dtype=torch.float32)


def _shape(c):
    return f"x shape {c['lead'] + (c['width'],)}"


def check_linear_backward__contract(m):
    def body(c):
        g, ci, co = torch.Generator().manual_seed(c["seed"]), c["width"], c["width"] + 1
        x, W, b, dy = randn64(g, *c["lead"], ci), randn64(g, co, ci), randn64(g, co), randn64(g, *c["lead"], co)
        want = autograd_grads(F.linear, [x, W, b], dy)
        hold_contract("linear_backward", m.linear_backward, (x, W, dy), ("x", "W", "dy"), ("dx", "dW", "db"), want,
                      at=f"{_shape(c)}, W shape {tuple(W.shape)}", view=c["view"])
    explore(CASES, body)


def check_silu_backward__contract(m):
    def body(c):
        g = torch.Generator().manual_seed(c["seed"])
        x, dy = 4 * randn64(g, *c["lead"], c["width"]), randn64(g, *c["lead"], c["width"])
        want = autograd_grads(F.silu, [x], dy)
        hold_contract("silu_backward", m.silu_backward, (x, dy), ("x", "dy"), ("dx",), want, at=_shape(c),
                      view=c["view"])
    explore(CASES, body)


def check_rmsnorm_backward__contract(m):
    def body(c):
        g, C = torch.Generator().manual_seed(c["seed"]), c["width"]
        x, w, dy = randn64(g, *c["lead"], C), 1 + 0.3 * randn64(g, C), randn64(g, *c["lead"], C)
        want = autograd_grads(lambda x, w: F.rms_norm(x, (C,), w, 1e-6), [x, w], dy)
        hold_contract("rmsnorm_backward", m.rmsnorm_backward, (x, w, dy, 1e-6), ("x", "w", "dy", "eps"),
                      ("dx", "dw"), want, at=f"{_shape(c)}, eps 1e-06", view=c["view"])
    explore(CASES, body)


def check_swiglu_mlp_backward__contract(m):
    def body(c):
        g, C = torch.Generator().manual_seed(c["seed"]), c["width"]
        I = C + 2
        x, dy = randn64(g, *c["lead"], C), randn64(g, *c["lead"], C)
        Wg, Wu, Wd = randn64(g, I, C) / 3, randn64(g, I, C) / 3, randn64(g, C, I) / 3
        want = autograd_grads(lambda x, Wg, Wu, Wd: F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd),
                              [x, Wg, Wu, Wd], dy)
        hold_contract("swiglu_mlp_backward", m.swiglu_mlp_backward, (x, Wg, Wu, Wd, dy), ("x", "Wg", "Wu", "Wd", "dy"),
                      ("dx", "dWg", "dWu", "dWd"), want, at=f"{_shape(c)}, I = {I}", view=c["view"])
    explore(CASES, body)


def check_cross_entropy_backward__contract(m):
    def body(c):
        g, V = torch.Generator().manual_seed(c["seed"]), c["width"] + 3
        N = int(torch.tensor(c["lead"]).prod()) + 1
        logits, targets = 2 * randn64(g, N, V), torch.randint(0, V, (N,), generator=g)
        targets[0] = -1  # one ignored row (a solution may not mask the targets in place)
        want = autograd_grads(lambda z: F.cross_entropy(z, targets, ignore_index=-1), [logits],
                              torch.ones((), dtype=torch.float64))
        hold_contract("cross_entropy_backward", m.cross_entropy_backward, (logits, targets, -1),
                      ("logits", "targets", "ignore_index"), ("dlogits",), want,
                      at=f"logits shape {(N, V)}, ignore_index -1 on row 0", view=c["view"])
    explore(CASES, body)


# --- the variant: LayerNorm -----------------------------------------------------------------


def _layernorm_case(m, x, w, b, dy, at, eps=1e-5, view=None):
    C = x.shape[-1]
    want = autograd_grads(lambda x, w, b: F.layer_norm(x, (C,), w, b, eps), [x, w, b], dy)
    if view is None:
        with one_thread():
            got = call("layernorm_backward", m.layernorm_backward, x, w, b, dy, eps, at=at)
        assert_all_close("layernorm_backward", ("dx", "dw", "db"), got, want, tol=TOL, ref=REF, at=at)
    else:
        hold_contract("layernorm_backward", m.layernorm_backward, (x, w, b, dy, eps), ("x", "w", "b", "dy", "eps"),
                      ("dx", "dw", "db"), want, at=at, view=view)


def check_layernorm_backward(m):
    for seed, (lead, C, eps) in enumerate((((2, 5), 12, 1e-5), ((7,), 6, 1e-2), ((2, 2, 3), 9, 1e-5))):
        g = torch.Generator().manual_seed(70 + seed)
        x, w, b, dy = randn64(g, *lead, C), 1 + 0.3 * randn64(g, C), randn64(g, C), randn64(g, *lead, C)
        _layernorm_case(m, x, w, b, dy, f"x shape {tuple(x.shape)}, eps {eps:g}", eps)


def check_layernorm_backward__offset_and_constant_rows(m):
    g = torch.Generator().manual_seed(80)
    x, w, b, dy = randn64(g, 3, 4, 10), 1 + 0.3 * randn64(g, 10), randn64(g, 10), randn64(g, 3, 4, 10)
    x[0] += 1e4  # a large common offset: mean(x^2) - mean(x)^2 loses eight digits to cancellation
    x[1, 2] = 3.0  # a constant row: variance 0, eps decides r
    _layernorm_case(m, x, w, b, dy, "x shape (3, 4, 10) with rows offset by 1e4 and a constant row, eps 1e-05")


def check_layernorm_backward__contract(m):
    def body(c):
        g, C = torch.Generator().manual_seed(c["seed"]), c["width"] + 3  # C = 2: dx is ~eps, all rounding in float32
        x, dy = randn64(g, *c["lead"], C), randn64(g, *c["lead"], C)
        w, b = 1 + 0.3 * randn64(g, C), randn64(g, C)
        _layernorm_case(m, x, w, b, dy, f"x shape {c['lead'] + (C,)}, eps 1e-05", view=c["view"])
    explore(CASES, body)


# --- predict, then measure: the saved bytes of the Qwen2 MLP --------------------------------


def measured_mlp_saved_bytes(batch, seq, hidden, inter, dtype) -> int:
    """What autograd keeps for one forward of ``transformers``' Qwen2MLP: distinct non-weight storages."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from bp_mech.instruments.counters import SavedBytesCounter

    mlp = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")).to(dtype)
    x = torch.zeros(batch, seq, hidden, dtype=dtype, requires_grad=True)
    counter = SavedBytesCounter(params=mlp.parameters())
    with counter:
        mlp(x)
    return counter.bytes


PREDICTIONS = [(2, 3, 8, 12, torch.float32), (1, 5, 6, 20, torch.bfloat16), (3, 2, 4, 4, torch.float64)]


def saved_bytes_predicted(fn: str, f, cases, names: str, measured) -> None:
    """``f(*args)`` is exactly ``measured(*args)``, an int, for each ``args`` of ``cases`` (the shape named
    ``names``, then the dtype): a byte count has no noise."""
    for args in cases:
        at = f"{names} = {args[:-1]}, {str(args[-1]).removeprefix('torch.')}"
        got = call(fn, f, *args, at=at)
        assert_type(fn, "the prediction", got, int, at)
        want = measured(*args)
        assert got == want, (f"{fn}: predicted {got} B, the saved-tensor hooks measure {want} B "
                             f"(exact: a byte count has no noise) at {at}")


def check_predict_mlp_saved_bytes(m):
    saved_bytes_predicted("predict_mlp_saved_bytes", m.predict_mlp_saved_bytes, PREDICTIONS, "(B, T, C, I)",
                          measured_mlp_saved_bytes)


CHECKS = [check_linear_backward__contract, check_silu_backward__contract, check_rmsnorm_backward__contract,
          check_swiglu_mlp_backward__contract, check_cross_entropy_backward__contract, check_layernorm_backward,
          check_layernorm_backward__offset_and_constant_rows, check_layernorm_backward__contract,
          check_predict_mlp_saved_bytes]
