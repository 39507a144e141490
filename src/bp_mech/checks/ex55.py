"""Checks of exercises/ex55_update_dynamics.py: one declaration per function (``engine.Contract``).

References: float64 norms of the concatenated tensors and ``torch.nn.utils.clip_grad_norm_`` (its norm, its
scaling through ``clip_grads_with_norm_``; another eps: its norm and the documented formula), on the whole list
or on each group; never the answer file. The domains are the docstrings': tensors of very different norms,
thresholds above and below the norm, lists, tuples and generators with None gradients, all-zero and tiny
gradients (eps decides), a non-default eps, ±inf and NaN, float16 gradients whose squares pass 65504; inputs
exact in bfloat16 and float16, so a lower dtype in meets the float64 reference. A driver (``use``) builds the
parameters from their gradients, passes them as a generator, checks that only the ``.grad`` tensors change, in
place (the same objects, also a non-contiguous ``.grad``), and returns the norms and the gradients after. A
non-finite value is read as a number (NaN -1, +inf -2, -inf -3: ``_seen``) by the reference and the driver
alike. The engine derives the rest: defaults left out, inputs unchanged, views, dtypes, no aliasing, state.
"""
import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed
from bp_mech.checks.engine import Contract, checks
from bp_mech.checks.ex55_measure import PREDICT  # the prediction, against a real optimizer step

LOW = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}  # a norm rounded to the dtype
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,)]
SCALES = [3.0, 0.01, 0.5, 20.0]
SIZES = [[(4, 3), (5,)], [(6,)], [(2, 2), (3,), (7,)]]
SEEN = "NaN read as -1, +inf as -2"
BAD = st.sampled_from([(), (math.inf,), (math.nan,), (-math.inf, math.nan)])
DRAW_SHAPES = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=3)
VIEW = st.sampled_from(["slice", "transpose"])


def _seen(x):
    """``x`` with every non-finite value read as a number (NaN -1, +inf -2, -inf -3): comparable by value."""
    if torch.is_tensor(x) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
        return x.nan_to_num(nan=-1.0, posinf=-2.0, neginf=-3.0)
    if isinstance(x, float) and not math.isfinite(x):
        return -1.0 if math.isnan(x) else -2.0 if x > 0 else -3.0
    if isinstance(x, (list, tuple)):
        return type(x)(_seen(v) for v in x)
    return {k: _seen(v) for k, v in x.items()} if isinstance(x, dict) else x


def _exact(t):
    """``t`` rounded to a value that bfloat16 and float16 hold exactly (a lower dtype in changes nothing)."""
    return t.to(torch.bfloat16).to(torch.float16).double()


def _tensors(c, shapes=None, scales=None):
    g = torch.Generator().manual_seed(c["seed"])
    shapes = shapes or c.get("shapes", SHAPES)
    scales = scales or [SCALES[i % 4] for i in range(len(shapes))]
    out = [_exact(torch.randn(s, generator=g, dtype=torch.float64) * k * c.get("scale", 1.0))
           for s, k in zip(shapes, scales)]
    for j, b in enumerate(c.get("bad", ())):
        out[j % len(out)].view(-1)[j % out[j % len(out)].numel()] = b
    for i in c.get("none", ()):
        out.insert(i, None)
    return out


def _norm64(ts):
    ts = [t.detach().double().reshape(-1) for t in ts if t is not None]
    return torch.linalg.vector_norm(torch.cat(ts)) if ts else torch.zeros((), dtype=torch.float64)


def _note(c):
    bad = c.get("bad")
    return (f"holding {list(bad)}: {SEEN}" if bad else "") + (", " if bad and c.get("text") else "") + c.get("text", "")


def _norm_inputs(c):
    grads = _tensors(c)
    if c.get("grad"):
        grads = [t if t is None else t.requires_grad_() for t in grads]
    if c.get("all_none"):
        grads = [None, None]
    return {"grads": tuple(grads) if c.get("as") == "a tuple" else grads, "passed_as": c.get("as", "a list")}


def _norm_use(f):
    def g(grads, passed_as):
        return _seen(f(iter(grads) if passed_as == "a generator" else grads))
    return g


