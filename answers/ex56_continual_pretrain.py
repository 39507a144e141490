"""Answers for Part 02 · 56: the package's implementation (``src/bp_mech/continual_pretrain.py`` and
``src/bp_mech/training_state.py``)."""

from bp_mech.continual_pretrain import token_loss  # noqa: F401
from bp_mech.training_state import capture_state, restore_state  # noqa: F401
