"""Contract checks of exercises/ex55_update_dynamics.py, explored by hypothesis (``properties.explore``).

Drawn seeds, shapes, dtypes, magnitudes and non-contiguous views, against float64 norms and
``torch.nn.utils.clip_grad_norm_`` (never the answer file): inputs not modified (only the ``.grad``
tensors of the clipping functions, in place, the same objects), exact return types, detached 0-dim
norms sharing no storage, inf and NaN told apart as ``clip_grad_norm_`` tells them; per-group clipping
against ``clip_grad_norm_`` applied to each group; the first-update prediction against a real
``torch.optim.SGD`` and ``torch.optim.AdamW`` step.
"""

import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import assert_value, call, describe
from bp_mech.checks.properties import (
    assert_detached,
    assert_no_alias,
    assert_type,
    call_unmodified,
    explore,
    strided,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}
DTYPES = st.sampled_from(list(TOL))
SHAPES = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=3)
VIEW = st.sampled_from(["slice", "transpose"])
BAD = st.sampled_from([(), (math.inf,), (math.nan,), (-math.inf, math.nan)])


def _tensors(seed, dtype, shapes, bad=(), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype) for s in shapes]
    for j, b in enumerate(bad):
        out[j % len(out)].view(-1)[j % out[j % len(out)].numel()] = b
    return out


def _finite(t):
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _norm64(tensors) -> float:
    return torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors])).item()


def _same_value(fn, what, got, want, tol, ref, at):
    """A number that may be inf or NaN: inf and NaN told apart, finite within ``tol``."""
    value = float(got)
    if math.isnan(want) or math.isinf(want) or not math.isfinite(value):
        if not (math.isnan(value) and math.isnan(want) or value == want):
            raise AssertionError(f"{fn}: {what} is {value}, {ref} gives {want} (inf and NaN told apart) at {at}")
        return
    assert_value(fn, what, got, want, tol=tol, ref=ref, at=at)


def _same_tensor(fn, what, got, want, tol, ref, at):
    """Tensors with NaN/inf in the same places, finite values within ``tol`` (max relative)."""
    g, w = got.detach().double(), want.detach().double()
    if not (torch.equal(torch.isnan(g), torch.isnan(w)) and torch.equal(g[torch.isinf(w)], w[torch.isinf(w)])):
        raise AssertionError(f"{fn}: {what} has NaN/inf where {ref} has {w.tolist()} (got {g.tolist()}) at {at}")
    fin = torch.isfinite(w)
    err = (g[fin] - w[fin]).abs().max().item() / max(w[fin].abs().max().item(), 1e-300) if fin.any() else 0.0
    assert err <= tol, f"{fn}: {what} differs from {ref}, max rel error {err:.1e} > {tol:g} at {at}"


def _zero_dim(fn, what, got, dtype, inputs, at):
    if not (torch.is_tensor(got) and got.dim() == 0):
        raise AssertionError(f"{fn}: {what} is {describe(got)}, expected a 0-dim tensor at {at}")
    if got.dtype != dtype:
        raise AssertionError(f"{fn}: {what} is {got.dtype}, expected {dtype} at {at}")
    assert_detached(fn, what, got, at)
    assert_no_alias(fn, what, got, inputs, at)


def check_global_grad_norm__contract(m):
    fn = "global_grad_norm"

    def body(case):
        seed, dtype, shapes, how, bad, grad = case
        held = _tensors(seed, dtype, shapes, bad, scale=300.0 if dtype == torch.float16 else 1.0)
        views = [strided(t.clone().requires_grad_(grad), how) for t in held]
        at = f"{str(dtype)[6:]} gradients of shapes {shapes} as {how} views{', requiring grad' if grad else ''}" + (
            f", holding {list(bad)}" if bad else "")
        got = call_unmodified(fn, m.global_grad_norm, views, names=("grads",), at=at)
        _zero_dim(fn, "the norm", got, dtype, {f"grads[{i}]": v for i, v in enumerate(views)}, at)
        _same_value(fn, "the norm", got, _norm64(held), TOL[dtype], "the float64 norm of the concatenation", at)

    explore(st.tuples(st.integers(0, 2**16), DTYPES, SHAPES, VIEW, BAD, st.booleans()), body,
            corners=((1, torch.float64, [(3, 4), (2, 5)], "slice", (), False),))  # a view of a larger storage