NORM = Contract(
    "global_grad_norm", _norm_inputs, lambda grads, passed_as: (_seen(_norm64(grads)),), ("the norm",),
    use=_norm_use, ref_name="the float64 norm of the concatenated gradients", tol=1e-12, dtypes=LOW, note=_note,
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "shapes": DRAW_SHAPES, "view": VIEW, "bad": BAD,
                                "grad": st.booleans(), "as": st.sampled_from(["a list", "a tuple", "a generator"]),
                                "scale": st.sampled_from([1.0, 30.0])}),
    examples={"": [{"seed": 0, "none": (4,)}, {"seed": 1, "none": (1, 3), "as": "a generator"},
                   {"seed": 2, "as": "a tuple", "grad": True, "view": "transpose"}],
              "no_gradient": [{"seed": 0, "all_none": True, "float64_only": True},
                              {"seed": 0, "all_none": True, "as": "a generator", "float64_only": True}],
              "half_precision": [{"seed": 5, "scale": 10.0, "text": "in float16 the squares pass 65504"}],
              "non_finite": [{"seed": 6, "bad": b} for b in ((math.inf,), (math.nan,), (-math.inf, math.nan))]})


def _coef_inputs(c):
    return {"total_norm": torch.tensor(c["norm"], dtype=torch.float64), "max_norm": c["max_norm"],
            "eps": c.get("eps", 1e-6)}


def _coef_ref(total_norm, max_norm, eps):
    if eps != 1e-6:  # clip_grad_norm_'s eps is 1e-6: another one, the documented formula
        v = float(total_norm)
        c = math.nan if math.isnan(v) else 0.0 if math.isinf(v) else min(1.0, max_norm / (v + eps)) if v + eps else 1.0
        return (_seen(torch.tensor(c, dtype=torch.float64)),)
    p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    p.grad = torch.ones((), dtype=torch.float64)  # clip_grad_norm_'s scaling of a gradient of 1 is c
    torch.nn.utils.clip_grads_with_norm_([p], max_norm, total_norm)
    return (_seen(p.grad),)


def _coef(norm, max_norm, **more):
    return {"norm": norm, "max_norm": max_norm, **more}


COEF = Contract(
    "clip_coefficient", _coef_inputs, _coef_ref, ("c",), use=lambda f: lambda *a, **k: _seen(f(*a, **k)),
    ref_name="clip_grad_norm_'s scaling, min(1, max_norm / (norm + eps))", dtypes=LOW, defaults={"eps": 1e-6},
    note=lambda c: f"total_norm {c['norm']:g}" + (f": {c['text']}" if "text" in c else ""),
    draw=st.fixed_dictionaries({
        "norm": st.one_of(st.integers(-8, 4).map(lambda k: float(_exact(torch.tensor(3.0 * 10.0**k)))),
                          st.sampled_from([0.0, math.inf, math.nan])),
        "max_norm": st.sampled_from([1e-3, 1.0, 50.0]), "eps": st.sampled_from([1e-6, 0.1])}),
    examples={"": [_coef(5.25, 2.625), _coef(5.25, 1.0), _coef(5.25, 10.5), _coef(0.5, 1e9)],
              "eps": [_coef(0.0, 1.0, text="all gradients zero"), _coef(1.5, 1.0, eps=0.5), _coef(3.0, 2.0, eps=0.0),
                      _coef(5e-7, 1e-6, text="eps still makes c < 1", float64_only=True),  # (subnormal in float16)
                      _coef(2e-6, 1e-6, text="eps decides c", float64_only=True),
                      _coef(0.0, 2.0, eps=0.0, text="max_norm / 0 is inf: c = 1")],
              "non_finite": [_coef(math.inf, 1.0, text="c = 0"), _coef(math.nan, 1.0, text=f"c = NaN ({SEEN})")]})


def _params(grads, seed=0):
    """Parameters whose ``.grad`` are copies of ``grads`` with their strides (a non-contiguous view stays one)."""
    g, params = torch.Generator().manual_seed(seed), []
    for t in grads:
        x = torch.randn((3,) if t is None else t.shape, generator=g, dtype=torch.float64)
        params.append(torch.nn.Parameter(x if t is None else x.to(t.dtype)))
        params[-1].grad = None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
    return params


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _watch(fn, params, name="parameter"):
    """After the call: each ``.grad`` the same object, each parameter's values unchanged."""
    held, data = [p.grad for p in params], [p.detach().clone() for p in params]

    def after(norm):
        for i, (p, h, d) in enumerate(zip(params, held, data)):
            if p.grad is not h:
                raise CheckFailed(f"{fn}: the .grad of {name} {i} was replaced by a new tensor (clip it in place)")
            if not torch.equal(p.detach(), d):
                raise CheckFailed(f"{fn}: the values of {name} {i} changed (only .grad may)")
            if torch.is_tensor(norm) and h is not None and _ptr(norm) == _ptr(h):
                raise CheckFailed(f"{fn}: the norm shares its storage with the .grad of {name} {i}")
        return [_seen(p.grad) if p.grad is None else _seen(p.grad.clone()) for p in params]
    return after


