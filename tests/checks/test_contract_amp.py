"""Mutant tests of the mixed-precision checks (``ex_amp``'s declarations, derived by ``checks.engine``): each
wrong solution breaks one documented property, and is otherwise right."""

import math

import pytest
import torch
from conftest import mutant

from bp_mech.checks import ex_amp
from bp_mech.update_dynamics import global_grad_norm

pytestmark = pytest.mark.amp
NAME = "ex_amp_backward"


def _answers():
    return mutant(NAME)


Base = _answers().DynamicLossScaler


class SharedState(Base):
    """The scale kept in one dict on the class: every instance sees the last update of any."""

    _shared: dict = {}  # noqa: RUF012  (shared on purpose: the mistake under test)
    scale = property(lambda s: s._shared["scale"], lambda s, v: s._shared.__setitem__("scale", v))


class TrackerAsFloat(Base):
    def update(self, found_inf):
        out = super().update(found_inf)
        self.growth_tracker = float(self.growth_tracker)
        return out


class AliasedStateDict(Base):
    """Keeps its state in the very dict that state_dict() hands out."""

    scale = property(lambda s: s._sd["scale"], lambda s, v: s._sd.__setitem__("scale", v))
    growth_tracker = property(lambda s: s._sd["_growth_tracker"],
                              lambda s, v: s._sd.__setitem__("_growth_tracker", v))

    def __init__(self, *args, **kwargs):
        self.__dict__["_sd"] = {}
        super().__init__(*args, **kwargs)

    def state_dict(self):
        self._sd.update({k: v for k, v in super().state_dict().items() if k not in ("scale", "_growth_tracker")})
        return self._sd


class WrongKeys(Base):
    def state_dict(self):
        s = super().state_dict()
        s["growth_tracker"] = s.pop("_growth_tracker")
        return s


class TensorScale(Base):
    def state_dict(self):
        return {**super().state_dict(), "scale": torch.tensor(self.scale)}


class RestoresScaleOnly(Base):
    def load_state_dict(self, state):
        self.scale = float(state["scale"])


class SwallowsMissingKey(Base):
    def load_state_dict(self, state):
        super().load_state_dict({**self.state_dict(), **state})


class PopsFromGivenDict(Base):
    def load_state_dict(self, state):
        super().load_state_dict(state)
        state.pop("_growth_tracker")


