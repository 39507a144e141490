"""Answers for Part 02 · 12: the package's own implementation is the reference answer.

Read them in ``src/bp_mech/scheduler.py``; the chapter shows them in its collapsed
"answer" blocks. (The package's ``UpdateClock`` also accepts an optimizer whose
learning rate it keeps in step; the exercise does not need it.) The variant and the
prediction are written here.
"""

import math

from bp_mech.scheduler import UpdateClock, WSDConfig, wsd_lr  # noqa: F401


def cosine_restarts_lr(update, base_lr, cycle, mult=1, min_lr=0.0):
    """SGDR: t updates into a cycle of length L, found with integers only."""
    if update < 0 or cycle < 1 or mult < 1:
        raise ValueError(f"bad update, cycle or mult: {update, cycle, mult}")
    t, length = update, cycle
    while t >= length:  # whole cycles before this update
        t -= length
        length *= mult
    cosine = (1 + math.cos(math.pi * t / length)) / 2
    return float(min_lr + (base_lr - min_lr) * cosine)


def predict_decay_entry(warmup, stable, overflows, growth_interval):
    """The skipped calls are the first ``overflows``, then one after every
    ``growth_interval`` applied updates. Update u = W + S is preceded by u // g full
    groups of g applied updates, each followed by a skip, and by the initial skips: it
    runs at call o + u + u // g. The naive clock reads the decay at call u; of the
    r = max(0, u - o) calls after the initial skips, every (g + 1)-th was skipped."""
    u, g = warmup + stable, growth_interval
    call = overflows + u + u // g  # u // g full groups before update u, each + 1 skip
    r = max(0, u - overflows)  # naive: the calls after the overflows, before call u
    naive_updates = (r // (g + 1)) * g + min(r % (g + 1), g)
    return call, naive_updates
