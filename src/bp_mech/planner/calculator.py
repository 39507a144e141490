"""The book's memory calculator: ``bp-mech plan`` at a finite, stated set of points, stored, and read back.

The calculator page (book/appendix/memory-calculator.md) lets a reader pick a model, a mode, a number of GPUs
(FSDP2 beyond one), a sequence length, a batch and a budget, and shows each strategy's peak and what the plan
would pick, in the page, offline. Its numbers are not a model of the plan: they are the plan's own traces.
``table(model)`` runs the command's ``plan`` (``command``: the same call ``planner.report.run`` makes for
``request(point, budget)``) at every point of ``SPACE[model]`` and keeps, per point and strategy, what the
pick needs (``Row``); the page's record of it is computed by ``make records`` (``book.computations``).
``evaluate`` gives a point's rows and pick for a budget from the table, by the plan's own rule
(``plan.recommend``); the page's script ports that rule. Every offered point is traced, so every offered
answer is the command's to the byte (tests/planner/test_calculator.py compares at random points; the browser
test, tests/book/test_calculator_page.py, compares the page with ``evaluate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bp_mech.planner import plan as planner
from bp_mech.planner.definitions import StepDefinition
from bp_mech.planner.request import PlanRequest
from bp_mech.planner.shapes import public_config

# what the calculator offers; the page states it
WORKLOADS = ("tiny", "qwen05")  # the book's own models (``instruments.workload``; qwen05 is Qwen2.5-0.5B)
MODES = ("full", "bf16", "lora")  # float32 AdamW; bf16 weights (no master copy); bf16 weights + LoRA adapters
LORA_RANK = 16  # the LoRA adapters' rank (peft's default targets)
# (under bf16 weights the autocast ones do not apply: the plan skips them)
STRATEGIES = ("plain", "checkpoint-all", "fp16", "checkpoint-all+chunked-loss", "checkpoint-all+fp16+chunked-loss")


@dataclass(frozen=True)
class Space:
    """The points offered for one model: every mode, and these sequence lengths, GPU counts and batches."""

    label: str  # how the page names the model
    seqs: tuple[int, ...]
    gpus: tuple[int, ...]  # 1: one device; more: FSDP2 over that many (rank 0's bytes)
    batches: tuple[int, ...] = (1, 2, 4, 8)  # sequences per GPU


# Every point is one ``bp-mech plan`` (a trace per strategy, plus plain's in the other loop) at full size; a
# trace of the 7B takes seconds, of the 70B under FSDP2 tens of seconds on one core, so the large models
# offer few points: ``make records`` traces them all (book/appendix/memory-calculator.md states the set).
SPACE = {
    "tiny": Space("tiny (the book's CPU model)", (32, 128), (1, 2)),
    "qwen05": Space("Qwen2.5-0.5B", (512,), (1, 2, 4, 8), (1, 2, 4)),
    "qwen2.5-7b": Space("Qwen2.5-7B", (2048,), (1, 2, 4, 8), (1, 2)),
    "llama-3-8b": Space("Llama-3-8B", (2048,), (1, 2, 4, 8), (1, 2)),
    "llama-3-70b": Space("Llama-3-70B", (2048,), (4, 8), (1,)),
}


@dataclass(frozen=True)
class Point:
    """One offered point: model, mode, GPUs, sequence length, batch (per GPU)."""

    model: str
    mode: str
    gpus: int
    seq: int
    batch: int

    def __post_init__(self):
        space = SPACE.get(self.model)
        if space is None or self.mode not in MODES or self.gpus not in space.gpus or self.seq not in space.seqs \
                or self.batch not in space.batches:
            raise ValueError(f"{self} is not a point the calculator offers")


def points(model: str) -> list[Point]:
    """Every point offered for ``model``, in the table's order."""
    s = SPACE[model]
    return [Point(model, m, g, t, b) for m in MODES for g in s.gpus for t in s.seqs for b in s.batches]


def request(p: Point, budget: int, config: str | None = None) -> PlanRequest:
    """The ``bp-mech plan`` request of point ``p``: ``--workload`` for the book's models, ``--config`` (the path
    of a config.json of ``SHAPES[p.model]``) for the public ones; ``--strategies``, ``--dtype bf16``,
    ``--lora-rank``, ``--gpus --shard fsdp2`` as the point says."""
    src = dict(workload=f"{p.model}-b{p.batch}s{p.seq}") if p.model in WORKLOADS else dict(config=config or p.model)
    return PlanRequest.from_flags(budget=str(budget), batch=str(p.batch), seq=str(p.seq),
                                  dtype="bf16" if p.mode != "full" else None, strategies=",".join(STRATEGIES),
                                  lora_rank=LORA_RANK if p.mode == "lora" else None, gpus=p.gpus,
                                  shard="fsdp2" if p.gpus > 1 else None, workers=1, **src)


def config_of(model: str):
    """The Transformers config the command builds for ``model``."""
    from bp_mech.instruments.workload import qwen2_config

    return qwen2_config(model) if model in WORKLOADS else public_config(model)


def command(r: PlanRequest, config) -> planner.Plan:
    """The plan ``bp-mech plan`` computes for request ``r`` (``planner.report.run``'s call; no ``max`` sizes)."""
    definition = StepDefinition(keep_outputs=r.keep_outputs, weights=r.weights and r.weights.value)
    return planner.plan(config, r.batch, r.seq, r.budget, r.device_name, options=r.options,
                        workers=r.workers or 1, definition=definition, finetune=r.finetune, gpus=r.gpus,
                        shard=r.shard, candidates=r.candidates)


@dataclass(frozen=True)
class Row:
    """What the pick needs of one strategy at one point (a ``plan.PlanRow``'s fields)."""

    strategy: str
    peak: int  # bytes
    needs: int  # bytes: ``plan.needs(peak)``
    extra: float  # counted extra time, rounded as ``plan.recommend`` rounds it
    keeps_float32: bool
    mechanisms: int

    @property
    def cost(self) -> "Row":  # ``plan.recommend`` reads ``row.cost.extra``
        return self


@dataclass(frozen=True)
class Entry:
    """A traced point: its rows (the strategies that apply there)."""

    point: Point
    rows: list[Row]


@dataclass(frozen=True)
class Table:
    """Every offered point of one model, traced."""

    model: str
    label: str
    entries: list[Entry]


def rows_of(p: planner.Plan) -> list[Row]:
    """A plan's rows as the calculator keeps them."""
    return [Row(r.strategy, r.peak, r.needs, round(r.cost.extra, 3), r.keeps_float32, r.mechanisms) for r in p.rows]


def table(model: str, progress=None) -> Table:
    """``SPACE[model]``'s every point traced as ``bp-mech plan`` traces it (the budget does not change a row)."""
    config = config_of(model)
    entries = []
    for p in (progress or (lambda it: it))(points(model)):
        entries.append(Entry(p, rows_of(command(request(p, 2**50), config))))
    return Table(model, SPACE[model].label, entries)


@dataclass(frozen=True)
class Answer:
    """A point's rows, whether each fits the budget, and the pick."""

    rows: list[Row]
    fits: list[bool]
    pick: str | None


def evaluate(tables: dict[str, Table], p: Point, budget: int) -> Answer:
    """The calculator's answer at ``p`` for ``budget`` bytes, from the traced tables (``plan.recommend``'s rule)."""
    entry = next((e for e in tables[p.model].entries if e.point == p), None)
    if entry is None:
        raise KeyError(f"{p} is not in the table (stale record?)")
    return Answer(entry.rows, [r.needs <= budget for r in entry.rows], planner.recommend(entry.rows, budget))