def check_clip_coefficient__contract(m):
    fn = "clip_coefficient"

    def body(case):
        dtype, value, max_norm, eps = case
        total = torch.tensor(value, dtype=dtype)
        at = f"a {str(dtype)[6:]} norm {total.item():g}, max_norm {max_norm:g}, eps {eps:g}"
        got = call_unmodified(fn, m.clip_coefficient, total, max_norm, eps, names=("total_norm", "max_norm", "eps"),
                              at=at)
        _zero_dim(fn, "c", got, dtype, {"total_norm": total}, at)
        v = total.item()
        want = math.nan if math.isnan(v) else 0.0 if math.isinf(v) else min(1.0, max_norm / (v + eps))
        _same_value(fn, "c", got, want, TOL[dtype], "min(1, max_norm / (norm + eps)), as clip_grad_norm_", at)

    values = st.one_of(st.integers(-8, 4).map(lambda k: 3.0 * 10.0**k), st.sampled_from([0.0, math.inf, math.nan]))
    explore(st.tuples(DTYPES, values, st.sampled_from([1e-3, 1.0, 50.0]), st.sampled_from([1e-6, 0.1])), body)


def _params(held, how, seed):
    g = torch.Generator().manual_seed(seed + 1)
    params = [torch.nn.Parameter(torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)) for t in held]
    for p, t in zip(params, held):
        p.grad = strided(t.clone(), how)  # a non-contiguous .grad, as a bucket or a flat buffer holds it
    return params


def _clip_ref(held, max_norm, eps):
    """clip_grad_norm_ on contiguous copies (its eps is 1e-6; another eps: its norm and the formula)."""
    ref = [torch.nn.Parameter(torch.zeros_like(t)) for t in held]
    for p, t in zip(ref, held):
        p.grad = t.clone()
    if eps == 1e-6:
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm).item()
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref]).item()
        for p in ref:
            p.grad.mul_(min(1.0, max_norm / (norm + eps)) if math.isfinite(norm) else max_norm / (norm + eps))
    return norm, [p.grad for p in ref]


def _clipped_in_place(fn, params, grads, data, want, dtype, at, name="parameter"):
    for i, (p, g, d, w) in enumerate(zip(params, grads, data, want)):
        if p.grad is not g:
            raise AssertionError(f"{fn}: the .grad of {name} {i} was replaced by a new tensor (clip it in place) "
                                 f"at {at}")
        if not torch.equal(p.detach(), d):
            raise AssertionError(f"{fn}: the values of {name} {i} changed (only .grad may) at {at}")
        _same_tensor(fn, f"the gradient of {name} {i}", p.grad, w, TOL[dtype], "clip_grad_norm_", at)


def check_clip_by_global_norm___contract(m):
    fn = "clip_by_global_norm_"

    def body(case):
        seed, dtype, shapes, how, bad, frac = case
        held = _tensors(seed, dtype, shapes, bad)
        params = _params(held, how, seed)
        grads, data = [p.grad for p in params], [p.detach().clone() for p in params]
        max_norm = frac * _norm64([_finite(t) for t in held])
        at = (f"{str(dtype)[6:]} parameters of shapes {shapes}, .grad as {how} views, max_norm {max_norm:.3g}"
              + (f", gradients holding {list(bad)}" if bad else ""))
        got = call(fn, m.clip_by_global_norm_, iter(params), max_norm, at=at)
        norm, want = _clip_ref(held, max_norm, 1e-6)
        _zero_dim(fn, "the returned norm", got, dtype, {f"grad {i}": g for i, g in enumerate(grads)}, at)
        _same_value(fn, "the returned norm", got, norm, TOL[dtype], "clip_grad_norm_", at)
        _clipped_in_place(fn, params, grads, data, want, dtype, at)

    explore(st.tuples(st.integers(0, 2**16), st.sampled_from([torch.float64, torch.float32]), SHAPES, VIEW, BAD,
                      st.sampled_from([0.3, 3.0])), body,
            corners=((1, torch.float64, [(3, 4), (2, 5)], "transpose", (), 0.3),))  # no .grad.view(-1) on it


