"""The calculator page's form and table (book/appendix/memory-calculator.md): the traced points of
``planner.calculator`` embedded in the page as JSON, read by plain JavaScript (``calculator.js`` beside this
module) that shows each strategy's peak and the plan's pick for the reader's point and budget, offline.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from bp_mech.planner import calculator
from bp_mech.planner.plan import ALLOCATOR_SLACK, CONTEXT_BYTES

SCRIPT = Path(__file__).with_name("calculator.js")
MODE_LABELS = {"full": "full training, float32 AdamW", "bf16": "bf16 weights, AdamW (no float32 master)",
               "lora": f"LoRA rank {calculator.LORA_RANK} on bf16 weights"}
COLUMNS = ("strategy", "peak", "peak (bytes)", "needs", "fits", "+time")  # peak, needs: in the script's unit
EXACT = 2**53  # integers up to this are exact in a JavaScript number
# the point the page opens at: a public model over several GPUs, where the strategies' peaks differ and the budget
# decides between them (the first point, a tiny model whose strategies all peak alike, said nothing)
START = calculator.Point("qwen2.5-7b", "full", 4, 2048, 2)


def key(p: calculator.Point) -> str:
    """A point's key in the page's data: ``model|mode|gpus|seq|batch``.

    Example:
        >>> key(calculator.Point("tiny", "full", 1, 32, 2))
        'tiny|full|1|32|2'
    """
    return "|".join(str(v) for v in dataclasses.astuple(p))


def page_data(tables: dict[str, calculator.Table]) -> dict:
    """What the page's script reads: the offered set, the point it opens at (``START``) and, per point key, the
    rows as lists ``[strategy, peak, needs, extra, keeps_float32, mechanisms]``; a ``ValueError`` for bytes that a
    JavaScript number would not hold exactly."""
    points = {}
    for t in tables.values():
        for e in t.entries:
            if any(max(r.peak, r.needs) >= EXACT for r in e.rows):
                raise ValueError(f"{e.point}: bytes beyond 2**53 are not exact in JavaScript")
            points[key(e.point)] = [[r.strategy, r.peak, r.needs, r.extra, r.keeps_float32, r.mechanisms]
                                    for r in e.rows]
    models = {m: dict(label=t.label, seqs=list(calculator.SPACE[m].seqs), gpus=list(calculator.SPACE[m].gpus),
                      batches=list(calculator.SPACE[m].batches)) for m, t in tables.items()}
    start = key(START) if key(START) in points else next(iter(points), None)  # (a table without it: its first)
    return dict(models=models, modes=[dict(name=m, label=MODE_LABELS[m]) for m in calculator.MODES], start=start,
                workloads=list(calculator.WORKLOADS), strategies=list(calculator.STRATEGIES),
                loraRank=calculator.LORA_RANK,
                points=points, headroom=dict(slack=ALLOCATOR_SLACK, context=CONTEXT_BYTES))


def _select(name: str, label: str) -> str:
    return f'<label>{html.escape(label)} <select name="{name}"></select></label>'


def form_html(tables: dict[str, calculator.Table], budget_gib: int = 80) -> str:
    """The page's calculator: the form, the table, the data and the script, as one block of HTML."""
    data = json.dumps(page_data(tables), separators=(",", ":")).replace("</", "<\\/")
    head = "".join(f'<th data-unit="{c}">{c}</th>' if c in ("peak", "needs") else f"<th>{html.escape(c)}</th>"
                   for c in COLUMNS)
    fields = "\n".join([_select("model", "model"), _select("mode", "mode"), _select("gpus", "GPUs"),
                        _select("seq", "sequence"), _select("batch", "batch per GPU"),
                        f'<label>budget (GiB per GPU) <input name="budget" type="number" min="1" step="1" '
                        f'value="{int(budget_gib)}" style="width:6em"></label>'])
    return f"""<div id="bp-calc" class="bp-calc">
<form id="bp-calc-form" style="display:flex;flex-wrap:wrap;gap:0.5em 1.5em">
{fields}
</form>
<p id="bp-calc-pick" style="font-weight:bold;margin-top:0.8em"></p>
<div style="overflow-x:auto">
<table id="bp-calc-table" class="table"><thead><tr>{head}</tr></thead><tbody></tbody></table>
</div>
<p id="bp-calc-absent"></p>
<pre id="bp-calc-cmd" style="overflow-x:auto"></pre>
<script type="application/json" id="bp-calc-data">{data}</script>
<script>{SCRIPT.read_text(encoding="utf-8")}</script>
</div>"""
