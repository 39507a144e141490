"""Checks of exercises/ex_amp_backward.py: one declaration per function (``engine.Contract``).

References: a real ``torch.amp.GradScaler("cpu")`` driven through the same overflow patterns (its scale, its
``_growth_tracker``, whether the parameter moved, its ``state_dict``) for the scaler; ``clip_grad_norm_`` (and
``get_total_norm`` with the documented formula at another eps) on float64 unscaled gradients for the clipping.
Never the answer file. The domains: an overflow exactly where the growth interval would complete, torch's
defaults, growth factors other than 2, scales near float32's largest value (a growth past it is refused);
gradients where eps decides (tiny and zero), a non-default eps, ``inf``, ``-inf`` and NaN (told apart), fp16
gradients whose scaled norm overflows though no element does. ``DynamicLossScaler`` and ``unscale_and_clip_`` are
graded through drivers (the scaler's protocol; the gradients as the caller's tensors hold them after the call).
The variant and the prediction: ``ex_amp_variant``. The engine derives the rest.
"""

import copy
import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import CheckFailed, randn64
from bp_mech.checks.engine import Contract, checks
from bp_mech.checks.ex_amp_variant import CAST, PREDICT, GradScalerReference

GRADSCALER = "torch.amp.GradScaler"
PATTERNS = [
    (dict(init_scale=2.0**16, growth_interval=3), [False, False, True, False, False, False, False, False, False,
                                                   True, True, False, False, False]),
    (dict(init_scale=2.0**10, growth_interval=1), [False, False, True, False, True, True, False]),
    (dict(init_scale=2.0**16), [True, True, True, False, False]),  # torch's defaults
    ({}, [False, True, False]),  # every argument left out
    (dict(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2),
     [False, True, False, False, False, True, False, False, False, False]),
]
TOP_OF_RANGE = [  # growths that would pass float32's largest value (about 3.4e38 = 2^128 - 2^104)
    (dict(init_scale=2.0**125, growth_interval=1), [False] * 5 + [True] + [False] * 4),
    (dict(init_scale=2.0**126, growth_interval=2), [False] * 6 + [True, False, False, False, False]),
    (dict(init_scale=2.0**127, growth_factor=1.5, growth_interval=1), [False] * 4 + [True] + [False] * 3),
]


def _random_patterns():
    g = torch.Generator().manual_seed(7)
    return [(dict(init_scale=2.0**12, growth_interval=n), (torch.rand(30, generator=g) < 0.25).tolist())
            for n in (2, 4, 5)]


def _scaler_obs(s) -> dict:
    return {"scale": s.scale, "growth_tracker": s.growth_tracker}


def _step_obs(s, found_inf) -> dict:
    return {"update()": s.update(found_inf), **_scaler_obs(s)}


def _ref_step(ref, found_inf) -> dict:
    skipped, scale, tracker = ref.step(found_inf)
    return {"update()": skipped, "scale": scale, "growth_tracker": tracker}


def _label(i, found_inf):
    return f"step {i} ({'overflow' if found_inf else 'finite'})"


