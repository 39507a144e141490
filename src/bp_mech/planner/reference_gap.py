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

Tolerance (``TOLERANCE_PP``, percentage points of saving). The fake step reproduces the live bytes of
the program exactly (``tests/planner/test_plan.py``: to the GradScaler's 8 bytes against the tracked
CPU step), so what separates a predicted saving from one an allocator reports for the same program is
what the allocator adds to the live bytes: (1) every block rounded up to 512 B, which ``GapRow.
rounding_pp`` computes per row from the ledger's rounded stages (below 0.01 pp at these shapes); (2)
the caching allocator's blocks: ``max_memory_allocated`` counts whole blocks, and a cached block is
handed out unsplit when less than 1 MiB would remain, so a live block may count up to 1 MiB more than
its tensor. A steady-state step asks for the sizes the step before it freed, so such remainders are
rare; allowing them up to 0.5 % of each peak moves a saving s by at most 2 x 0.5 % x (1 - s) < 1 pp.
Not covered: the temporaries of CUDA's own kernels (SDPA, cross-entropy, embedding backward), which a
CPU trace does not see; a reference outside the tolerance under every definition points there, or to
a workload or program other than the one the reference names.

The accumulation reference ("up to 17.3 %", 2 and 4 micro-batches at sequence 256) is traced at batch
4 (the smallest that 4 micro-batches divide), its saving the best of ``micro2`` and ``micro4``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bp_mech.planner import lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition, StepLedger
from bp_mech.planner.pool import default_workers, forked_map
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import parse
from bp_mech.instruments.workload import parse_workload
from bp_mech.records.references import REFERENCES

TOLERANCE_PP = 1.0  # a definition reproduces a reference when its saving is within this many points of it
_D = StepDefinition
DEFINITIONS: dict[str, StepDefinition] = {  # label -> definition: (a) to (g), then the pairs that can hold
    "a": STEADY, "b": _D("first"), "c": _D("none"), "d": _D(keep_outputs=True), "e": _D(weights="float16"),
    "e-bf16": _D(weights="bfloat16"), "g": _D(adamw="foreach"),
    "b+d": _D("first", keep_outputs=True), "b+e": _D("first", weights="float16"), "b+g": _D("first", adamw="foreach"),
    "c+d": _D("none", keep_outputs=True), "c+e": _D("none", weights="float16"),
    "d+e": _D(keep_outputs=True, weights="float16"), "d+g": _D(keep_outputs=True, adamw="foreach"),
    "e+g": _D(weights="float16", adamw="foreach"),
}


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
class GapRow:
    """One definition's prediction for one reference."""

    reference: str  # the experiment
    definition: str  # its label in ``DEFINITIONS`` ("a", "b+d", ...)
    name: str  # the definition's name (``StepDefinition.name``)
    strategy: str  # the candidate arm that gave the saving (the best one under "up to")
    plain_peak: int  # bytes
    strategy_peak: int  # bytes
    saving: float  # 1 - strategy_peak / plain_peak
    increment_saving: float  # (f): the same for the peaks above what was resident at each step's start
    reference_saving: float  # the reference's figure
    within: bool  # |saving - reference| <= TOLERANCE_PP
    increment_within: bool  # the same for the increment saving
    rounding_pp: float  # how far 512-byte blocks move ``saving``, percentage points

    @property
    def gap_pp(self) -> float:
        """Predicted minus reference saving, percentage points."""
        return 100 * (self.saving - self.reference_saving)


@dataclass(frozen=True)
class Verdict:
    """Which definitions reproduce the reference, or the closest one and what that implies."""

    reproduced_by: tuple[str, ...]  # labels; "x (f)": by the increment saving of definition x
    closest: str  # the label (with " (f)" for an increment) nearest to the reference
    closest_saving: float
    text: str  # one sentence


@dataclass(frozen=True)
class Gap:
    """The table of one reference."""

    case: Case
    reference_saving: float
    tolerance_pp: float
    rows: list[GapRow]
    verdict: Verdict
    elapsed_s: float  # wall time it took


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


def _row(case: Case, label: str, d: StepDefinition, ref: float, plain: StepLedger, cands: list) -> GapRow:
    strategy, best = min(cands, key=lambda c: c[1].peak)
    saving = 1 - best.peak / plain.peak
    inc = 1 - best.increment / plain.increment
    rounded = 1 - _rounded_peak(best.ledger) / _rounded_peak(plain.ledger)
    tol = TOLERANCE_PP / 100
    return GapRow(case.semantic_id, label, d.name, strategy, plain.peak, best.peak, saving, inc, ref,
                  abs(saving - ref) <= tol, abs(inc - ref) <= tol, 100 * (rounded - saving))


def _points(n: float) -> str:
    return f"{n:g} point" + ("" if n == 1 else "s")


