"""What chapters call to show records: tables, cached GPU records, evidence labels, formatting.

A chapter never shows an invalid record silently: it reads the cached records through
``bp_mech.records.cache.cached`` (every file validated, mixed workloads or model commits within one run
label refused, stale records marked) and shows them with this module's tables and boxes; bytes are
formatted by ``bp_mech.instruments.peak.fmt_bytes``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from bp_mech.instruments.peak import fmt_bytes
from bp_mech.records import provenance, references, registry, results


def fmt(v, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    """Markdown table lines; a "|" inside a cell is escaped, so that it cannot split the cell. A column that
    is "–" in every one of several rows (a failure column where nothing failed) says nothing: it is left out."""
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    if len(rows) > 1:
        columns = [c for c in columns if any(str(row.get(c, "–")) != "–" for row in rows)] or columns
    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c, "–")) for c in columns) + " |" for row in rows]


def markdown_table(rows: list[dict], columns: list[str] | None = None):
    """A list of dicts as an IPython Markdown table (renders in the book)."""
    from IPython.display import Markdown

    return Markdown("\n".join(_table(rows, columns or list(rows[0]))))


# Columns that say where a row's numbers come from rather than what they are: ``folded_table`` folds them.
DETAIL_COLUMNS = ("evidence", "evidence level", "run label", "memory source", "source")


def folded_markdown(rows: list[dict], columns: list[str] | None = None, detail=DETAIL_COLUMNS,
                    key: str | None = None, summary: str | None = None) -> str:
    """The Markdown of ``folded_table`` (see there)."""
    columns = columns or list(dict.fromkeys(c for row in rows for c in row))
    folded = [c for c in columns if c in detail]
    shown = [c for c in columns if c not in folded]
    if not folded or not shown:
        return "\n".join(_table(rows, columns))
    key = key or shown[0]
    head = html.escape(summary or f"{', '.join(folded)} of these rows".capitalize())
    values = {c: list(dict.fromkeys(str(row.get(c, "–")) for row in rows)) for c in folded}
    if all(len(v) == 1 for v in values.values()):  # every row the same: one sentence
        body = ["Every row: " + ", ".join(f"{c} `{v[0]}`" for c, v in values.items()) + "."]
    else:
        body = _table(rows, [key, *folded])
    return "\n".join([*_table(rows, shown), "", f'<details class="bp-detail">\n<summary>{head}</summary>', "",
                      *body, "", "</details>"])


def folded_table(rows: list[dict], columns: list[str] | None = None, detail=DETAIL_COLUMNS,
                 key: str | None = None, summary: str | None = None):
    """A list of dicts as an IPython Markdown table whose provenance columns (``detail``: evidence level,
    run label, ...) are folded beneath it in an HTML ``<details>`` (closed; one click opens it): one
    sentence when every row has the same values, else a table of them named by ``key`` (default: the first
    shown column). ``columns``: all the columns to show, in order (default: every key of the rows);
    ``summary``: the fold's title (default: the folded columns' names). Without a detail column it is
    ``markdown_table``'s table."""
    from IPython.display import Markdown

    return Markdown(folded_markdown(rows, columns, detail, key, summary))


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


# --- provenance of cached records -----------------------------------------------------------


@dataclass(frozen=True)
class ProvenanceBox:
    """Where a cached record's numbers came from; renders as an HTML box (the book), MyST (Markdown
    outputs) or plain text (``repr``)."""

    title: str  # e.g. "Provenance: TRAIN-CHECKPOINT, run label gpu-default"
    rows: tuple[tuple[str, str], ...]  # (what, value) in display order
    stale: bool | None  # True: some record's code_hash differs from the source's; None: cannot tell

    def _repr_html_(self) -> str:
        kind = "warning" if self.stale is not False else "note"
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in self.rows)
        return (f'<div class="admonition {kind} bp-provenance"><p class="admonition-title">{html.escape(self.title)}'
                f'</p><table class="bp-provenance-table"><tbody>{body}</tbody></table></div>')

    def _repr_markdown_(self) -> str:
        lines = "\n".join(f"- **{k}**: {v}" for k, v in self.rows)
        return f":::{{admonition}} {self.title}\n:class: {'warning' if self.stale is not False else 'note'}\n{lines}\n:::"

    def __repr__(self) -> str:
        return "\n".join([self.title, *(f"  {k}: {v}" for k, v in self.rows)])


def _stale(recs: list[results.Record]) -> tuple[bool | None, str]:
    """(stale?, the sentence): every record's code_hash against the current source of its experiment."""
    exp = registry.get(recs[0].semantic_id)
    now = provenance.code_hash(exp.module)
    old = [r for r in recs if r.code_hash != now]
    hashes = ", ".join(sorted({str(r.code_hash) for r in recs}))
    if not old:
        return False, f"current: code_hash {hashes} matches this source"
    which = ", ".join(r.candidate for r in old)
    return True, (f"STALE: the code changed since this run (record code_hash {hashes}, this source {now}; "
                  f"stale: {which}); rerun it to refresh the numbers")


def _model(r: results.Record) -> str:
    commit = (r.model_commit or "–")[:12]
    if r.model_source == "pretrained":
        return f"{r.model_id}, pretrained weights at commit {commit}"
    if r.model_source == "config":
        return (f"{r.model_id or 'the architecture'}, random init from the config (config hash {commit}): "
                "memory and time are the architecture's; loss values are not the trained model's")
    return f"{r.model_id or '–'} (source {r.model_source or 'not recorded'})"


def provenance_box(record) -> ProvenanceBox:
    """The box a chapter shows beside a cached (GPU) record, or beside the records of one run label
    (a list of mergeable records): device, workload and model source, date, evidence level, whether
    the code hash is current or stale (``provenance.is_stale``'s comparison) and the course's reference
    run's figures for the experiment where there are some (``references.REFERENCES``), in a row "reference"."""
    recs = list(record) if isinstance(record, (list, tuple)) else [record]
    r = recs[0]
    device = ", ".join(x for x in (r.device_name, r.device_memory and fmt_bytes(r.device_memory),
                                   r.cuda and f"CUDA {r.cuda}", r.torch and f"torch {r.torch}",
                                   r.transformers and f"transformers {r.transformers}") if x) or "not recorded"
    dates = sorted({(x.created_at or "not recorded") for x in recs})
    stale, code = _stale(recs)
    commits = sorted({x.git_commit[:12] for x in recs if x.git_commit})
    evidence = ", ".join(sorted({x.evidence_level for x in recs}))
    memory = ", ".join(sorted({x.memory_source for x in recs if x.memory_source}))
    rows = [("device", device),
            ("workload", f"{r.workload_id}, input {r.input_shape}, {r.dtype}, seed {r.seed}"),
            ("model", _model(r)),
            ("date", dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"),
            ("evidence", evidence + (f" (memory: {memory})" if memory else "")),
            ("code", code + (f"; git commit {', '.join(commits)}" if commits else "")
             + (f"; bp-mech {r.bp_mech_version}" if r.bp_mech_version else ""))]
    if ref := references.for_experiment(r.semantic_id):
        rows.append(("reference", ref.summary() + " — not this book's measurement"))
    title = (f"Provenance: {r.semantic_id}, run label {r.run_label}"
             + (f", candidate {r.candidate}" if len(recs) == 1 else f", {len(recs)} candidates")
             + (" — STALE" if stale else ""))
    return ProvenanceBox(title, tuple(rows), stale)

