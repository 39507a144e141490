"""What chapters call to show records: tables, cached GPU records, evidence labels.

A chapter never shows an invalid record silently: ``cached`` validates every file of the
experiment in ``book/results``, refuses mixed workloads or model commits within one run
label, and marks stale records (their ``code_hash`` no longer matches the source).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bp_mech import provenance, registry, results

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "book" / "results"


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


def cached(semantic_id: str, results_dir: Path = RESULTS_DIR) -> Cached:
    exp = registry.get(semantic_id)
    groups: dict[str, list] = {}
    for p, r in results.load_records(results_dir, semantic_id):
        groups.setdefault(r.run_label, []).append((p, r))
    stale = set()
    for label, items in groups.items():
        results.check_mergeable(items)
        if any(provenance.is_stale(r, exp.module) for _, r in items):
            stale.add(label)
    return Cached(semantic_id, {k: [r for _, r in v] for k, v in groups.items()}, stale)


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "–"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def fmt(v, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def markdown_table(rows: list[dict], columns: list[str] | None = None):
    """A list of dicts as an IPython Markdown table (renders in the book)."""
    from IPython.display import Markdown

    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "–")) for c in columns) + " |")
    return Markdown("\n".join(lines))


def record_rows(recs: list[results.Record], fields: list[str]) -> list[dict]:
    """Rows for ``markdown_table``: candidate, the chosen fields, and the evidence level."""
    out = []
    for r in recs:
        row = {"candidate": r.candidate}
        for f in fields:
            v = getattr(r, f)
            row[f] = fmt_bytes(v) if f.startswith("peak") else fmt(v)
        row["evidence"] = r.evidence_level
        out.append(row)
    return out


def decision_text(r: results.Record, baseline: str) -> str:
    """A record's decision for a table or a sentence, or why there is none: the baseline decides
    nothing, a time ratio that is noise decides nothing (and says why), a failure says what to do."""
    if r.decision:
        return r.decision
    if r.timing_noise:
        return f"none: the time ratio is noise ({r.timing_noise})"
    if r.candidate == baseline:
        return "baseline"
    return f"none: {r.next_step}" if r.next_step else "none"
