"""Checks of exercises/ex55_update_dynamics.py against torch.nn.utils.clip_grad_norm_ and
float64 norms of the concatenated tensors (never against the answer file).

The gradients are several tensors of very different norms, so clipping each tensor on its
own, or averaging per-tensor ratios, gives wrong numbers; one threshold is above the norm, so
a coefficient that is not capped at 1 scales the gradients up and is caught.
"""

import torch

TOL = 1e-12  # float64
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,)]
SCALES = [3.0, 0.01, 0.5, 20.0]


def _grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) * c for s, c in zip(SHAPES, SCALES)]


def _params(grads):
    ps = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(ps, grads):
        p.grad = x.clone()
    return ps


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check_global_grad_norm(m):
    for seed in (0, 1):
        grads = _grads(seed)
        want = torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads]))
        got = m.global_grad_norm(grads + [None])
        assert _rel(got, want) <= TOL, f"global_grad_norm: {float(got):.6g}, expected {want.item():.6g}"


def check_clip_coefficient(m):
    grads = _grads(2)
    total = torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads]))
    for max_norm in (0.5 * total.item(), 1.0, 2 * total.item()):
        p = _params([grads[0]])[0]  # one parameter with the first gradient
        before = p.grad.clone()
        # clip_grad_norm_ scales by its coefficient given the *stated* total norm: recover it
        torch.nn.utils.clip_grads_with_norm_([p], max_norm, total)
        want = (p.grad / before).mean()
        got = m.clip_coefficient(total, max_norm)
        assert _rel(got, want) <= 1e-10, (f"clip_coefficient(norm={total.item():.4g}, max_norm={max_norm:.4g}): "
                                          f"{float(got):.6g}, torch scales by {want.item():.6g}")


def check_clip_by_global_norm_(m):
    for seed, frac in ((3, 0.3), (4, 0.9), (5, 3.0)):  # two clipping cases, one where nothing may change
        grads = _grads(seed)
        total = torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads])).item()
        ours, ref = _params(grads), _params(grads)
        got_norm = m.clip_by_global_norm_(ours, frac * total)
        want_norm = torch.nn.utils.clip_grad_norm_(ref, frac * total)
        assert got_norm is not None and _rel(got_norm, want_norm) <= TOL, \
            "clip_by_global_norm_: return the global norm before clipping"
        for i, (a, b) in enumerate(zip(ours, ref)):
            err = _rel(a.grad, b.grad)
            assert err <= TOL, (f"clip_by_global_norm_(max_norm = {frac} x norm): gradient {i} differs from "
                                f"clip_grad_norm_ (rel. error {err:.1e}); one global coefficient, capped at 1")


def check_update_ratio(m):
    g = torch.Generator().manual_seed(6)
    before = [torch.randn(*s, generator=g, dtype=torch.float64) * c for s, c in zip(SHAPES, SCALES)]
    after = [b + 0.01 * torch.randn(b.shape, generator=g, dtype=torch.float64) for b in before]
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    du = torch.linalg.vector_norm(flat(after) - flat(before)).item()
    pn = torch.linalg.vector_norm(flat(before)).item()
    got = m.update_ratio(before, after)
    assert got is not None and len(got) == 3, "update_ratio: return (update_norm, param_norm, ratio)"
    for name, a, w in zip(("update_norm", "param_norm", "ratio"), got, (du, pn, du / pn)):
        assert abs(a - w) <= 1e-10 * abs(w), f"update_ratio {name}: {a:.6g}, expected {w:.6g}"


CHECKS = [check_global_grad_norm, check_clip_coefficient, check_clip_by_global_norm_, check_update_ratio]
