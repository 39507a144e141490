"""Answers for the mixed-precision backward chapter: the package's own implementation.

Read them in ``src/bp_mech/amp.py``; the chapter shows them in its collapsed "answer" blocks.
"""

from bp_mech.amp import DynamicLossScaler, unscale_and_clip_  # noqa: F401
