"""Contract checks of exercises/ex_amp_backward.py, explored by hypothesis (``properties.explore``).

``DynamicLossScaler`` against a real ``torch.amp.GradScaler("cpu")`` on drawn settings and overflow
patterns: exact types, no state shared across instances, ``state_dict`` equal to GradScaler's, a new
dict, JSON-serialisable, and a round trip (ours or GradScaler's dict) that restores every piece of
state; a missing key raises ``KeyError``. ``unscale_and_clip_`` on drawn float32/float16/bfloat16
gradients held in non-contiguous views, against float64 norms: exact types, in place through the
caller's tensors, inf and NaN told apart. The variant and the prediction: ``ex_amp_variant``.
"""

import copy
import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.common import assert_close, assert_value, call, describe
from bp_mech.checks.properties import (
    assert_json,
    assert_type,
    explore,
    strided,
)

KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
TYPES = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
         "_growth_tracker": int}

SCALER = st.fixed_dictionaries({
    "init_scale": st.integers(0, 24).map(lambda k: 2.0**k), "growth_factor": st.sampled_from([2.0, 3.0, 1.5]),
    "backoff_factor": st.sampled_from([0.5, 0.25]), "growth_interval": st.integers(1, 4)})
PATTERN = st.lists(st.booleans(), min_size=0, max_size=8)


class GradScalerReference:
    """A one-parameter SGD under torch's GradScaler; ``step(found_inf)`` -> (skipped, scale, tracker)."""

    def __init__(self, **kw) -> None:
        self.p = torch.zeros(1, requires_grad=True)
        self.opt = torch.optim.SGD([self.p], lr=1.0)
        self.scaler = torch.amp.GradScaler("cpu", **kw)

    def step(self, found_inf: bool):
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(self.p.sum() * (math.inf if found_inf else 1.0)).backward()
        before = self.p.detach().clone()
        self.scaler.step(self.opt)
        self.scaler.update()
        state = self.scaler.state_dict()
        return torch.equal(before, self.p.detach()), state["scale"], state["_growth_tracker"]


def _ref(kw):
    return GradScalerReference(**kw)


def _step(fn, ours, ref, found_inf, at):
    skipped, scale, tracker = ref.step(found_inf)
    got = call(fn, ours.update, found_inf, at=at)
    assert_type(fn, "update()'s result", got, bool, at)
    assert got == skipped, f"{fn}: update() says skip={got}, torch.amp.GradScaler {skipped=} at {at}"
    assert_type(fn, "scale", ours.scale, float, at)
    assert_type(fn, "growth_tracker", ours.growth_tracker, int, at)
    assert_value(fn, "scale", ours.scale, scale, tol=1e-6, ref="torch.amp.GradScaler", at=at)
    assert ours.growth_tracker == tracker, (f"{fn}: growth_tracker is {ours.growth_tracker}, GradScaler has "
                                            f"{tracker} at {at}")


def _init_scale(kw) -> float:
    return kw["init_scale"]  # a power of two: the same in float32


