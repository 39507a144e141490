"""Answers for project 73: the package's implementation (``src/bp_mech/projects/baseline_loss.py``).

``per_rank_divisor`` there is the chapter's wrong variant (a per-rank token mean)."""

from bp_mech.projects.baseline_loss import loss_divisor, shard_rows  # noqa: F401
