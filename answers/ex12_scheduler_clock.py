"""Answers for Part 02 · 12: the package's own implementation is the reference solution.

Read them in ``src/bp_mech/scheduler.py``; the chapter shows them in its collapsed
"answer" blocks. (The package's ``UpdateClock`` also accepts an optimizer whose learning
rate it keeps in step; the exercise does not need it.)
"""

from bp_mech.scheduler import UpdateClock, WSDConfig, wsd_lr  # noqa: F401
