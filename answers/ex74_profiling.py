"""Answers for Part 02 · 74: the package's own functions are the reference solution.

Read them in ``src/bp_mech/projects/diagnosis.py`` (``predicted_saving``, ``chunked_loss_changes``)
and ``src/bp_mech/projects/step_profile.py`` (``live_by_category``); the chapter shows them in its
collapsed "answer" blocks. The variant (``self_time_by_name``) and the prediction
(``predict_logits_line_saving``) are written here.
"""

from bp_mech.projects.diagnosis import chunked_loss_changes, predicted_saving  # noqa: F401
from bp_mech.projects.step_profile import live_by_category  # noqa: F401


def self_time_by_name(intervals) -> dict:
    """Self time per name: each interval's duration minus its direct children's,
    children found with one stack per thread over the intervals sorted by start
    (the longer first when two start together)."""
    out = {name: 0.0 for name, _, _, _ in intervals}
    by_thread = {}
    for iv in intervals:
        by_thread.setdefault(iv[1], []).append(iv)
    for ivs in by_thread.values():
        stack = []  # [name, end, self time so far] of the open intervals
        for name, _, start, end in sorted(ivs, key=lambda iv: (iv[2], -iv[3])):
            while stack and (start >= stack[-1][1] or end > stack[-1][1]):
                done = stack.pop()
                out[done[0]] += done[2]
            if stack:
                stack[-1][2] -= end - start  # a direct child: not the parent's own time
            stack.append([name, end, float(end - start)])
        for name, _, own in stack:
            out[name] += own
    return out


def predict_logits_line_saving(tokens: int, vocab: int, hidden: int,
                               chunk: int) -> int:
    """Step by step: the plain line at the log-softmax backward holds the saved output
    (4 n V) and the two (n, V) buffers of its backward (8 n V). The chunked loss's line
    there holds its per-token bytes (12 n), dh (4 n C) and the larger of k chunks'
    logits and one chunk's dz with its product (max(k 4 c V, 4 c V + 4 V C)), with
    c = min(chunk, n) and k = 2 when there is more than one chunk. Saving: the
    difference."""
    n, V, C = tokens, vocab, hidden
    c = min(chunk, n)
    k = 2 if n > c else 1
    plain = 4 * n * V + 8 * n * V
    chunked = 12 * n + 4 * n * C + max(k * 4 * c * V, 4 * c * V + 4 * V * C)
    return plain - chunked
