"""Answers for Part 02 · 74: the package's own functions are the reference solution.

Read them in ``src/bp_mech/projects/diagnosis.py`` (``predicted_saving``, ``chunked_loss_changes``)
and ``src/bp_mech/projects/step_profile.py`` (``live_by_category``); the chapter shows them in its
collapsed "answer" blocks.
"""

from bp_mech.projects.diagnosis import chunked_loss_changes, predicted_saving  # noqa: F401
from bp_mech.projects.step_profile import live_by_category  # noqa: F401