def _clip_use(f):
    def g(params, max_norm, *rest, **kw):
        ps = _params(params)
        after = _watch("clip_by_global_norm_", ps)
        norm = f((p for p in ps), max_norm, *rest, **kw)
        return _seen(norm), after(norm)
    return g


def _clip_ref(grads, max_norm, eps=1e-6):
    """clip_grad_norm_ on contiguous float64 copies (another eps: its norm, then the documented coefficient)."""
    ps = _params([None if t is None else t.contiguous() for t in grads])
    present = [p for p in ps if p.grad is not None]
    if eps == 1e-6:
        norm = torch.nn.utils.clip_grad_norm_(present, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in present])
        v = float(norm)
        for p in present:
            p.grad.mul_(min(1.0, max_norm / (v + eps)) if math.isfinite(v) else max_norm / (v + eps))
    return _seen(norm.detach() if present else torch.zeros(())), [_seen(p.grad) for p in ps]


def _clip_inputs(c):
    grads = _tensors(c)
    if c.get("zero"):
        grads = [t if t is None else torch.zeros_like(t) for t in grads]
    total = float(_norm64([t if t is None else torch.where(torch.isfinite(t), t, 0) for t in grads]))
    if c.get("tiny"):
        grads = [t if t is None else _exact(t * (5e-7 / total)) for t in grads]
        total = float(_norm64(grads))
    return {"params": grads, "max_norm": c.get("max_norm") or c["frac"] * total, "eps": c.get("eps", 1e-6)}


CLIP_NOTE = "the parameters' .grad, passed as a generator"


def _clip(seed, frac, **more):
    return {"seed": seed, "frac": frac, **more}


CLIP = Contract(
    "clip_by_global_norm_", _clip_inputs, lambda params, max_norm, eps: _clip_ref(params, max_norm, eps),
    ("the norm", "the gradients"), use=_clip_use, ref_name="torch.nn.utils.clip_grad_norm_", tol=1e-12,
    dtypes=LOW, defaults={"eps": 1e-6}, note=lambda c: f"{CLIP_NOTE}{', ' if _note(c) else ''}{_note(c)}",
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "shapes": DRAW_SHAPES, "view": VIEW, "bad": BAD,
                                "frac": st.sampled_from([0.3, 3.0])}),
    examples={"": [_clip(3, 0.3), _clip(4, 0.9, view="transpose"), _clip(5, 3.0), _clip(6, 0.4, none=(1, 5))],
              "eps": [_clip(0, 1.0, zero=True, max_norm=1.0, text="all gradients zero"),
                      _clip(7, 2.0, tiny=True, float64_only=True, text="norm 5e-07 < max_norm 1e-06: eps decides"),
                      _clip(8, 0.5, eps=0.25)],
              "non_finite": [_clip(9, 0.5, bad=b) for b in ((math.inf,), (math.nan,), (-math.inf, math.nan))]})


def _ratio_inputs(c):
    clean = {**c, "bad": ()}  # the bad values only in the step
    before = _tensors(clean, scales=[0.0] * len(c.get("shapes", SHAPES))) if c.get("zero") else _tensors(clean)
    step = _tensors({**c, "seed": c["seed"] + 1})
    after = [_exact(b + 0.01 * t) for b, t in zip(before, step)]
    for a, t in zip(after, step):  # the bad values planted in the step, not rounded away
        a[~torch.isfinite(t)] = t[~torch.isfinite(t)]
    return {"before": before, "after": [a.requires_grad_() for a in after] if c.get("live") else after}


def _ratio_ref(before, after):
    du = float(_norm64([a.detach() - b for b, a in zip(before, after)]))
    pn = float(_norm64(before))
    return _seen((du, pn, du / pn if pn else math.inf))


