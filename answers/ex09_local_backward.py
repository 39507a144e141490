"""Answers for Part 02 · 09: the package's own implementation is the reference solution.

Read them in ``src/bp_mech/local_backward.py`` (each backward sits beside its forward);
the chapter shows them in its collapsed "answer" blocks.
"""

from bp_mech.local_backward import (  # noqa: F401
    cross_entropy_backward,
    linear_backward,
    rmsnorm_backward,
    silu_backward,
    swiglu_mlp_backward,
)
