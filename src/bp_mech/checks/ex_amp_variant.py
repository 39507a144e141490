"""Declarations of the variant and the prediction of exercises/ex_amp_backward.py (``ex_amp`` lists them).

``cast_report`` against rounding thresholds computed in float64 from ``torch.finfo`` (half the smallest subnormal;
the largest value plus half a unit in its last place), independent of ``.to(dtype)``, on float32 gradients with
the edge values planted among them (also NaN, inf and -inf, and no gradients at all); ``predict_recovery_step``
against a real ``torch.amp.GradScaler("cpu")`` driven through the steps, with factors other than 2 (one growth
per backoff is then wrong), down to a backoff of 1/16 and a growth of 8.
"""

import math

import torch
from hypothesis import strategies as st

from bp_mech.checks.engine import Contract


class GradScalerReference:
    """A one-parameter SGD under torch's GradScaler; ``step(found_inf)`` -> (skipped, scale, tracker).

    Args:
        kw: ``torch.amp.GradScaler``'s keyword arguments.

    Example:
        >>> GradScalerReference(init_scale=4.0).step(True)
        (True, 2.0, 0)
    """

    def __init__(self, **kw) -> None:
        self.p = torch.zeros(1, requires_grad=True)
        self.opt = torch.optim.SGD([self.p], lr=1.0)
        self.scaler = torch.amp.GradScaler("cpu", **kw)

    def step(self, found_inf: bool):
        """One optimizer call whose gradient is inf (``found_inf``) or 1: (skipped, scale, growth tracker)."""
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(self.p.sum() * (math.inf if found_inf else 1.0)).backward()
        before = self.p.detach().clone()
        self.scaler.step(self.opt)
        self.scaler.update()
        state = self.scaler.state_dict()
        return torch.equal(before, self.p.detach()), state["scale"], state["_growth_tracker"]


# --- cast_report (variant) ----------------------------------------------------------------

def _limits(dtype):
    """(half the smallest subnormal, the smallest float32 magnitude that rounds to inf), from finfo in float64."""
    fi = torch.finfo(dtype)
    emax = math.floor(math.log2(fi.max))
    return fi.smallest_normal * fi.eps / 2, fi.max + fi.eps * 2.0**emax / 2


def _report64(grads, dtype=torch.bfloat16):
    tiny, huge = _limits(dtype)
    found, under, over = False, 0, 0
    for g in grads:
        x = g.double()
        fin = torch.isfinite(x)
        under += int((fin & (x != 0) & (x.abs() <= tiny)).sum())
        over += int((fin & (x.abs() >= huge)).sum())
        found = found or bool((~fin).any()) or bool((fin & (x.abs() >= huge)).any())
    return found, under, over


def _edges(dtype):
    tiny, huge = _limits(dtype)
    up = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(math.inf)).item()  # noqa: E731
    down = lambda x: torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item()  # noqa: E731
    return [tiny, up(tiny), down(tiny), 2 * tiny, huge, down(huge), -huge, torch.finfo(torch.float32).max,
            0.0, -0.0, math.inf, -math.inf, math.nan]


def _cast_case(c):
    """float32 gradients (the contract's dtype: its rounding is what is counted); ``edges`` or drawn ones with
    the edge values ``planted``."""
    dtype = c.get("dtype", torch.bfloat16)
    if "edges" in c:
        e = torch.tensor(_edges(dtype), dtype=torch.float32)
        grads = {"finite": [e[:-3]], "nan": [e[-1:], torch.ones(3)], "inf": [e[-3:-1]], "none": []}[c["edges"]]
        return {"grads": grads, "dtype": dtype}
    g = torch.Generator().manual_seed(c["seed"])
    grads = [(torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** c["log10"]).float() for s in c["shapes"]]
    edges = _edges(dtype)
    for j, k in enumerate(c["planted"]):
        flat = grads[j % len(grads)].view(-1)
        flat[(5 * j) % flat.numel()] = edges[k]
    return {"grads": grads, "dtype": dtype}


def _cast_note(c):
    if "edges" in c:
        return {"finite": "the finite edges of the dtype's range", "nan": "a NaN gradient",
                "inf": "inf and -inf gradients", "none": "no gradients"}[c["edges"]]
    return f"|g| ~ 1e{c['log10']}, planted {[_edges(c.get('dtype', torch.bfloat16))[k] for k in c['planted']]}"


CAST = Contract(
    "cast_report", _cast_case, _report64, ("found_inf", "underflow", "overflow"), defaults={"dtype": torch.bfloat16},
    ref_name="float64 rounding thresholds from torch.finfo", note=_cast_note,
    draw=st.fixed_dictionaries({"seed": st.integers(0, 2**16),
                                "dtype": st.sampled_from([torch.bfloat16, torch.float16]),
                                "shapes": st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=1,
                                                   max_size=3), "view": st.sampled_from(["slice", "transpose"]),
                                "log10": st.sampled_from([-45, -40, -8, -6, 0, 4, 38]),
                                "planted": st.lists(st.integers(0, 12), max_size=3)}),
    examples={"": [{"edges": e, "dtype": d} for d in (torch.bfloat16, torch.float16)
                   for e in ("finite", "nan", "inf", "none")]
              + [{"seed": 3, "dtype": torch.float16, "shapes": [(4, 5), (3, 1)], "view": "transpose", "log10": -6,
                  "planted": [0, 4, 12]}]})


# --- predict_recovery_step (predict, then measure) ---------------------------------------

def _measured_recovery(overflows, growth_interval, backoff_factor=0.5, growth_factor=2.0):
    ref = GradScalerReference(init_scale=2.0**16, growth_interval=growth_interval, backoff_factor=backoff_factor,
                              growth_factor=growth_factor)
    for step in range(10_000):
        _, scale, _ = ref.step(step < overflows)
        if step >= overflows - 1 and scale >= 2.0**16:
            return (step,)
    raise RuntimeError("no recovery")


PREDICT = Contract(
    "predict_recovery_step", lambda c: dict(zip(("overflows", "growth_interval", "backoff_factor", "growth_factor"),
                                                c["args"])),
    _measured_recovery, ("the step",), returns=int, defaults={"backoff_factor": 0.5, "growth_factor": 2.0},
    ref_name="a real torch.amp.GradScaler (the step after which it is back at S0)",
    draw=st.fixed_dictionaries({"args": st.tuples(st.integers(1, 5), st.integers(1, 4), st.sampled_from(
        [0.5, 0.25, 0.125]), st.sampled_from([2.0, 4.0, 8.0]))}),
    examples={"": [{"args": a} for a in ((1, 1, 0.5, 2.0), (3, 2, 0.5, 2.0), (2, 3, 0.25, 2.0), (3, 2, 0.5, 4.0),
                                         (5, 4, 0.25, 4.0), (4, 1, 0.5, 4.0),
                                         (3, 2, 0.5, 8.0), (3, 1, 0.0625, 8.0))]})
