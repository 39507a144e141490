"""The cached records of an experiment (``book/results``), validated, grouped by run label, stale ones marked.

Nothing invalid is shown silently: ``cached`` loads every record file of the experiment (each validated
against the schema), refuses mixed workloads or model commits within one run label, and marks the run
labels with a record whose ``code_hash`` no longer matches the source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bp_mech import RESULTS_DIR
from bp_mech.records import provenance, registry, results


@dataclass
class Cached:
    """The cached records of one experiment, grouped by run label."""

    semantic_id: str
    groups: dict[str, list[results.Record]]  # run_label -> records (mergeable)
    stale: set[str]  # run labels with at least one stale record

    def gpu(self) -> dict[str, list[results.Record]]:
        return {k: v for k, v in self.groups.items() if any(r.evidence_level == "gpu-measured" for r in v)}

    def note(self) -> str:
        """A visible sentence for the chapter: what is cached, or that nothing is."""
        gpu = self.gpu()
        if not gpu:
            return (f"No GPU record of {self.semantic_id} is cached in book/results yet; the numbers on this "
                    "page are the live CPU run (evidence level cpu-mechanism). Nothing is shown in their place.")
        parts = []
        for label, recs in gpu.items():
            r = recs[0]
            s = f"run label {label}: {r.device_name}, CUDA {r.cuda}, torch {r.torch}, workload {r.workload_id}"
            parts.append(s + (" — STALE: the code changed since this run" if label in self.stale else ""))
        return "Cached GPU records (gpu-measured): " + "; ".join(parts) + "."


def cached(semantic_id: str, results_dir: Path = RESULTS_DIR, check_stale: bool = True) -> Cached:
    """The records of ``semantic_id`` in ``results_dir``, grouped by run label (``Cached``); ``check_stale=False``:
    without hashing the code for the stale labels (``Cached.stale`` left empty), for a reader that needs none."""
    exp = registry.get(semantic_id)
    groups: dict[str, list] = {}
    for p, r in results.load_records(results_dir, semantic_id):
        groups.setdefault(r.run_label, []).append((p, r))
    stale = set()
    now = provenance.code_hash(exp.module) if groups and check_stale else None  # hashed once (provenance.is_stale)
    for label, items in groups.items():
        results.check_mergeable(items)
        if check_stale and any(r.code_hash != now for _, r in items):
            stale.add(label)
    return Cached(semantic_id, {k: [r for _, r in v] for k, v in groups.items()}, stale)
