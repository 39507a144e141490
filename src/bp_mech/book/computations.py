"""The computed records the pages read (``records.computed``): every fake-tensor trace a page shows, named.

A page asks for a value by name (``value("reference-gap__TRAIN-CHECKPOINT")``, or through the helper that
shows it, such as ``book.reconciliation.reconcile``); the value comes from its record in
``book/results/computed/``, refused when stale. ``make records`` computes them all again
(``python -m bp_mech.book.computations``, which ``refresh`` runs); ``tests/records/test_computed.py`` fails
on a missing or stale one, so a clean clone's build never traces what a record already holds.
"""

from __future__ import annotations

import argparse
import sys
import time

from bp_mech.planner import sweep
from bp_mech.planner.reference_gap import CASES, DEFINITIONS, Gap, default_workers, reference_gap
from bp_mech.records.computed import COMPUTED_DIR, Computation, load, refresh

REFERENCE_GAP = "bp_mech.planner.reference_gap"
SWEEP = Computation("sweep", "bp_mech.planner.sweep", lambda: sweep.sweep(workers=default_workers()),
                    dict[str, tuple[str, str]])  # every causal LM of Transformers' mapping: tests/planner/test_sweep.py


def _gap(semantic_id: str) -> Computation:
    return Computation(f"reference-gap__{semantic_id}", REFERENCE_GAP,
                       lambda: reference_gap(semantic_id, list(DEFINITIONS)), Gap)


# name -> how it is computed; in the order ``make records`` computes them
COMPUTATIONS: dict[str, Computation] = {c.name: c for c in [*(_gap(sid) for sid in CASES), SWEEP]}


def value(name: str, directory=COMPUTED_DIR):
    """The value of the computed record ``name`` (``records.computed.load``: refused when stale).

    Raises:
        KeyError: no computation has that name.
        records.computed.StaleRecord: its record is missing or stale.
    """
    return load(COMPUTATIONS[name], directory)


def main(argv=None) -> int:
    """``python -m bp_mech.book.computations [NAME ...]``: compute and save the named records (all by default),
    each with its time; exit 0."""
    ap = argparse.ArgumentParser(prog="python -m bp_mech.book.computations", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"records to compute (default: all): {', '.join(COMPUTATIONS)}")
    names = ap.parse_args(argv).names or list(COMPUTATIONS)
    unknown = [n for n in names if n not in COMPUTATIONS]
    if unknown:
        print(f"unknown computed record {unknown[0]!r}; known: {', '.join(COMPUTATIONS)}", file=sys.stderr)
        return 2
    for n in names:
        t0 = time.perf_counter()
        refresh(COMPUTATIONS[n])
        print(f"{n}: computed in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
