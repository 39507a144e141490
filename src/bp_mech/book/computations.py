"""The computed records the pages and the tests read (``records.computed``): every fake-tensor trace a page
shows, the sweep of every model type and the calculator's tables, each computed by ``make records`` and read
back by name.

A page calls the helper that shows the value (``book.reconciliation.reconcile``, ``plan`` here); the value
comes from its record in ``book/results/computed/``, refused when stale. ``make records`` runs the pages
once with ``BP_MECH_COMPUTE=refresh`` (``tools/book_build.py --records``), which computes and saves each
record a page asks for, after ``python -m bp_mech.book.computations`` has computed those no page computes (the
sweep; the calculator's tables, which its page only reads).
"""

from __future__ import annotations

import os
import sys
import time

from bp_mech import RESULTS_DIR
from bp_mech.book.step_memory import fake_steps
from bp_mech.planner import plan as planner
from bp_mech.planner import calculator, sweep
from bp_mech.planner.pool import default_workers
from bp_mech.planner.reference_gap import Gap, reference_gap
from bp_mech.planner.definitions import StepLedger
from bp_mech.planner.reference_reading import DEFINITIONS
from bp_mech.records.computed import REFRESH_ENV, cached

SWEEP = "sweep"  # every causal LM of Transformers' mapping: tests/planner/test_sweep.py


def gpu_record_files() -> list:
    """The cached GPU records (``book/results``, all but the CPU runs'): a plan reads their measured ratios."""
    return sorted(p for p in RESULTS_DIR.glob("*.json") if "__cpu-" not in p.name)


def reference_gap_of(semantic_id: str) -> Gap:
    """``planner.reference_gap`` of one course reference under every definition, from its computed record."""
    return cached(f"reference-gap__{semantic_id}", reference_gap, semantic_id, list(DEFINITIONS),
                  workers=default_workers())


def fake_steps_of(workload: str, strategies, device: str = "cuda", timelines=()) -> dict[str, StepLedger]:
    """``book.step_memory.fake_steps``: each strategy's fake-tensor step of a full-size workload (its ledger, and
    the operator timeline of ``timelines``), from the computed record ``fake-steps__<workload>__<device>``."""
    return cached(f"fake-steps__{workload}__{device}", fake_steps, workload, list(strategies), device,
                  list(timelines))


def plan(name: str, *args, **kwargs) -> planner.Plan:
    """``planner.plan(*args, **kwargs)`` from the computed record ``plan__<name>`` (its arguments, the code
    and the cached GPU records key it), traced on all the CPUs this process may use when refreshed."""
    return cached(f"plan__{name}", planner.plan, *args, inputs=gpu_record_files(),
                  workers=default_workers(), **kwargs)


def calculator_record(model: str) -> calculator.Table:
    """``planner.calculator.table(model)``: every point the book's calculator offers for ``model``, traced as
    ``bp-mech plan`` traces it, from its computed record (computed here with ``BP_MECH_COMPUTE=refresh``)."""
    return cached(f"calculator__{model}", calculator.table, model)


def calculator_table(model: str) -> calculator.Table:
    """``calculator_record(model)`` read, never computed, even while ``make records`` runs the pages: ``main``
    computes it (the large models' traces take longer than a page's cell may run)."""
    refresh = os.environ.pop(REFRESH_ENV, None)
    try:
        return calculator_record(model)
    finally:
        if refresh is not None:
            os.environ[REFRESH_ENV] = refresh


def _refresh_calculator(model: str) -> tuple[str, int, float]:
    os.environ[REFRESH_ENV] = "refresh"
    t0 = time.process_time()
    return model, len(calculator_record(model).entries), time.process_time() - t0


def sweep_outcomes() -> dict[str, tuple[str, str]]:
    """``planner.sweep.sweep()``: every model type's outcome, from its computed record."""
    return cached(SWEEP, sweep.sweep, workers=default_workers())


def main() -> int:
    """``python -m bp_mech.book.computations``: compute and save the records no page computes (the sweep, the
    calculator's tables: one process per model, up to ``default_workers``, the largest first)."""
    import concurrent.futures
    import multiprocessing

    os.environ[REFRESH_ENV] = "refresh"
    t0 = time.perf_counter()
    outcomes = sweep_outcomes()
    print(f"{SWEEP}: {len(outcomes)} model types in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    models = sorted(calculator.SPACE, key=lambda m: m in calculator.WORKLOADS)  # the public (large) ones first
    with concurrent.futures.ProcessPoolExecutor(default_workers(), multiprocessing.get_context("spawn")) as pool:
        for model, n, cpu in pool.map(_refresh_calculator, models):
            print(f"calculator__{model}: {n} points in {cpu:.0f} CPU-s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
