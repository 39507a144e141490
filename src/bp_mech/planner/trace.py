"""How ``bp-mech plan`` traces its candidates: one strategy's step at a time (``traced``: its ledger, or a
``bench.oom.Failed`` with the one-line reason it could not be traced: the strategy's failure, not the plan's
end), in forked processes that inherit the fake session (``ledgers``, on ``planner.pool``), each extrapolated
in depth first where it can be (``planner.shallow.by_depth``), and an exception as one line (``one_line``)."""

from __future__ import annotations

from bp_mech.bench.oom import Failed
from bp_mech.planner.pool import forked_map


def one_line(e: BaseException, width: int = 160) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:width] if text else ''}".rstrip(": ")


def traced(sess, trace, task, deep=None):
    """One strategy's trace: its ledger, or why it has none.

    Args:
        sess: the fake session (``planner.lifecycle.Session``).
        trace: ``trace(sess, s, d)``, e.g. ``planner.shard.planning``'s rank ledger; None: ``sess.ledger``.
        task: a strategy, or (strategy, ``StepDefinition``).
        deep: ``by_depth``'s, tried first: the ledger extrapolated from shallow traces; None: full depth only.

    Returns:
        The ledger (or rank ledger), or a ``bench.oom.Failed`` whose ``failure`` is the one-line reason it could
        not be traced (an operation the fake trace cannot run: the strategy is left out of the plan).

    Example:
        >>> traced(None, lambda sess, s, d: 1 / 0, "plain")
        Failed(failure='ZeroDivisionError: division by zero', name='plain')
    """
    try:
        return stepped(sess, trace, task, deep)
    except Exception as e:  # noqa: BLE001 (any failure of that one trace; the plan goes on without it)
        s = task[0] if isinstance(task, tuple) else task
        return Failed(one_line(e), getattr(s, "name", str(s)))


def stepped(sess, trace, task, deep=None):
    """``traced``'s ledger (or rank ledger): ``deep``'s where the step extrapolates in depth, else the full-depth
    trace's; that trace's exception where it fails (a shallow step that fails is traced at full depth, which
    says why or succeeds)."""
    s, d = task if isinstance(task, tuple) else (task, None)
    try:
        if deep is not None and (led := deep(task)) is not None:
            return led
    except Exception:  # noqa: BLE001
        pass
    return trace(sess, s, d) if trace is not None else sess.ledger(s, d)


def ledgers(sess, strategies, workers: int = 1, trace=None, deep=None, ordered: bool = True):
    """The session's ledger of each strategy, in order (``traced``: a ``bench.oom.Failed`` where one fails).

    Args:
        sess: the fake session (``planner.lifecycle.Session``).
        strategies: strategies, or (strategy, ``StepDefinition``) pairs.
        workers: processes (``planner.pool.forked_map``: forked, they inherit the session and a sharded
            plan's fake process group, so nothing is rebuilt or pickled but the ledgers); 1: this process.
        trace, deep: ``traced``'s.
        ordered: False: ``(index, ledger)`` pairs as each trace is done (``planner.pool.forked_map``'s).

    Returns:
        A generator of the ledgers, in the order of ``strategies``; the longest traces (more forward
        passes and hooks: more operations) are handed out first.

    Example:
        >>> list(ledgers(None, ["plain"], trace=lambda sess, s, d: s.upper()))
        ['PLAIN']
    """
    def work(task):
        s = task[0] if isinstance(task, tuple) else task
        return s.micro_batches * (2 + (s.checkpoint != "plain") + s.offload)

    return forked_map(lambda task: traced(sess, trace, task, deep), strategies, workers, cost=work, ordered=ordered)