def verdict(rows: list[GapRow], ref: float) -> Verdict:
    """Which rows reproduce ``ref`` within ``TOLERANCE_PP``, or the closest one and which side the rest lie on.

    Args:
        rows: the table's rows (their savings and increment savings are the predictions).
        ref: the reference saving, a fraction.

    Returns:
        a ``Verdict``; ties for the closest go to the earlier row, an absolute saving before an increment.

    Example:
        >>> row = lambda label, s, f: GapRow("X", label, label, "s", 100, 90, s, f, 0.3, abs(s - 0.3) <= 0.01,
        ...                                  abs(f - 0.3) <= 0.01, 0.0)
        >>> verdict([row("a", 0.10, 0.25), row("c", 0.2, 0.295)], 0.3).reproduced_by
        ('c (f)',)
        >>> v = verdict([row("a", 0.10, 0.25)], 0.3)
        >>> v.reproduced_by, v.closest, v.closest_saving
        ((), 'a (f)', 0.25)
    """
    found = tuple([r.definition for r in rows if r.within] + [f"{r.definition} (f)" for r in rows if r.increment_within])
    preds = [(r.definition, r.saving) for r in rows] + [(f"{r.definition} (f)", r.increment_saving) for r in rows]
    i = min(range(len(preds)), key=lambda j: (round(abs(preds[j][1] - ref), 4), j))
    label, value = preds[i]
    if found:
        text = (f"reproduced within {_points(TOLERANCE_PP)} by {', '.join(found)}: the reference is consistent "
                "with the book's ledger under that definition of the step")
        return Verdict(found, label, value, text)
    low = [p for p in preds if p[1] < ref]
    high = [p for p in preds if p[1] > ref]
    if not high:
        side = "every definition predicts less"
    elif not low:
        side = "every definition predicts more"
    else:
        a, b = max(low, key=lambda p: p[1]), min(high, key=lambda p: p[1])
        side = f"it lies between {a[0]} ({a[1]:.1%}) and {b[0]} ({b[1]:.1%})"
    text = (f"no definition reproduces {ref:.1%} within {_points(TOLERANCE_PP)} (closest: {label} at {value:.1%}): "
            f"{side}; the reference's peak is not that of a step traced here at this workload (another program "
            "or workload, or CUDA kernels' own temporaries the CPU trace does not see)")
    return Verdict(found, label, value, text)


def reference_gap(semantic_id: str, definitions=None, workers: int | None = None, case: Case | None = None,
                  options: StepOptions = StepOptions().for_device("cuda")) -> Gap:
    """The table of one course reference: per definition, the predicted savings beside the reference.

    Args:
        semantic_id: a reference of ``records.references.REFERENCES`` that ``CASES`` traces.
        definitions: labels of ``DEFINITIONS`` to trace (None: all).
        workers: processes that trace the steps (forked; 1: this process; None: the CPUs this process may
            use, at most 4).
        case: where to trace it (None: ``CASES[semantic_id]``).
        options: the step's settings (default: CUDA's, as on the reference's GPU).

    Returns:
        a ``Gap``: the rows, in the order of ``definitions``, and the verdict.

    Example:
        >>> tiny = Case("TRAIN-CHECKPOINT", "tiny-b2s64", ("checkpoint-all",))  # (the reference's: qwen05-b2s512)
        >>> gap = reference_gap("TRAIN-CHECKPOINT", ["a", "c"], workers=1, case=tiny)
        >>> [(r.definition, r.strategy, r.saving > 0) for r in gap.rows], gap.reference_saving
        ([('a', 'checkpoint-all', True), ('c', 'checkpoint-all', True)], 0.337)
    """
    t0, threads = time.perf_counter(), torch.get_num_threads()
    workers = workers or default_workers()
    case = case or CASES[semantic_id]
    ref = REFERENCES[semantic_id].peak_saving
    labels = list(definitions or DEFINITIONS)
    arms = {label: _arms(case, DEFINITIONS[label]) for label in labels}
    keys = []
    for base, cands in arms.values():
        keys += [k for k in [base, *cands] if k not in keys]
    w = parse_workload(case.workload)
    torch.set_num_threads(1)  # fake tensors compute nothing: intra-op threads would only spin
    try:  # one fake session per weights' dtype, inherited by the forked workers
        sessions = {weights: lifecycle.Session(w, fake=True, options=options,
                                               definition=STEADY.replace(weights=weights))
                    for weights in dict.fromkeys(d.weights for _, d in keys)}
        done = dict(zip(keys, forked_map(lambda k: sessions[k[1].weights].step(parse(k[0]), k[1]), keys, workers)))
    finally:
        torch.set_num_threads(threads)
    rows = [_row(case, label, DEFINITIONS[label], ref, done[base], [(k[0], done[k]) for k in cands])
            for label, (base, cands) in arms.items()]
    return Gap(case, ref, TOLERANCE_PP, rows, verdict(rows, ref), time.perf_counter() - t0)
