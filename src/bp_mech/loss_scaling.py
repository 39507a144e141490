"""Part 02 · 12b — dynamic loss scaling: ``torch.amp.GradScaler``'s update rule in plain Python.

Mixed precision (``bp_mech.amp``) multiplies the FP16 loss by a scale S before ``backward()`` so
that small gradients survive, and divides the gradients by S before the update. S follows the
rule of Micikevicius et al. 2018 ("Mixed Precision Training"): on a step whose unscaled
gradients hold an inf/NaN the optimizer step is skipped and S *= 0.5; after ``growth_interval``
consecutive finite steps S *= 2 (if the result is finite). ``bp_mech.amp`` has the rest of
mixed precision (autocast, unscale before clip).
"""

from __future__ import annotations

import math

import torch


class DynamicLossScaler:
    """``torch.amp.GradScaler``'s update rule (``_amp_update_scale_``) in plain Python.

    Same constructor arguments as GradScaler. State: ``scale`` (S, the loss is
    multiplied by it before backward) and ``growth_tracker`` (finite steps since the
    last overflow or growth). GradScaler keeps S in a float32 tensor, so every new S is
    rounded to float32 and a growth is refused when the float32 result is inf: with
    growth factor 2, S stops at 2^127 (2^128 is finite as a Python float, but not in
    float32).

    Args:
        init_scale: the first S (rounded to float32).
        growth_factor: S *= growth_factor after ``growth_interval`` consecutive finite
            steps.
        backoff_factor: S *= backoff_factor on a step with inf/NaN gradients.
        growth_interval: consecutive finite steps before S grows.

    Example:
        >>> s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
        >>> # halve, then grow
        >>> [s.update(found_inf) for found_inf in (True, False, False)], s.scale
        ([True, False, False], 8.0)
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = self.float32(init_scale)
        self.growth_factor = growth_factor  # S *= it after growth_interval finite steps
        self.backoff_factor = backoff_factor  # S *= it on a step with inf/NaN gradients
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    @staticmethod
    def float32(x: float) -> float:
        """``x`` rounded to float32 (inf past its largest value, about 3.4e38), as a
        Python float.

        Args:
            x: a Python float.

        Returns:
            The float32 value nearest ``x`` (or inf), as a Python float.

        Example:
            >>> f32 = DynamicLossScaler.float32
            >>> f32(2.0**127) == 2.0**127, f32(2.0**128)
            (True, inf)
        """
        return torch.tensor(x, dtype=torch.float64).float().item()

    def update(self, found_inf: bool) -> bool:
        """Advance one step: back off on inf/NaN, else count the finite step and grow
        every ``growth_interval``.

        Args:
            found_inf: whether any unscaled gradient of this step is inf/NaN.

        Returns:
            True when the step must apply no update (exactly when ``found_inf``).

        Example:
            >>> s = DynamicLossScaler(init_scale=2.0**16)
            >>> s.update(True), s.scale, s.update(False), s.growth_tracker
            (True, 32768.0, False, 1)
        """
        if found_inf:
            self.scale = self.float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            # in float32, as GradScaler's kernel
            grown = self.float32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        return False