def _load_missing(s, state) -> str:
    try:
        s.load_state_dict({k: v for k, v in state.items() if k != "scale"})
    except KeyError:
        return "KeyError"
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 (the learner's code may raise anything)
        return type(e).__name__
    return "nothing (it accepted it silently; expected KeyError)"


def _drive_scaler(cls):
    """The driver of ``DynamicLossScaler``: ``run(kw, pattern, resume)`` -> what a loop and a checkpoint observe:
    a scaler built from ``kw`` while a second one backs off; after each step of ``pattern`` update()'s result,
    scale and growth_tracker; then (``resume`` not None) the state_dict() returned, the scaler after that dict was
    edited, the dicts given to load_state_dict after it, two fresh scalers loaded from ours and from GradScaler's
    state_dict stepped through ``resume``, and load_state_dict of a state without 'scale'."""
    def run(kw, pattern, resume):
        ours, other = cls(**kw), cls(**kw)
        other.update(True)  # a backoff: always a new scale
        out = {"the scaler while a second one backed off (no state shared)": _scaler_obs(ours),
               "after each step": {_label(i, f): _step_obs(ours, f) for i, f in enumerate(pattern)}}
        if resume is None:
            return out
        state = ours.state_dict()
        kept = copy.deepcopy(state)
        out["state_dict()"] = kept
        if isinstance(state, dict):
            state["scale"], state["_growth_tracker"] = -1.0, 10**6
        out["the scaler after the dict state_dict() returned was edited (return a new dict)"] = _scaler_obs(ours)
        ref = GradScalerReference(**kw)
        for f in pattern:
            ref.step(f)
        for name, source in (("ours", kept), ("GradScaler's", ref.scaler.state_dict())):
            given, loaded = copy.deepcopy(source), cls()
            try:
                loaded.load_state_dict(given)
                after = {_label(i, f): _step_obs(loaded, f) for i, f in enumerate(resume)}
            except (NotImplementedError, CheckFailed):
                raise
            except Exception as e:  # noqa: BLE001 (named in the observation; an earlier one may say why)
                after = f"load_state_dict raised {type(e).__name__}: {e}"
            out[f"the dict given to load_state_dict({name} state_dict()), after it (not modified)"] = given
            out[f"a fresh scaler after load_state_dict({name} state_dict())"] = after
        out["load_state_dict of a state without 'scale'"] = _load_missing(cls(), kept)
        return out
    return run


def _scaler_ref(kw, pattern, resume) -> tuple:
    ref, init = GradScalerReference(**kw), kw.get("init_scale", 2.0**16)
    out = {"the scaler while a second one backed off (no state shared)": {"scale": init, "growth_tracker": 0},
           "after each step": {_label(i, f): _ref_step(ref, f) for i, f in enumerate(pattern)}}
    if resume is None:
        return (out,)
    state = ref.scaler.state_dict()
    out["state_dict()"] = state
    out["the scaler after the dict state_dict() returned was edited (return a new dict)"] = {
        "scale": state["scale"], "growth_tracker": state["_growth_tracker"]}
    after = {_label(i, f): _ref_step(ref, f) for i, f in enumerate(resume)}
    for name in ("ours", "GradScaler's"):
        out[f"the dict given to load_state_dict({name} state_dict()), after it (not modified)"] = state
        out[f"a fresh scaler after load_state_dict({name} state_dict())"] = after
    out["load_state_dict of a state without 'scale'"] = "KeyError"
    return (out,)


def _scaler_cases(patterns, resume=None):
    return [{"kw": kw, "pattern": p, "resume": resume} for kw, p in patterns]


SCALER = Contract(
    "DynamicLossScaler", lambda c: {"kw": c["kw"], "pattern": c["pattern"], "resume": c["resume"]}, _scaler_ref,
    ("the scaler",), tol=1e-6, use=_drive_scaler, ref_name=f"{GRADSCALER} (a float32 scale)",
    draw=st.fixed_dictionaries({
        "kw": st.fixed_dictionaries({"init_scale": st.integers(0, 24).map(lambda k: 2.0**k),
                                     "growth_factor": st.sampled_from([2.0, 3.0, 1.5]),
                                     "backoff_factor": st.sampled_from([0.5, 0.25]),
                                     "growth_interval": st.integers(1, 4)}),
        "pattern": st.lists(st.booleans(), max_size=8),
        "resume": st.none() | st.lists(st.booleans(), min_size=1, max_size=8)}),
    examples={"": _scaler_cases(PATTERNS), "random_patterns": _scaler_cases(_random_patterns()),
              "top_of_range": _scaler_cases(TOP_OF_RANGE),
              "state_dict": _scaler_cases(PATTERNS[:1] + PATTERNS[3:] + TOP_OF_RANGE[2:], [False, True, False, False])
              + _scaler_cases([(dict(init_scale=2.0**8, growth_interval=2), [])], [True])})


# --- unscale_and_clip_ ------------------------------------------------------------------


def _word(x):
    """A non-finite Python float as its name ('inf', 'nan'): the engine's relative error of inf to inf is NaN."""
    return repr(x) if type(x) is float and not math.isfinite(x) else x


def _drive_clip(f):
    """The driver of ``unscale_and_clip_``: its three results (a non-finite norm named), whether the list still
    holds the tensors given, and the gradients as those tensors (of the layout given: views stay views) hold
    them after the call (an element that was inf or NaN before it zeroed: the contract says nothing of it)."""
    def run(grads, scale, max_norm, *eps, **kw):
        # the engine reuses its inputs for the views and dtypes calls: f updates copies of the same layout instead
        grads = [torch.empty_strided(g.shape, g.stride(), dtype=g.dtype).copy_(g) for g in grads]
        held, finite = list(grads), [torch.isfinite(g) for g in grads]
        out = f(grads, scale, max_norm, *eps, **kw)
        if not (type(out) is tuple and len(out) == 3):
            return out  # the engine names what came back
        same = len(grads) == len(held) and all(a is b for a, b in zip(grads, held))
        return (_word(out[0]), *out[1:], same, [torch.where(m, g, 0) for g, m in zip(held, finite)])
    return run


def _clip_ref(grads, scale, max_norm, eps=1e-6):
    unscaled = [g / scale for g in grads]
    norm = float(torch.nn.utils.get_total_norm(unscaled))
    finite = [torch.isfinite(g) for g in grads]
    if not math.isfinite(norm):
        return _word(norm), 1.0, True, True, [torch.where(m, u, 0) for u, m in zip(unscaled, finite)]
    if eps == 1e-6:  # clip_grad_norm_ itself
        params = [torch.zeros_like(u, requires_grad=True) for u in unscaled]
        for p, u in zip(params, unscaled):
            p.grad = u.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return norm, min(1.0, max_norm / (norm + eps)), False, True, [p.grad for p in params]
    coef = min(1.0, max_norm / (norm + eps))
    return norm, coef, False, True, [u * coef for u in unscaled]


def _clip_case(c):
    """Gradients times S (float64; the engine casts them to each dtype). "top": the largest S at which no element
    passes float16's 65504 while the scaled norm does; max_norm ``ratio`` times the true norm, or ``max_norm``."""
    g = torch.Generator().manual_seed(c["seed"])
    shapes = list(c["shapes"]) + ([(5, 6)] if c.get("log2") == "top" else [])
    true = [randn64(g, *s) * c.get("spread", 1.0) for s in shapes]
    if c.get("zero"):
        true = [torch.zeros_like(t) for t in true]
    log2 = c["log2"]
    if log2 == "top":
        log2 = math.floor(math.log2(65504 / max(t.abs().max().item() for t in true)))
    scale = 2.0 ** log2
    grads = [t * scale for t in true]
    for j, v in enumerate(c.get("bad", ())):  # inf, -inf, NaN planted
        flat = grads[j % len(grads)].view(-1)
        flat[(3 * j) % flat.numel()] = v
    norm = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in true])))
    max_norm = c["max_norm"] if "max_norm" in c else c["ratio"] * norm
    return {"grads": grads, "scale": scale, "max_norm": max_norm, "eps": c.get("eps", 1e-6)}


