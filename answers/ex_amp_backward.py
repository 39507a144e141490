"""Answers for the mixed-precision backward chapter.

``unscale_and_clip_`` and the scaler's update rule are the package's own implementation
(``src/bp_mech/amp.py``, ``src/bp_mech/loss_scaling.py``); the scaler's ``state_dict``,
the variant ``cast_report`` and the prediction are written here. The chapter shows them
in its folded answers.
"""

import torch

from bp_mech.amp import unscale_and_clip_  # noqa: F401
from bp_mech.loss_scaling import DynamicLossScaler as _Rule

_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
         "_growth_tracker")


class DynamicLossScaler(_Rule):
    """The package's update rule, plus GradScaler's state_dict / load_state_dict."""

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "growth_factor": float(self.growth_factor),
                "backoff_factor": float(self.backoff_factor),
                "growth_interval": int(self.growth_interval),
                "_growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        values = [state[k] for k in _KEYS]  # KeyError before anything changes
        self.scale, self.growth_factor, self.backoff_factor = map(float, values[:3])
        self.growth_interval, self.growth_tracker = int(values[3]), int(values[4])


def cast_report(grads, dtype=torch.bfloat16):
    found_inf, underflow, overflow = False, 0, 0
    for g in grads:
        g = g.detach()
        low = g.to(dtype)  # a new tensor: the input is left as it was
        finite = torch.isfinite(g)
        underflow += int(((low == 0) & (g != 0) & finite).sum())
        overflow += int((torch.isinf(low) & finite).sum())
        found_inf = found_inf or not bool(torch.isfinite(low).all())
    return found_inf, underflow, overflow


def predict_recovery_step(overflows, growth_interval, backoff_factor=0.5,
                          growth_factor=2.0):
    """Each of the k overflows multiplies the scale by the backoff factor: after step
    k - 1 it is S0 * backoff**k. Each growth multiplies it by the growth factor, so m
    growths undo them once growth**m * backoff**k >= 1. A growth needs N finite steps
    in a row, and the first finite step is step k: the m-th growth lands on step
    k - 1 + m N."""
    level, growths = backoff_factor**overflows, 0  # S / S0 after the overflows
    while level < 1.0:  # exact: powers of two
        level, growths = level * growth_factor, growths + 1
    return overflows - 1 + growths * growth_interval
