"""Checks of exercises/ex55_update_dynamics.py against torch.nn.utils.clip_grad_norm_ and
float64 norms of the concatenated tensors (never against the answer file).

The gradients are several tensors of very different norms, so clipping each tensor on its
own, or averaging per-tensor ratios, gives wrong numbers; one threshold is above the norm, so
a coefficient that is not capped at 1 scales the gradients up and is caught. The gradients and
parameters also come as generators (``model.parameters()``), with ``None`` gradients among them,
in float32, bfloat16 and float16 (whose squares overflow where the norm does not), all zero and
tiny (where eps decides whether and how much to clip), and with a non-default eps.
"""

import torch

from bp_mech.checks.common import assert_close, assert_value, call, describe

TOL = 1e-12  # float64
TOL_DTYPE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}  # a norm rounded to the dtype
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,)]
SCALES = [3.0, 0.01, 0.5, 20.0]
NORM_REF = "the float64 norm of the concatenated gradients"
CLIP_REF = "torch.nn.utils.clip_grad_norm_"


def _grads(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) * c * scale for s, c in zip(SHAPES, SCALES)]


def _params(grads):
    ps = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64) if x is None else torch.zeros_like(x)) for x in grads]
    for p, x in zip(ps, grads):
        p.grad = None if x is None else x.clone()
    return ps


def _norm64(tensors):
    return torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in tensors if t is not None]))


def _is_0dim_tensor(fn, what, x, at):
    if not (torch.is_tensor(x) and x.dim() == 0):
        raise AssertionError(f"{fn}: {what} is {describe(x)}, expected a 0-dim tensor at {at}")


def check_global_grad_norm(m):
    fn = "global_grad_norm"
    for seed in (0, 1):
        grads = _grads(seed)
        at = f"float64 gradients of shapes {SHAPES} and a None"
        got = call(fn, m.global_grad_norm, grads + [None], at=at)
        _is_0dim_tensor(fn, "the norm", got, at)
        assert_value(fn, "the norm", got, _norm64(grads).item(), tol=TOL, ref=NORM_REF, at=at)


def check_global_grad_norm__iterables(m):
    fn = "global_grad_norm"
    grads = _grads(2)
    at = f"a generator of float64 gradients of shapes {SHAPES}, one None among them"
    got = call(fn, m.global_grad_norm, (g for g in [grads[0], None, *grads[1:]]), at=at)
    assert_value(fn, "the norm", got, _norm64(grads).item(), tol=TOL, ref=NORM_REF, at=at)
    at = "a tuple of float64 gradients"
    assert_value(fn, "the norm", call(fn, m.global_grad_norm, tuple(grads), at=at), _norm64(grads).item(), tol=TOL,
                 ref=NORM_REF, at=at)
    at = "no gradient at all ([None, None])"
    assert_value(fn, "the norm", call(fn, m.global_grad_norm, [None, None], at=at), 0.0, tol=0.0, ref="0", at=at)


def check_global_grad_norm__half_precision(m):
    fn = "global_grad_norm"
    for seed, dtype, scale in ((3, torch.float32, 1.0), (4, torch.bfloat16, 1.0), (5, torch.float16, 10.0)):
        grads = [t.to(dtype) for t in _grads(seed, scale)]  # float16 x 10: squares past 65504, the norm below it
        largest = max(t.abs().max().item() for t in grads)
        at = f"{str(dtype)[6:]} gradients of shapes {SHAPES}, largest |g| {largest:.3g}"
        got = call(fn, m.global_grad_norm, grads, at=at)
        _is_0dim_tensor(fn, "the norm", got, at)
        if got.dtype != dtype:
            raise AssertionError(f"{fn}: the norm is {got.dtype}, expected the gradients' dtype {dtype} at {at}")
        assert_value(fn, "the norm", got, _norm64(grads).item(), tol=TOL_DTYPE[dtype],
                     ref=NORM_REF + " (no 16-bit sum of squares)", at=at)


