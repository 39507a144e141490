"""The planner's one pool of workers: tasks run in forked processes that inherit the parent's state.

A fake trace's state (a ``planner.lifecycle.Session``: a fake model, its optimizer, a sharded plan's fake
process group) is large and cannot be pickled, so nothing is sent to a worker but the task: ``forked_map``
forks the workers after pointing ``_WORK`` at the function, and each child finds the function, and
everything it closes over, already in its memory. Each worker runs ``quiet`` for its whole life (one
intra-op thread: fake tensors compute nothing, so more would only spin; Transformers' logging at errors
only; warnings ignored) and freezes the inherited objects out of the garbage collector's scans. With one
worker, one task or no ``fork`` (not Linux), the tasks run here, each under ``quiet``.

Users: ``planner.trace.ledgers`` (``bp-mech plan``'s strategies), ``planner.reference_gap`` (the step
definitions) and ``planner.sweep`` (every model type Transformers builds).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch

_WORK: Callable | None = None  # what the forked workers call (set only while ``forked_map``'s pool runs)
_QUIET = None  # in a worker: its ``quiet()``, entered


def default_workers() -> int:
    """The worker processes to use by default: the CPUs this process may use, at most 4.

    Returns:
        An int from 1 to 4.

    Example:
        >>> 1 <= default_workers() <= 4
        True
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


@contextlib.contextmanager
def quiet():
    """One intra-op thread, Transformers' logging at errors only and warnings ignored, restored on exit.

    Returns:
        A context manager.

    Example:
        >>> before = torch.get_num_threads()
        >>> with quiet():
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    from transformers.utils import logging

    threads, verbosity = torch.get_num_threads(), logging.get_verbosity()
    torch.set_num_threads(1)
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)


def _start_worker() -> None:
    global _QUIET
    _QUIET = quiet()  # held for the worker's whole life (a dropped one would be closed, and undone, at once)
    _QUIET.__enter__()
    gc.freeze()  # the inherited state (a fake model, its optimizer) is never garbage: do not scan it again
    gc.set_threshold(50_000, 20, 20)  # a trace makes many short-lived objects: collect young ones less often


def _call(indexed):
    i, task = indexed
    return i, _WORK(task)


def forked_map(fn: Callable, tasks: Iterable, workers: int = 1, cost: Callable | None = None,
               max_tasks_per_child: int | None = None, ordered: bool = True) -> Iterator:
    """``fn(task)`` of each task, in the order of ``tasks`` (or as each is done), from forked workers that
    inherit ``fn``.

    Args:
        fn: any callable (a closure or a lambda too: it is inherited, not pickled); the tasks and the
            results are pickled.
        tasks: the arguments of ``fn``, one per call.
        workers: processes to fork (at most one per task); 1, one task, or no ``fork``: the calling
            process, one task at a time under ``quiet``.
        cost: ``cost(task)``, a number: the costliest tasks are handed out first, so that no worker is
            left with a long one at the end (None: in order).
        max_tasks_per_child: tasks after which a worker is replaced by a fresh fork (None: never).
        ordered: False: ``(index of the task, its result)`` as each task is done instead (a progress bar then
            counts the tasks done, not those done in order).

    Returns:
        A generator of the results, in the order of ``tasks``, each as soon as it and those before it
        are done (``ordered=False``: the pairs, in the order the tasks are done).

    Example:
        >>> scale = 10  # state the workers inherit
        >>> list(forked_map(lambda x: x * scale, [1, 2, 3], workers=2, cost=lambda x: x))
        [10, 20, 30]
        >>> sorted(forked_map(lambda x: x * scale, [1, 2, 3], workers=2, ordered=False))
        [(0, 10), (1, 20), (2, 30)]
    """
    global _WORK
    tasks = list(tasks)
    if workers <= 1 or len(tasks) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        for i, task in enumerate(tasks):
            with quiet():
                result = fn(task)
            yield result if ordered else (i, result)
        return
    order = sorted(range(len(tasks)), key=lambda i: -cost(tasks[i])) if cost else list(range(len(tasks)))
    done, nxt, before = {}, 0, _WORK
    _WORK = fn
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks)), _start_worker,
                                                      maxtasksperchild=max_tasks_per_child) as pool:
            for i, result in pool.imap_unordered(_call, [(i, tasks[i]) for i in order]):
                if not ordered:
                    yield i, result
                    continue
                done[i] = result
                while nxt in done:
                    yield done.pop(nxt)
                    nxt += 1
    finally:
        _WORK = before
