"""Answers for Part 02 · 43: the package's own ledger formulas are the reference solution.

Read them in ``src/bp_mech/ledger.py`` (``param_bytes``, ``grad_bytes``, ``adam_state_bytes``,
``block_saved_bytes``); the chapter shows them in its collapsed "answer" blocks.
"""

from bp_mech.ledger import adam_state_bytes, block_saved_bytes, grad_bytes, param_bytes  # noqa: F401