RATIO = Contract(
    "update_ratio", _ratio_inputs, _ratio_ref, ("update_norm", "param_norm", "ratio"),
    use=lambda f: lambda *a, **k: _seen(f(*a, **k)), ref_name="float64 norms of the concatenations",
    dtypes={d: 1e-10 for d in LOW}, note=lambda c: _note({**c, "text": "before all zero" if c.get("zero") else ""}),
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "shapes": DRAW_SHAPES, "view": VIEW, "bad": BAD,
                                "zero": st.booleans(), "live": st.booleans()}),
    examples={"": [{"seed": 6}, {"seed": 9, "live": True, "view": "transpose"}, {"seed": 12, "scale": 0.01}],
              "non_finite": [{"seed": 10, "bad": (math.inf,)}, {"seed": 10, "bad": (math.nan,)},
                             {"seed": 11, "zero": True}]})


def _groups_use(f):
    def g(groups, max_norms, *rest, **kw):
        ps = {k: _params(v, i) for i, (k, v) in enumerate(groups.items())}
        given, lists = dict(ps), {k: list(v) for k, v in ps.items()}
        limits = dict(max_norms) if isinstance(max_norms, dict) else max_norms
        watch = {k: _watch("clip_per_group_", v, f"{k!r}'s parameter") for k, v in ps.items()}
        norms = f(ps, max_norms, *rest, **kw)
        if list(ps) != list(given) or any(ps[k] is not given[k] or ps[k] != lists[k] for k in given):
            raise CheckFailed("clip_per_group_: groups was modified (its keys or lists changed)")
        if max_norms != limits:
            raise CheckFailed(f"clip_per_group_: max_norms was modified ({limits} before, {max_norms} after)")
        if isinstance(norms, dict) and list(norms) != list(ps):
            raise CheckFailed(f"clip_per_group_: returned a dict with keys {list(norms)}, expected the group names "
                              f"{list(ps)} in order")
        return _seen(norms), {k: w(norms.get(k) if isinstance(norms, dict) else None) for k, w in watch.items()}
    return g


def _groups_ref(groups, max_norms, eps):
    out = {k: _clip_ref(v, max_norms[k] if isinstance(max_norms, dict) else max_norms, eps) for k, v in groups.items()}
    return {k: n for k, (n, _) in out.items()}, {k: gs for k, (_, gs) in out.items()}


def _groups_inputs(c):
    held, bad = {}, c.get("bad_group", 0) % len(c["sizes"])
    for i, shapes in enumerate(c["sizes"]):  # groups of very different norms (x 0.01 ... x 100)
        planted = {"bad": (c["bad"],) if i == bad and c.get("bad") is not None else (), "none": c.get("none", ())}
        held[f"layer{i}"] = _tensors({"seed": c["seed"] + i, **planted}, shapes, [10.0 ** (2 * (i % 3) - 2)] * 9)
    norms = [float(_norm64([t for t in v if t is not None and bool(torch.isfinite(t).all())] or [torch.ones(1)]))
             for v in held.values()]
    fracs, r = c.get("fracs", [0.3, 3.0]), lambda v: float(f"{v:.4g}")
    max_norms = r(0.5 * min(norms)) if c.get("one") else {k: r(fracs[i % len(fracs)] * n)
                                                           for i, (k, n) in enumerate(zip(held, norms))}
    return {"groups": held, "max_norms": max_norms, "eps": c.get("eps", 1e-6)}


PER_GROUP = Contract(
    "clip_per_group_", _groups_inputs, _groups_ref, ("the norms", "the gradients"), use=_groups_use,
    ref_name="clip_grad_norm_ on each group", tol=1e-12, dtypes=LOW, defaults={"eps": 1e-6},
    note=lambda c: CLIP_NOTE + (f", {c['bad']} in group layer{c.get('bad_group', 0) % len(c['sizes'])}: {SEEN}"
                                if c.get("bad") is not None else ""),
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "sizes": st.lists(DRAW_SHAPES, min_size=1, max_size=3),
                                "view": VIEW, "bad_group": st.integers(0, 2),
                                "bad": st.sampled_from([None, math.inf, math.nan]), "one": st.booleans()}),
    examples={"": [{"seed": 0, "sizes": SIZES, "fracs": [0.5, 2.0, 0.5]}, {"seed": 2, "sizes": SIZES, "eps": 0.25},
                   {"seed": 1, "sizes": SIZES, "one": True, "view": "transpose", "none": (1,)}],
              "non_finite": [{"seed": 3, "sizes": SIZES, "bad": b, "bad_group": 1} for b in (math.inf, math.nan)]})

CHECKS = checks(NORM, COEF, CLIP, RATIO, PER_GROUP, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex55.check_global_grad_norm__non_finite, ...