def check_DynamicLossScaler__contract(m):
    fn = "DynamicLossScaler"

    def body(case):
        kw, before, after = case
        at = f"DynamicLossScaler({kw}), overflow pattern {before} then {after}"
        ours = call(fn, m.DynamicLossScaler, **kw, at=at)
        other = call(fn, m.DynamicLossScaler, **kw, at=at)
        call(fn, other.update, True, at=at)  # a backoff: always a new scale
        if ours.scale != _init_scale(kw) or ours.growth_tracker != 0:
            raise AssertionError(f"{fn}: updating one instance changed another (scale {ours.scale!r}, tracker "
                                 f"{ours.growth_tracker!r}; no state may be shared across instances) at {at}")
        ref = _ref(kw)
        for found_inf in before:
            _step(fn, ours, ref, found_inf, at)
        state = call(fn, ours.state_dict, at=at)
        assert_type(fn, "state_dict()", state, dict, at)
        want = ref.scaler.state_dict()
        if set(state) != set(KEYS):
            raise AssertionError(f"{fn}: state_dict() has keys {sorted(state)}, GradScaler's are {sorted(KEYS)} "
                                 f"at {at}")
        for k in KEYS:
            assert_type(fn, f"state_dict()[{k!r}]", state[k], TYPES[k], at)
            assert_value(fn, f"state_dict()[{k!r}]", state[k], want[k], tol=1e-6, ref="GradScaler.state_dict()", at=at)
        assert_json(fn, "state_dict()", state, at)
        kept = copy.deepcopy(state)
        state["scale"], state["_growth_tracker"] = -1.0, 10**6
        if ours.scale != kept["scale"] or ours.growth_tracker != kept["_growth_tracker"]:
            raise AssertionError(f"{fn}: changing the dict state_dict() returned changed the scaler (return a new "
                                 f"dict) at {at}")
        loaded = [call(fn, m.DynamicLossScaler, at=at) for _ in range(2)]
        for target, source in zip(loaded, (kept, want)):
            given = copy.deepcopy(source)
            call(fn, target.load_state_dict, given, at=at)
            if given != source:
                raise AssertionError(f"{fn}: load_state_dict() modified the dict it was given at {at}")
        for i, found_inf in enumerate(after):  # both restored scalers go on exactly as GradScaler
            where = f"{at}: step {i} after load_state_dict"
            skipped, scale, tracker = ref.step(found_inf)
            for name, target in zip(("ours", "GradScaler's"), loaded):
                got = call(fn, target.update, found_inf, at=where)
                if got != skipped or abs(target.scale - scale) > 1e-6 * scale or target.growth_tracker != tracker:
                    raise AssertionError(f"{fn}: after load_state_dict({name} state_dict()) the scaler says "
                                         f"skip={got}, scale {target.scale!r}, tracker {target.growth_tracker!r}; "
                                         f"GradScaler {skipped}, {scale!r}, {tracker} (state not restored) at {where}")
        missing = {k: v for k, v in kept.items() if k != "scale"}
        try:
            loaded[0].load_state_dict(missing)
        except KeyError:
            return
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{fn}: load_state_dict() without 'scale' raised {type(e).__name__}, expected "
                                 f"KeyError at {at}") from e
        raise AssertionError(f"{fn}: load_state_dict() accepted a state without 'scale' silently (expected KeyError) "
                             f"at {at}")

    explore(st.tuples(SCALER, PATTERN, st.lists(st.booleans(), min_size=1, max_size=8)), body)


# --- unscale_and_clip_ ------------------------------------------------------------------

DTYPE_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SHAPES = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=1, max_size=3)
CLIP = st.tuples(st.integers(0, 2**16), st.sampled_from(list(DTYPE_TOL)), SHAPES,
                 st.sampled_from(["slice", "transpose"]),
                 st.sampled_from([0, 4, 12, "top"]), st.sampled_from([0.3, 3.0]))


def _scaled(case):
    """(gradients times S in the dtype, the same in non-contiguous views, S). "top": the largest S at which
    no element overflows float16, while the norm of the scaled gradients does (S is grown until just that)."""
    seed, dtype, shapes, how, log2_scale, _ = case
    g = torch.Generator().manual_seed(seed)
    shapes = shapes + ([(5, 6)] if log2_scale == "top" else [])
    true = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    top = math.floor(math.log2(65504 / max(t.abs().max().item() for t in true)))
    scale = 2.0 ** (top if log2_scale == "top" else log2_scale)  # |true| < 10: times 2^12 stays in float16's range
    held = [(t * scale).to(dtype) for t in true]
    return held, [strided(t.clone(), how) for t in held], scale  # views of their own storage


def _out(fn, out, at):
    if not (isinstance(out, tuple) and len(out) == 3):
        raise AssertionError(f"{fn}: returned {describe(out)}, expected (total_norm, clip_coef, found_inf) at {at}")
    for what, got, kind in zip(("total_norm", "clip_coef", "found_inf"), out, (float, float, bool)):
        assert_type(fn, what, got, kind, at)
    return out