@pytest.mark.parametrize("cls, check, match", [
    (SharedState, ex_amp.check_DynamicLossScaler, r"while a second one backed off \(no state shared\)"),
    (TrackerAsFloat, ex_amp.check_DynamicLossScaler, r"\['growth_tracker'\] is a float, expected an int"),
    (AliasedStateDict, ex_amp.check_DynamicLossScaler__state_dict, r"edited \(return a new dict\)"),
    (WrongKeys, ex_amp.check_DynamicLossScaler__state_dict, r"\['state_dict\(\)'\] has \[.*\] entries"),
    (TensorScale, ex_amp.check_DynamicLossScaler__state_dict, r"\['scale'\] is a float32 tensor"),
    (RestoresScaleOnly, ex_amp.check_DynamicLossScaler__state_dict, "a fresh scaler after load_state_dict"),
    (SwallowsMissingKey, ex_amp.check_DynamicLossScaler__state_dict, "accepted it silently; expected KeyError"),
    (PopsFromGivenDict, ex_amp.check_DynamicLossScaler__state_dict, r"after it \(not modified\)"),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_scaler_contract_catches(cls, check, match):
    with pytest.raises(AssertionError, match="^DynamicLossScaler: .*" + match):
        check(mutant(NAME, DynamicLossScaler=cls))


unscale = _answers().unscale_and_clip_


def norm_as_tensor(grads, scale, max_norm, eps=1e-6):
    total, coef, found = unscale(grads, scale, max_norm, eps)
    return torch.tensor(total), coef, found


def found_as_tensor(grads, scale, max_norm, eps=1e-6):
    total, coef, found = unscale(grads, scale, max_norm, eps)
    return total, coef, torch.tensor(found)


def works_on_copies(grads, scale, max_norm, eps=1e-6):
    return unscale([g.contiguous() for g in grads], scale, max_norm, eps)


def contiguous_only(grads, scale, max_norm, eps=1e-6):
    """``g.view(-1)`` on every gradient: raises on a non-contiguous one."""
    for g in grads:
        g.view(-1)
    return unscale(grads, scale, max_norm, eps)


def nan_reported_as_inf(grads, scale, max_norm, eps=1e-6):
    total, coef, found = unscale(grads, scale, max_norm, eps)
    return (math.inf if found else total), coef, found


def replaces_tensors(grads, scale, max_norm, eps=1e-6):
    out = unscale(grads, scale, max_norm, eps)
    grads[:] = [g.clone() for g in grads]
    return out


def norm_in_fp16_before_unscale(grads, scale, max_norm, eps=1e-6):
    """The norm of the scaled 16-bit gradients, divided by S afterwards: inf once the scaled norm passes 65504."""
    total = global_grad_norm(grads).item() / scale
    out = unscale(grads, scale, max_norm, eps)
    return total, out[1], out[2]


@pytest.mark.parametrize("fn, check, match", [
    (norm_as_tensor, ex_amp.check_unscale_and_clip_, "total_norm is a .* tensor .*, expected a float"),
    (found_as_tensor, ex_amp.check_unscale_and_clip_, "found_inf is a bool tensor .*, expected a bool"),
    (works_on_copies, ex_amp.check_unscale_and_clip_, "the gradients after the call.* differs"),
    (contiguous_only, ex_amp.check_unscale_and_clip_, "raised RuntimeError"),
    (replaces_tensors, ex_amp.check_unscale_and_clip_, "the same tensors in the list is False"),
    (nan_reported_as_inf, ex_amp.check_unscale_and_clip___overflow, "total_norm is 'inf', .* gives 'nan'"),
    (norm_in_fp16_before_unscale, ex_amp.check_unscale_and_clip_, "total_norm is"),
], ids=["norm-tensor", "found-inf-tensor", "copies", "contiguous-only", "list-replaced", "nan-as-inf",
        "fp16-scaled-norm"])
def test_clip_contract_catches(fn, check, match):
    with pytest.raises(AssertionError, match="^unscale_and_clip_: .*" + match):
        check(mutant(NAME, unscale_and_clip_=fn))


report = _answers().cast_report


def subnormal_is_underflow(grads, dtype=torch.bfloat16):
    found, _, over = report(grads, dtype)
    tiny = torch.finfo(dtype).smallest_normal
    under = sum(int(((g != 0) & (g.abs() < tiny)).sum()) for g in grads)
    return found, under, over


def isinf_only(grads, dtype=torch.bfloat16):
    _, under, over = report(grads, dtype)
    return any(bool(torch.isinf(g.to(dtype)).any()) for g in grads), under, over


def counts_input_inf(grads, dtype=torch.bfloat16):
    found, under, _ = report(grads, dtype)
    return found, under, sum(int(torch.isinf(g.to(dtype)).sum()) for g in grads)


def counts_as_tensors(grads, dtype=torch.bfloat16):
    found, under, over = report(grads, dtype)
    return found, torch.tensor(under), torch.tensor(over)


def casts_in_place(grads, dtype=torch.bfloat16):
    out = report(grads, dtype)
    for g in grads:
        g.copy_(g.to(dtype))
    return out


def storage_order(grads, dtype=torch.bfloat16):
    """Reads each tensor in storage order (``as_strided`` with contiguous strides): wrong on a transpose."""
    return report([g.as_strided(g.shape, g.contiguous().stride()) for g in grads], dtype)


def always_bf16(grads, dtype=torch.bfloat16):
    return report(grads, torch.bfloat16)


@pytest.mark.parametrize("fn, check, match", [
    (subnormal_is_underflow, ex_amp.check_cast_report, "underflow is"),
    (isinf_only, ex_amp.check_cast_report, "found_inf is False"),
    (counts_input_inf, ex_amp.check_cast_report, "overflow is"),
    (counts_as_tensors, ex_amp.check_cast_report, "underflow is a int64 tensor"),
    (casts_in_place, ex_amp.check_cast_report, "grads.* was modified in place"),
    (always_bf16, ex_amp.check_cast_report, "float16"),
    (storage_order, ex_amp.check_cast_report, "(underflow|overflow|found_inf) is"),
], ids=["subnormal-underflow", "isinf-only", "input-inf-overflow", "tensor-counts", "in-place-cast", "dtype-ignored",
        "storage-order"])
def test_cast_report_checks_catch(fn, check, match):
    with pytest.raises(AssertionError, match="^cast_report: .*" + match):
        check(mutant(NAME, cast_report=fn))


def _growths(k, backoff, growth):
    return math.ceil(k * math.log2(1 / backoff) / math.log2(growth))


@pytest.mark.parametrize("fn, match", [
    (lambda k, n, b=0.5, g=2.0: k + _growths(k, b, g) * n, "the step is"),  # one late
    (lambda k, n, b=0.5, g=2.0: _growths(k, b, g) * n, "the step is"),  # forgets the overflow steps
    (lambda k, n, b=0.5, g=2.0: k - 1 + k * n, "the step is"),  # one growth per backoff, whatever the factors
    (lambda k, n, b=0.5, g=2.0: float(k - 1 + _growths(k, b, g) * n), "the step is a float, expected an int"),
], ids=["one-late", "no-overflow-steps", "factors-ignored", "float"])
def test_prediction_check_catches(fn, match):
    with pytest.raises(AssertionError, match="^predict_recovery_step: .*" + match):
        ex_amp.check_predict_recovery_step(mutant(NAME, predict_recovery_step=fn))


@pytest.mark.parametrize("check", ex_amp.CHECKS, ids=lambda c: c.__name__)
def test_checks_pass_on_the_answers(check):
    check(_answers())


class DefaultScale2To15(Base):  # GradScaler's default init_scale is 2^16
    def __init__(self, init_scale=2.0**15, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval)


def _clip_eps_1e8(grads, scale, max_norm, eps=1e-8):  # clip_grad_norm_'s eps is 1e-6
    return unscale(grads, scale, max_norm, eps)


def _report_fp16_default(grads, dtype=torch.float16):
    return report(grads, dtype)


def _report_grad_mode_off(grads, dtype=torch.bfloat16):  # no_grad left on: the caller's grad mode changed
    torch.set_grad_enabled(False)
    return report(grads, dtype)


def _predict_growth_4(overflows, growth_interval, backoff_factor=0.5, growth_factor=4.0):
    return _answers().predict_recovery_step(overflows, growth_interval, backoff_factor, growth_factor)


@pytest.mark.parametrize("over, check, match", [
    ({"DynamicLossScaler": DefaultScale2To15}, ex_amp.check_DynamicLossScaler, r"is 32768, .* at kw \{\}"),
    ({"unscale_and_clip_": _clip_eps_1e8}, ex_amp.check_unscale_and_clip_, r"eps left out \(default 1e-06\)"),
    ({"cast_report": _report_fp16_default}, ex_amp.check_cast_report, r"dtype left out \(default torch.bfloat16\)"),
    ({"cast_report": _report_grad_mode_off}, ex_amp.check_cast_report, "left the grad mode changed"),
    ({"predict_recovery_step": _predict_growth_4}, ex_amp.check_predict_recovery_step,
     r"growth_factor left out \(default 2.0\)"),
], ids=["scaler-init-default", "clip-eps-default", "cast-dtype-default", "cast-grad-mode", "predict-growth-default"])
def test_derived_checks_catch(over, check, match):
    function = check.__name__.removeprefix("check_").split("__")[0]
    with pytest.raises(AssertionError, match=f"^{function}: .*{match}"):
        check(mutant(NAME, **over))
