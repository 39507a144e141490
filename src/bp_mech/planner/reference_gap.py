"""The course's reference figures against the book's ledger: which step definition reproduces them?

The course's reference run (RTX 5070 Ti, Qwen2.5-0.5B; ``bp_mech.records.references``) reports peak
savings that the book's ledger, at the same workload, does not predict for its own step (the
steady-state full step, ``planner.definitions.STEADY``). Before calling the two comparable, this module
asks which *definition* of the step would have given the reference's figure: for one reference it
traces, with fake tensors at the reference workload and CUDA's settings (``StepOptions.for_device(
"cuda")``: fused AdamW, CUDA's offload threshold, CUDA's autocast op lists), the plain step and the
reference's strategy under every definition of ``DEFINITIONS`` (the single ones, (a) to (g) of
``planner.definitions``, and the pairs that can hold together), and for each the saving of the absolute
peak and of the peak's increment above what was resident at the start ((f)). The half-precision
definition stands in, for the mixed-precision reference, for its fp16 arm itself (a model cast to
fp16 against the fp32 one), and makes both arms half-precision for the others.

Tolerance: two terms, each derived, their sum a case's ``Gap.tolerance_pp``; the tracer's is ``planner.tracer_term``'s.

The allocator's term (``ALLOCATOR_PP``, percentage points of saving). The fake step reproduces the live
bytes of the program exactly (``tests/planner/test_plan.py``: to the GradScaler's 8 bytes against the
tracked CPU step), so what separates a predicted saving from one an allocator reports for the same program
is what the allocator adds to the live bytes: (1) every block rounded up to 512 B, which ``GapRow.
rounding_pp`` computes per row from the ledger's rounded stages (below 0.01 pp at these shapes); (2)
the caching allocator's blocks: ``max_memory_allocated`` counts whole blocks, and a cached block is
handed out unsplit when less than 1 MiB would remain, so a live block may count up to 1 MiB more than
its tensor. A steady-state step asks for the sizes the step before it freed, so such remainders are
rare; allowing them up to 0.5 % of each peak moves a saving s by at most 2 x 0.5 % x (1 - s) < 1 pp.

Not covered: the temporaries of CUDA's own kernels (SDPA, cross-entropy, embedding backward), which a
CPU trace does not see; a reference outside the tolerance under every definition points there, or to
a workload or program other than the one the reference names.

The accumulation reference ("up to 17.3 %", 2 and 4 micro-batches at sequence 256) is traced at batch
4 (the smallest that 4 micro-batches divide), its saving the best of ``micro2`` and ``micro4``: the
reference names only the micro-batch counts and the sequence length, so that batch is this book's
assumption (``ASSUMED_BATCH``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.planner import lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition, StepLedger
from bp_mech.planner.pool import default_workers, forked_map
from bp_mech.planner.reference_reading import ALLOCATOR_PP, DEFINITIONS, GapRow, Verdict, verdict
from bp_mech.planner.tracer_term import TracerTerm, memtracker_can_trace, memtracker_peak
from bp_mech.records.references import REFERENCES

@dataclass(frozen=True)
class Case:
    """Where a reference is traced: its workload and the strategies of its candidate arm."""

    semantic_id: str  # the experiment (``records.references.REFERENCES``)
    workload: str  # the reference's workload id, e.g. "qwen05-b2s512"
    strategies: tuple[str, ...]  # the candidate's strategies; several: the reference is the best of them ("up to")


CASES: dict[str, Case] = {c.semantic_id: c for c in [
    Case("TRAIN-CHECKPOINT", "qwen05-b2s512", ("checkpoint-all",)),
    Case("TRAIN-OFFLOAD", "qwen05-b2s512", ("offload",)),
    Case("TRAIN-AMP-BACKWARD", "qwen05-b2s512", ("fp16",)),
    Case("TRAIN-GRADIENT-ACCUMULATION", "qwen05-b4s256", ("micro2", "micro4")),
]}


@dataclass(frozen=True)
class Gap:
    """The table of one reference."""

    case: Case
    reference_saving: float
    tolerance_pp: float  # allocator_pp + tracer.pp: a definition within it reproduces the reference
    rows: list[GapRow]
    verdict: Verdict
    elapsed_s: float  # wall time it took
    allocator_pp: float = ALLOCATOR_PP  # the allocator's term (derived in the module's docstring)
    tracer: TracerTerm | None = None  # the tracer's term (None: not measured, tolerance_pp is allocator_pp)


def _rounded_peak(led) -> int:
    """The peak in 512-byte blocks: its stage's rounded total (a peak inside the forward: the forward end's
    rounding added to it)."""
    if led.peak_stage in led.rounded:
        return led.rounded[led.peak_stage]
    return led.forward_peak + led.rounded["forward"] - led.total("forward")


def _arms(case: Case, d: StepDefinition) -> tuple[tuple[str, StepDefinition], list[tuple[str, StepDefinition]]]:
    """(baseline arm, candidate arms), each (strategy, definition). Half weights stand in for autocast."""
    if d.weights and any(parse(s).amp for s in case.strategies):
        return ("plain", d.replace(weights=None)), [("plain", d)]
    return ("plain", d), [(s, d) for s in case.strategies]


def _row(case: Case, label: str, d: StepDefinition, ref: float, plain: StepLedger, cands: list,
         tolerance_pp: float) -> GapRow:
    strategy, best = min(cands, key=lambda c: c[1].peak)
    saving = 1 - best.peak / plain.peak
    inc = 1 - best.increment / plain.increment
    rounded = 1 - _rounded_peak(best.ledger) / _rounded_peak(plain.ledger)
    tol = tolerance_pp / 100
    return GapRow(case.semantic_id, label, d.name, strategy, plain.peak, best.peak, saving, inc, ref,
                  abs(saving - ref) <= tol, abs(inc - ref) <= tol, 100 * (rounded - saving))


_MEASURED: dict = {}  # (Case, StepOptions) -> the TracerTerm measured in this process


def _borrowed(case: Case, strategy: str, book_saving: float, options: StepOptions, workers: int,
              others) -> TracerTerm:
    """The largest tracer term measured on the other cases (``others``), for a case MemTracker cannot trace."""
    terms = []
    for c in others:
        if c == case or not all(memtracker_can_trace(x) for x in c.strategies):
            continue
        if (c, options) not in _MEASURED:
            reference_gap(c.semantic_id, ["a"], workers, c, options)
        terms.append(_MEASURED[(c, options)])
    if not terms:
        raise ValueError(f"{case.semantic_id}: MemTracker cannot trace {strategy} and no other case measures it")
    return TracerTerm(case.semantic_id, strategy, book_saving, None, max(t.pp for t in terms),
                      tuple(t.case for t in terms))


def reference_gap(semantic_id: str, definitions=None, workers: int | None = None, case: Case | None = None,
                  options: StepOptions = StepOptions().for_device("cuda"), tracer_cases=None) -> Gap:
    """The table of one course reference: per definition, the predicted savings beside the reference, within
    the case's tolerance (the allocator's term plus the tracer's, ``TracerTerm``).

    Args:
        semantic_id: a reference of ``records.references.REFERENCES`` that ``CASES`` traces.
        definitions: labels of ``DEFINITIONS`` to trace (None: all).
        workers: processes that trace the steps (forked; 1: this process; None: the CPUs this process may
            use, at most 4).
        case: where to trace it (None: ``CASES[semantic_id]``).
        options: the step's settings (default: CUDA's, as on the reference's GPU).
        tracer_cases: where a case MemTracker cannot trace borrows its tracer term from (None: ``CASES``).

    Returns:
        a ``Gap``: the rows, in the order of ``definitions``, the tolerance and the verdict.

    Example:
        >>> tiny = Case("TRAIN-CHECKPOINT", "tiny-b2s64", ("checkpoint-all",))  # (the reference's: qwen05-b2s512)
        >>> gap = reference_gap("TRAIN-CHECKPOINT", ["a", "c"], workers=1, case=tiny)
        >>> [(r.definition, r.strategy, r.saving > 0) for r in gap.rows], gap.reference_saving
        ([('a', 'checkpoint-all', True), ('c', 'checkpoint-all', True)], 0.337)
        >>> gap.tolerance_pp == gap.allocator_pp + gap.tracer.pp and gap.tracer.pp >= 0
        True
    """
    t0, threads = time.perf_counter(), torch.get_num_threads()
    workers = workers or default_workers()
    case = case or CASES[semantic_id]
    ref = REFERENCES[semantic_id].peak_saving
    labels = list(definitions or DEFINITIONS)
    unknown = [x for x in labels if x not in DEFINITIONS]
    if unknown:
        raise ValueError(f"unknown or incompatible definitions {unknown}; known: {', '.join(DEFINITIONS)}")
    arms = {label: _arms(case, DEFINITIONS[label]) for label in labels}
    book_a = _arms(case, STEADY)
    keys = []
    for base, cands in [*arms.values(), book_a]:  # (a) always: the tracer's term compares its saving
        keys += [k for k in [base, *cands] if k not in keys]
    traceable = all(memtracker_can_trace(x) for x in case.strategies)
    tasks = keys + ([("memtracker", x) for x in ("plain", *case.strategies)] if traceable else [])
    w = parse_workload(case.workload)
    torch.set_num_threads(1)  # fake tensors compute nothing: intra-op threads would only spin
    try:  # one fake session per weights' dtype, inherited by the forked workers
        sessions = {weights: lifecycle.Session(w, fake=True, options=options,
                                               definition=STEADY.replace(weights=weights))
                    for weights in dict.fromkeys(d.weights for _, d in keys)}

        def run(k):
            if k[0] == "memtracker":
                return memtracker_peak(sessions[None], k[1])
            return sessions[k[1].weights].step(parse(k[0]), k[1])

        done = dict(zip(tasks, forked_map(run, tasks, workers)))
    finally:
        torch.set_num_threads(threads)
    base, cands = book_a
    strategy, best = min([(k[0], done[k]) for k in cands], key=lambda c: c[1].peak)
    book_saving = 1 - best.peak / done[base].peak
    if traceable:
        mt = 1 - done[("memtracker", strategy)] / done[("memtracker", "plain")]
        tracer = _MEASURED[(case, options)] = TracerTerm(case.semantic_id, strategy, book_saving, mt,
                                                         100 * abs(book_saving - mt))
    else:
        others = CASES.values() if tracer_cases is None else tracer_cases
        tracer = _borrowed(case, strategy, book_saving, options, workers, others)
    tolerance = ALLOCATOR_PP + tracer.pp
    rows = [_row(case, label, DEFINITIONS[label], ref, done[base], [(k[0], done[k]) for k in cands], tolerance)
            for label, (base, cands) in arms.items()]
    return Gap(case, ref, tolerance, rows, verdict(rows, ref, tolerance), time.perf_counter() - t0,
               ALLOCATOR_PP, tracer)
