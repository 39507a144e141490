"""How ``bp-mech plan`` traces its candidates: one strategy's step at a time (``traced``: its ledger, or a
``bench.oom.Failed`` with the one-line reason it could not be traced: the strategy's failure, not the plan's
end), in forked processes that inherit the fake session (``ledgers``), and an exception as one line
(``one_line``)."""

from __future__ import annotations

import torch

from bp_mech.bench.oom import Failed

def one_line(e: BaseException, width: int = 160) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:width] if text else ''}".rstrip(": ")


_SESSION = None  # (session, trace) a forked worker inherits (set only while ``ledgers``' pool runs)


def traced(sess, trace, task):
    """One strategy's trace: its ledger, or why it has none.

    Args:
        sess: the fake session (``planner.lifecycle.Session``).
        trace: ``trace(sess, s, d)``, e.g. ``planner.shard.planning``'s rank ledger; None: ``sess.ledger``.
        task: a strategy, or (strategy, ``StepDefinition``).

    Returns:
        The ledger (or rank ledger), or a ``bench.oom.Failed`` whose ``failure`` is the one-line reason it could
        not be traced (an operation the fake trace cannot run: the strategy is left out of the plan).

    Example:
        >>> traced(None, lambda sess, s, d: 1 / 0, "plain")
        Failed(failure='ZeroDivisionError: division by zero', name='plain')
    """
    s, d = task if isinstance(task, tuple) else (task, None)
    try:
        return trace(sess, s, d) if trace is not None else sess.ledger(s, d)
    except Exception as e:  # noqa: BLE001 (any failure of that one trace; the plan goes on without it)
        return Failed(one_line(e), getattr(s, "name", str(s)))


def _ledger_in_worker(task):
    return traced(*_SESSION, task)


def _quiet_worker():
    import gc

    torch.set_num_threads(1)
    gc.freeze()  # the inherited session (the fake model, its optimizer) is never garbage: do not scan it again
    gc.set_threshold(50_000, 20, 20)  # a trace makes many short-lived objects: collect young ones less often


def ledgers(sess, strategies, workers: int = 1, trace=None):
    """The session's ledger of each strategy, or (strategy, definition) (``traced``: a ``bench.oom.Failed`` where
    it fails), in order.
    ``workers`` > 1 (Linux): forked processes that inherit the fake session (and a sharded plan's fake
    process group: nothing is rebuilt or pickled but the ledgers), one strategy per task; ``trace``:
    ``traced``'s."""
    global _SESSION
    import multiprocessing

    if workers <= 1 or len(strategies) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (traced(sess, trace, s) for s in strategies)
        return
    # the longest first (more forward passes and hooks: more operations to trace), so that no worker is
    # left with a long one at the end; the ledgers come back in the order asked for
    def work(task):
        s = task[0] if isinstance(task, tuple) else task
        return s.micro_batches * (2 + (s.checkpoint != "plain") + s.offload)

    order = sorted(range(len(strategies)), key=lambda i: -work(strategies[i]))
    done, nxt = {}, 0
    _SESSION = sess, trace
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(strategies)), _quiet_worker) as pool:
            for i, led in zip(order, pool.imap(_ledger_in_worker, [strategies[i] for i in order])):
                done[i] = led
                while nxt in done:
                    yield done.pop(nxt)
                    nxt += 1
    finally:
        _SESSION = None


def default_workers() -> int:
    """Processes for ``ledgers``: the CPUs this process may use, at most 4."""
    import os

    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