def check_update_ratio__contract(m):
    fn = "update_ratio"

    def body(case):
        seed, dtype, shapes, how, bad, zero = case
        before = _tensors(seed, dtype, shapes, scale=0.0 if zero else 1.0)
        after = [b + 0.01 * t for b, t in zip(before, _tensors(seed + 1, dtype, shapes, bad))]
        views = ([strided(t.clone(), how) for t in before], [strided(t.clone(), how) for t in after])
        at = (f"{str(dtype)[6:]} tensors of shapes {shapes} as {how} views" + (", before all zero" if zero else "")
              + (f", after holding {list(bad)}" if bad else ""))
        got = call_unmodified(fn, m.update_ratio, *views, names=("before", "after"), at=at)
        if not (isinstance(got, tuple) and len(got) == 3):
            raise AssertionError(f"{fn}: returned {describe(got)}, expected a tuple (update_norm, param_norm, ratio) "
                                 f"at {at}")
        du = _norm64([a.double() - b.double() for b, a in zip(before, after)])
        pn = _norm64(before)
        for what, v, w in zip(("update_norm", "param_norm", "ratio"), got, (du, pn, du / pn if pn else math.inf)):
            assert_type(fn, what, v, float, at)
            _same_value(fn, what, v, w, 1e-10, "float64 norms of the concatenation", at)

    explore(st.tuples(st.integers(0, 2**16), DTYPES, SHAPES, VIEW, BAD, st.booleans()), body)


# --- clip_per_group_ (variant) --------------------------------------------------------------

def _groups(seed, dtype, sizes, how, bad_group, bad):
    """Groups of very different norms (x 0.01 ... x 100); ``bad`` planted in group ``bad_group``."""
    g = torch.Generator().manual_seed(seed)
    held, names = {}, [f"layer{i}" for i in range(len(sizes))]
    for i, (name, shapes) in enumerate(zip(names, sizes)):
        scale = 10.0 ** (2 * (i % 3) - 2)
        held[name] = [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype) for s in shapes]
        if i == bad_group and bad:
            held[name][0].view(-1)[0] = bad
    return held, {k: _params(v, how, seed + i) for i, (k, v) in enumerate(held.items())}


def _per_group_case(fn, m, held, groups, max_norms, dtype, at):
    grads = {k: [p.grad for p in ps] for k, ps in groups.items()}
    data = {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}
    lists = {k: list(ps) for k, ps in groups.items()}
    given = dict(max_norms) if isinstance(max_norms, dict) else max_norms
    got = call(fn, m.clip_per_group_, groups, max_norms, at=at)
    if list(groups) != list(lists) or any(len(groups[k]) != len(ps) or any(a is not b for a, b in zip(groups[k], ps))
                                          for k, ps in lists.items()):
        raise AssertionError(f"{fn}: groups was modified (its keys or lists changed) at {at}")
    if max_norms != given:
        raise AssertionError(f"{fn}: max_norms was modified at {at}")
    if not isinstance(got, dict) or list(got) != list(groups):
        raise AssertionError(f"{fn}: returned {describe(got)} with keys {list(got) if isinstance(got, dict) else '-'}, "
                             f"expected a dict with the group names {list(groups)} in order at {at}")
    for k in groups:
        limit = max_norms[k] if isinstance(max_norms, dict) else max_norms
        norm, want = _clip_ref(held[k], limit, 1e-6)
        where = f"{at}, group {k!r}"
        _zero_dim(fn, f"the norm of group {k!r}", got[k], dtype, {f"grad {i}": g for i, g in enumerate(grads[k])},
                  where)
        _same_value(fn, f"the norm of group {k!r}", got[k], norm, TOL[dtype], "clip_grad_norm_ on that group", where)
        _clipped_in_place(fn, groups[k], grads[k], data[k], want, dtype, where, name=f"{k!r}'s parameter")