def check_unscale_and_clip___contract(m):
    fn = "unscale_and_clip_"

    def body(case):
        held, views, scale = _scaled(case)
        unscaled = [t.double() / scale for t in held]
        norm = torch.linalg.vector_norm(torch.cat([u.reshape(-1) for u in unscaled])).item()
        max_norm = case[5] * norm
        at = (f"{str(case[1])[6:]} gradients of shapes {[tuple(h.shape) for h in held]} as {case[3]} views "
              f"(non-contiguous), scale {scale:g}, "
              f"max_norm {max_norm:.3g} = {case[5]} x the norm")
        given = list(views)
        total, coef, found_inf = _out(fn, call(fn, m.unscale_and_clip_, given, scale, max_norm, at=at), at)
        if len(given) != len(views) or any(a is not b for a, b in zip(given, views)):
            raise AssertionError(f"{fn}: the list of gradients was changed (tensors replaced) at {at}")
        want_coef = min(1.0, max_norm / (norm + 1e-6))
        tol = DTYPE_TOL[case[1]]
        assert not found_inf, f"{fn}: found_inf is True for finite gradients at {at}"
        assert_value(fn, "total_norm", total, norm, tol=tol, ref="the float64 norm of the unscaled gradients", at=at)
        assert_value(fn, "clip_coef", coef, want_coef, tol=tol, ref="min(1, max_norm / (norm + eps))", at=at)
        for i, (v, h, u) in enumerate(zip(views, held, unscaled)):
            if torch.equal(v, h) and not torch.equal(u * want_coef, h.double()):
                raise AssertionError(f"{fn}: gradient {i} (a non-contiguous view) was not modified in place through "
                                     f"the tensor given (a copy was updated?) at {at}")
            assert_close(fn, f"gradient {i}", v, u * want_coef, tol=tol, ref="unscale_ then clip_grad_norm_", at=at)

    explore(CLIP, body, corners=((1, torch.float16, [(3, 4)], "slice", "top", 3.0),))  # a scaled norm past 65504


def check_unscale_and_clip___inf_or_nan(m):
    fn = "unscale_and_clip_"
    bad = st.lists(st.sampled_from([math.inf, -math.inf, math.nan]), min_size=1, max_size=3)

    def body(case):
        (held, views, scale), values = _scaled(case[0]), case[1]
        flat = [v.reshape(-1) for v in held]
        for j, b in enumerate(values):
            flat[j % len(flat)][(3 * j) % flat[j % len(flat)].numel()] = b
        views = [strided(t.clone(), case[0][3]) for t in held]
        want = torch.nn.utils.get_total_norm([t.double() / scale for t in held]).item()
        at = (f"{str(case[0][1])[6:]} gradients of shapes {[tuple(h.shape) for h in held]} holding {values}, "
              f"scale {scale:g}")
        total, coef, found_inf = _out(fn, call(fn, m.unscale_and_clip_, views, scale, 1.0, at=at), at)
        assert found_inf, f"{fn}: found_inf is False for gradients holding {values} at {at}"
        if math.isnan(want) != math.isnan(total) or (math.isinf(want) and total != want):
            raise AssertionError(f"{fn}: total_norm is {total}, clip_grad_norm_'s norm is {want} (inf and NaN told "
                                 f"apart) at {at}")
        assert coef == 1.0, f"{fn}: clip_coef is {coef!r}, expected 1.0 (nothing clipped on an overflow step) at {at}"
        for i, (v, h) in enumerate(zip(views, held)):
            fin = torch.isfinite(h)
            assert_close(fn, f"gradient {i} (its finite elements)", v[fin], h[fin].double() / scale,
                         tol=DTYPE_TOL[case[0][1]], ref="the unscaled, unclipped gradient", at=at)

    explore(st.tuples(CLIP, bad), body)


CHECKS = [check_DynamicLossScaler__contract, check_unscale_and_clip___contract, check_unscale_and_clip___inf_or_nan]
