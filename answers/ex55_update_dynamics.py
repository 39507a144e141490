"""Answers for Part 02 · 55: the package's implementation (``src/bp_mech/update_dynamics.py``)."""

from bp_mech.update_dynamics import (  # noqa: F401
    clip_by_global_norm_,
    clip_coefficient,
    global_grad_norm,
    update_ratio,
)