SHAPES = [(4, 5), (7,), (3, 2, 2)]
F64 = {"shapes": SHAPES, "float64_only": True}  # S up to 2^24: past float16's range
CLIP = Contract(
    "unscale_and_clip_", _clip_case, _clip_ref, ("total_norm", "clip_coef", "found_inf", "the same tensors in the list",
                                                 "the gradients after the call"),
    use=_drive_clip, defaults={"eps": 1e-6}, ref_name="unscale_ then clip_grad_norm_ in float64",
    dtypes={torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2},
    note=lambda c: c.get("bad") and f"gradients holding {list(c['bad'])}",
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16), "view": st.sampled_from(["slice", "transpose"]),
                                "shapes": st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=1,
                                                   max_size=3),
                                "log2": st.sampled_from([0, 4, 12, "top"]), "ratio": st.sampled_from([0.3, 3.0])}),
    examples={"": [{**F64, "seed": 1, "log2": 16, "max_norm": 1.0}, {**F64, "seed": 2, "spread": 0.01, "log2": 16,
                                                                    "max_norm": 1.0},  # clipped, unclipped
                   {**F64, "seed": 3, "spread": 3.0, "log2": 24, "max_norm": 0.5},  # a huge scale
                   {"shapes": SHAPES, "seed": 4, "spread": 0.5, "log2": 0, "max_norm": 2.0},  # no scale
                   {"seed": 1, "shapes": [(3, 4)], "log2": "top", "ratio": 3.0}],  # fp16: a scaled norm past 65504
              "eps": [{**F64, "seed": 5, "spread": 1e-7, "log2": 16, "max_norm": 1e-6},  # norm < max_norm, coef < 1
                      {**F64, "seed": 6, "spread": 4e-7, "log2": 16, "max_norm": 1e-6},  # with eps ~0.29, not 0.4
                      {"shapes": SHAPES, "seed": 7, "spread": 0.2, "log2": 10, "max_norm": 0.5, "eps": 0.1},
                      {"shapes": SHAPES, "seed": 8, "log2": 16, "max_norm": 1.0, "zero": True}],  # coefficient 1
              "overflow": [{"shapes": SHAPES, "seed": s, "log2": 4, "max_norm": 1.0, "bad": b} for s, b in (
                  (5, (math.inf,)), (6, (math.nan,)), (7, (-math.inf,)), (8, (math.inf, math.nan)),
                  (9, (-math.inf, math.inf, 2.0)))]})

CHECKS = checks(SCALER, CLIP, CAST, PREDICT)
globals().update({c.__name__: c for c in CHECKS})  # ex_amp.check_unscale_and_clip___overflow, ...