def _coef_ref(total, max_norm, eps):
    return min(1.0, max_norm / (float(total) + eps))


def _coef_case(m, total, max_norm, eps, at, ref="min(1, max_norm / (norm + eps)) in float64"):
    tol = 1e-10 if total.dtype == torch.float64 else TOL_DTYPE[total.dtype]
    fn = "clip_coefficient"
    args = (total, max_norm) if eps is None else (total, max_norm, eps)
    got = call(fn, m.clip_coefficient, *args, at=at)
    _is_0dim_tensor(fn, "c", got, at)
    assert_value(fn, "c", got, _coef_ref(total, max_norm, 1e-6 if eps is None else eps), tol=tol, ref=ref, at=at)


def check_clip_coefficient(m):
    grads = _grads(2)
    total = _norm64(grads)
    for max_norm in (0.5 * total.item(), 1.0, 2 * total.item()):
        p = _params([grads[0]])[0]  # one parameter with the first gradient
        before = p.grad.clone()
        # clip_grad_norm_ scales by its coefficient given the *stated* total norm: recover it
        torch.nn.utils.clip_grads_with_norm_([p], max_norm, total)
        want = (p.grad / before).mean().item()
        at = f"norm {total.item():.4g}, max_norm {max_norm:.4g}"
        got = call("clip_coefficient", m.clip_coefficient, total, max_norm, at=at)
        _is_0dim_tensor("clip_coefficient", "c", got, at)
        assert_value("clip_coefficient", "c", got, want, tol=1e-10, ref=CLIP_REF + "'s scaling", at=at)


def check_clip_coefficient__eps(m):
    f64, f32 = torch.float64, torch.float32
    _coef_case(m, torch.tensor(0.0, dtype=f64), 1.0, None, "norm 0 (all gradients zero), max_norm 1")
    _coef_case(m, torch.tensor(5e-7, dtype=f64), 1e-6, None, "norm 5e-07 < max_norm 1e-06: eps still makes c < 1")
    _coef_case(m, torch.tensor(2e-6, dtype=f64), 1e-6, None, "norm 2e-06, max_norm 1e-06: eps decides c")
    _coef_case(m, torch.tensor(1.5, dtype=f64), 1.0, 0.5, "norm 1.5, max_norm 1, eps 0.5 (not the default)")
    _coef_case(m, torch.tensor(3.0, dtype=f32), 2.0, 0.0, "a float32 norm 3, max_norm 2, eps 0")


def _clip_case(m, grads, max_norm, at, eps=None, as_generator=False):
    fn = "clip_by_global_norm_"
    ours, ref = _params(grads), _params(grads)
    args = (((p for p in ours) if as_generator else ours), max_norm) + (() if eps is None else (eps,))
    got_norm = call(fn, m.clip_by_global_norm_, *args, at=at)
    present = [p for p in ref if p.grad is not None]
    if eps is None:
        want_norm = torch.nn.utils.clip_grad_norm_(present, max_norm).item()
        ref_name = CLIP_REF
    else:  # clip_grad_norm_'s eps is fixed at 1e-6: its norm, and the documented coefficient
        want_norm = torch.nn.utils.get_total_norm([p.grad for p in present]).item()
        for p in present:
            p.grad.mul_(_coef_ref(want_norm, max_norm, eps))
        ref_name = "clip_grad_norm_'s norm and min(1, max_norm / (norm + eps))"
    _is_0dim_tensor(fn, "the returned norm", got_norm, at)
    assert_value(fn, "the returned norm (before clipping)", got_norm, want_norm, tol=TOL, ref=ref_name, at=at)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if b.grad is None:
            assert a.grad is None, f"{fn}: parameter {i} had no gradient and got one at {at}"
            continue
        assert_close(fn, f"gradient {i}", a.grad, b.grad, tol=TOL, ref=ref_name, at=at)