def check_clip_per_group_(m):
    fn = "clip_per_group_"
    sizes = [[(4, 3), (5,)], [(6,)], [(2, 2), (3,), (7,)]]
    held, groups = _groups(0, torch.float64, sizes, "slice", 0, None)
    norms = {k: _norm64(v) for k, v in held.items()}
    max_norms = {k: 0.5 * n if i != 1 else 2 * n for i, (k, n) in enumerate(norms.items())}
    at = f"three groups of norms {[f'{n:.3g}' for n in norms.values()]}, max_norms {max_norms}"
    _per_group_case(fn, m, held, groups, max_norms, torch.float64, at)
    held, groups = _groups(1, torch.float64, sizes, "transpose", 0, None)
    _per_group_case(fn, m, held, groups, 0.3, torch.float64, "the same groups under one max_norm 0.3")


def check_clip_per_group___contract(m):
    fn = "clip_per_group_"

    def body(case):
        seed, dtype, sizes, how, bad_group, bad, one = case
        bad_group %= len(sizes)
        held, groups = _groups(seed, dtype, sizes, how, bad_group, bad)
        norms = [_norm64([_finite(t) for t in v]) for v in held.values()]
        max_norms = 0.5 * min(norms) if one else {k: (0.3, 3.0)[i % 2] * n for i, (k, n) in enumerate(zip(held, norms))}
        at = (f"{str(dtype)[6:]}, {len(sizes)} group(s) of shapes {sizes}, .grad as {how} views, max_norms {max_norms}"
              + (f", {bad} in group layer{bad_group}" if bad else ""))
        _per_group_case(fn, m, held, groups, max_norms, dtype, at)

    explore(st.tuples(st.integers(0, 2**16), st.sampled_from([torch.float64, torch.float32]),
                      st.lists(SHAPES, min_size=1, max_size=3), VIEW, st.integers(0, 2),
                      st.sampled_from([None, math.inf, math.nan]), st.booleans()), body)


# --- predict_first_update_norm (predict, then measure) ----------------------------------------

def _measured(optimizer, numel, grad_norm, max_norm, lr, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(numel, generator=g, dtype=torch.float64))
    grad = torch.sign(torch.randn(numel, generator=g, dtype=torch.float64)) * (0.5 + torch.rand(numel, generator=g,
                                                                                                 dtype=torch.float64))
    p.grad = grad * (grad_norm / grad.norm())  # every element far from zero
    torch.nn.utils.clip_grad_norm_([p], max_norm)
    opt = torch.optim.SGD([p], lr=lr) if optimizer == "sgd" else torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    before = p.detach().clone()
    opt.step()
    return (p.detach() - before).norm().item()


def check_predict_first_update_norm(m):
    fn = "predict_first_update_norm"

    def body(case):
        optimizer, numel, grad_norm, max_norm, lr, seed = case
        at = f"{optimizer}, {numel} elements, gradient norm {grad_norm:g}, max_norm {max_norm:g}, lr {lr:g}"
        got = call(fn, m.predict_first_update_norm, optimizer, numel, grad_norm, max_norm, lr, at=at)
        assert_type(fn, "the prediction", got, float, at)
        want = _measured(optimizer, numel, grad_norm, max_norm, lr, seed)
        assert_value(fn, "the prediction", got, want, tol=1e-9 if optimizer == "sgd" else 1e-3,
                     ref=f"a real torch.optim.{'SGD' if optimizer == 'sgd' else 'AdamW'} step", at=at)

    explore(st.tuples(st.sampled_from(["sgd", "adamw"]), st.integers(1, 400), st.sampled_from([0.3, 2.0, 50.0]),
                      st.sampled_from([0.1, 1.0, 10.0]), st.sampled_from([1e-4, 1e-2, 0.5]), st.integers(0, 99)), body)


CHECKS = [check_global_grad_norm__contract, check_clip_coefficient__contract, check_clip_by_global_norm___contract,
          check_update_ratio__contract, check_clip_per_group_, check_clip_per_group___contract,
          check_predict_first_update_norm]
