"""Answers for Part 02 · 76: the package's own decision functions are the reference solution.

Read them in ``src/bp_mech/projects/pareto.py`` (``pareto_front``, ``choose_for_budget``);
the chapter shows them in its collapsed "answer" blocks.
"""

from bp_mech.projects.pareto import choose_for_budget, pareto_front  # noqa: F401