def check_clip_by_global_norm_(m):
    for seed, frac in ((3, 0.3), (4, 0.9), (5, 3.0)):  # two clipping cases, one where nothing may change
        grads = _grads(seed)
        total = _norm64(grads).item()
        _clip_case(m, grads, frac * total, f"max_norm = {frac} x the global norm {total:.4g}, a list of parameters")


def check_clip_by_global_norm___iterables(m):
    grads = _grads(6)
    total = _norm64(grads).item()
    _clip_case(m, grads, 0.4 * total, f"a generator of parameters (model.parameters()), max_norm = 0.4 x {total:.4g}",
               as_generator=True)
    _clip_case(m, [grads[0], None, *grads[1:], None], 0.4 * total,
               f"parameters whose .grad is None among them, max_norm = 0.4 x {total:.4g}")


def check_clip_by_global_norm___eps(m):
    _clip_case(m, [torch.zeros(s, dtype=torch.float64) for s in SHAPES], 1.0, "all gradients zero, max_norm 1")
    tiny = _grads(7)
    tiny = [t * (5e-7 / _norm64(tiny).item()) for t in tiny]  # norm 5e-7: c = min(1, 1e-6 / 1.5e-6) = 2/3
    total = _norm64(tiny).item()
    _clip_case(m, tiny, 2 * total, f"tiny gradients (norm {total:.2g} < max_norm {2 * total:.2g}, where eps decides)")
    grads = _grads(8)
    total = _norm64(grads).item()
    _clip_case(m, grads, 0.5 * total, f"eps 0.25 (not the default), max_norm = 0.5 x {total:.4g}", eps=0.25)


def _ratio_case(m, before, after, at):
    fn = "update_ratio"
    du = _norm64([a.double() - b.double() for b, a in zip(before, after)]).item()
    pn = _norm64(before).item()
    got = call(fn, m.update_ratio, before, after, at=at)
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        raise AssertionError(f"{fn}: returned {describe(got)}, expected (update_norm, param_norm, ratio) at {at}")
    for name, a, w in zip(("update_norm", "param_norm", "ratio"), got, (du, pn, du / pn)):
        if not isinstance(a, float):
            raise AssertionError(f"{fn}: {name} is {describe(a)}, expected a Python float at {at}")
        assert_value(fn, name, a, w, tol=1e-10, ref="float64 norms of the concatenated tensors", at=at)


def check_update_ratio(m):
    g = torch.Generator().manual_seed(6)
    before = [torch.randn(*s, generator=g, dtype=torch.float64) * c for s, c in zip(SHAPES, SCALES)]
    after = [b + 0.01 * torch.randn(b.shape, generator=g, dtype=torch.float64) for b in before]
    _ratio_case(m, before, after, f"float64 tensors of shapes {SHAPES}")


def check_update_ratio__low_precision(m):
    for seed, dtype in ((9, torch.float32), (10, torch.bfloat16), (11, torch.float16)):
        g = torch.Generator().manual_seed(seed)
        before = [(torch.randn(*s, generator=g, dtype=torch.float64) * c).to(dtype) for s, c in zip(SHAPES, SCALES)]
        after = [torch.nn.Parameter((b.double() * (1 + 0.01 * torch.randn(b.shape, generator=g, dtype=torch.float64)))
                                    .to(dtype)) for b in before]  # live parameters after the step
        _ratio_case(m, before, after, f"{str(dtype)[6:]} tensors of shapes {SHAPES} (computed in float64)")


from bp_mech.checks import ex55_contract as _c

CHECKS = [check_global_grad_norm, check_global_grad_norm__iterables, check_global_grad_norm__half_precision,
          _c.check_global_grad_norm__contract, check_clip_coefficient, check_clip_coefficient__eps,
          _c.check_clip_coefficient__contract, check_clip_by_global_norm_, check_clip_by_global_norm___iterables,
          check_clip_by_global_norm___eps, _c.check_clip_by_global_norm___contract, check_update_ratio,
          check_update_ratio__low_precision, _c.check_update_ratio__contract, _c.check_clip_per_group_,
          _c.check_clip_per_group___contract, _c.check_predict_first_update_norm]
