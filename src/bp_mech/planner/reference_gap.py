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

Tolerance: two terms, each derived, their sum a case's ``Gap.tolerance_pp``.

The allocator's term (``ALLOCATOR_PP``, percentage points of saving). The fake step reproduces the live
bytes of the program exactly (``tests/planner/test_plan.py``: to the GradScaler's 8 bytes against the
tracked CPU step), so what separates a predicted saving from one an allocator reports for the same program
is what the allocator adds to the live bytes: (1) every block rounded up to 512 B, which ``GapRow.
rounding_pp`` computes per row from the ledger's rounded stages (below 0.01 pp at these shapes); (2)
the caching allocator's blocks: ``max_memory_allocated`` counts whole blocks, and a cached block is
handed out unsplit when less than 1 MiB would remain, so a live block may count up to 1 MiB more than
its tensor. A steady-state step asks for the sizes the step before it freed, so such remainders are
rare; allowing them up to 0.5 % of each peak moves a saving s by at most 2 x 0.5 % x (1 - s) < 1 pp.

The tracer's term (``TracerTerm``): the book's storage tracker is one way of counting a step's bytes.
PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` is another (its own dispatch mode, its own
bookkeeping of storages); each case traces the book's own definition (a), the plain step and the case's
strategy, with both, at the reference workload under the same fake tensors, and the difference of the two
savings, in points, is the tracer's term. MemTracker counts bytes per device, and under fake tensors every
tensor is on the CPU, the offload's host copies too: it cannot see what the offload moves off the device,
so a case whose strategy offloads takes the largest term measured on the other cases, labelled as such.

Not covered: the temporaries of CUDA's own kernels (SDPA, cross-entropy, embedding backward), which a
CPU trace does not see; a reference outside the tolerance under every definition points there, or to
a workload or program other than the one the reference names.

Definitions that cannot hold together (``holds_together``) are never traced: two choices of the moments
((b) and (c)), two weight dtypes, or a step without an optimizer, (c), with anything about the optimizer's
state or implementation ((e): half-precision weights *and AdamW state*; (g): foreach AdamW).

The accumulation reference ("up to 17.3 %", 2 and 4 micro-batches at sequence 256) is traced at batch
4 (the smallest that 4 micro-batches divide), its saving the best of ``micro2`` and ``micro4``: the
reference names only the micro-batch counts and the sequence length, so that batch is this book's
assumption (``ASSUMED_BATCH``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch

from bp_mech.planner import lifecycle
from bp_mech.planner.definitions import STEADY, StepDefinition, StepLedger
from bp_mech.planner.pool import default_workers, forked_map
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import enter, parse
from bp_mech.offload import OffloadConfig
from bp_mech.planner.cuda_autocast import cuda_policy
from bp_mech.instruments.workload import parse_workload
from bp_mech.records.references import REFERENCES

ALLOCATOR_PP = 1.0  # the allocator's term of every case's tolerance, percentage points (derived above)
TOLERANCE_PP = ALLOCATOR_PP  # (its former name; a case's tolerance adds its tracer's term: ``Gap.tolerance_pp``)
_D = StepDefinition
SINGLE: dict[str, StepDefinition] = {  # label -> definition: (a) to (g) of ``planner.definitions``
    "a": STEADY, "b": _D("first"), "c": _D("none"), "d": _D(keep_outputs=True), "e": _D(weights="float16"),
    "e-bf16": _D(weights="bfloat16"), "g": _D(adamw="foreach"),
}
MOMENT_PARTS = ("b", "c")  # the moments: the first step, no optimizer (the default: resident)
WEIGHT_PARTS = ("e", "e-bf16")  # half-precision weights
OPTIMIZER_PARTS = ("e", "e-bf16", "g")  # say something about AdamW's state or its implementation
PAIRED = ("b", "c", "d", "e", "g")  # the pairs are of these (bf16 weights trace as fp16 do: "e" stands for both)


def holds_together(label: str) -> bool:
    """Whether a definition's parts ("b+d": (b) and (d)) describe one step a program could run.

    Not: two choices of the moments, two weight dtypes, or no optimizer (c) with anything about the
    optimizer's state or implementation (e: half-precision weights *and AdamW state*; g: foreach AdamW).

    Example:
        >>> [holds_together(x) for x in ("a", "b+d", "c+d", "c+e", "c+g", "b+c", "e+e-bf16")]
        [True, True, True, False, False, False, False]
    """
    parts = set(label.split("+"))
    return (len(parts & set(MOMENT_PARTS)) <= 1 and len(parts & set(WEIGHT_PARTS)) <= 1
            and not ("c" in parts and parts & set(OPTIMIZER_PARTS)))


def combine(label: str) -> StepDefinition:
    """The definition of a label of single parts joined by "+": each part's choices on the book's step.

    Example:
        >>> combine("b+d") == StepDefinition("first", keep_outputs=True)
        True
    """
    if not holds_together(label):
        raise ValueError(f"{label!r} does not hold together (holds_together)")
    changes = {}
    for part in label.split("+"):
        d = SINGLE[part]
        changes.update({f.name: getattr(d, f.name) for f in dataclasses.fields(d)
                        if getattr(d, f.name) != getattr(STEADY, f.name)})
    return STEADY.replace(**changes)


DEFINITIONS: dict[str, StepDefinition] = {  # the single ones, then the pairs that can hold together
    **SINGLE, **{f"{x}+{y}": combine(f"{x}+{y}") for x, y in itertools.combinations(PAIRED, 2)
                 if holds_together(f"{x}+{y}")}}


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
    within: bool  # |saving - reference| <= the case's tolerance (``Gap.tolerance_pp``)
    increment_within: bool  # the same for the increment saving
    rounding_pp: float  # how far 512-byte blocks move ``saving``, percentage points

    @property
    def gap_pp(self) -> float:
        """Predicted minus reference saving, percentage points."""
        return 100 * (self.saving - self.reference_saving)


@dataclass(frozen=True)
class Verdict:
    """Which definitions reproduce the reference, or the closest one and what that implies. Only definitions
    that hold together (``holds_together``) are ranked."""

    reproduced_by: tuple[str, ...]  # labels; "x (f)": by the increment saving of definition x
    closest: str  # the label (with " (f)" for an increment) nearest to the reference: the most plausible reading
    closest_saving: float
    text: str  # one sentence


@dataclass(frozen=True)
class TracerTerm:
    """The tracer's own uncertainty at one case: definition (a)'s saving by the book's storage tracker and by
    PyTorch's MemTracker, the same fake step at the reference workload."""

    case: str  # the semantic id this term belongs to
    strategy: str  # the candidate arm both savings are of (the book's best under "up to")
    book_saving: float  # 1 - peak / plain peak, the book's tracker
    memtracker_saving: float | None  # the same by MemTracker; None: MemTracker cannot trace the strategy here
    pp: float  # |book - MemTracker| in points; where MemTracker cannot trace, the largest of ``borrowed_from``
    borrowed_from: tuple[str, ...] = ()  # the cases whose measured terms stood in (empty: measured here)

    @property
    def measured(self) -> bool:
        return self.memtracker_saving is not None


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


def points(n: float) -> str:
    """A tolerance in words, to a tenth of a point.

    >>> points(1.0), points(1.2649)
    ('1 point', '1.3 points')
    """
    n = round(n, 1)
    return f"{n:g} point" + ("" if n == 1 else "s")


def verdict(rows: list[GapRow], ref: float, tolerance_pp: float = ALLOCATOR_PP) -> Verdict:
    """Which rows reproduce ``ref`` within ``tolerance_pp``, or the closest one and which side the rest lie on;
    rows whose definition does not hold together (``holds_together``) are neither ranked nor offered.

    Args:
        rows: the table's rows (their savings and increment savings are the predictions).
        ref: the reference saving, a fraction.
        tolerance_pp: the case's tolerance (``Gap.tolerance_pp``), percentage points; the rows' ``within``
            flags were set with it.

    Returns:
        a ``Verdict``; ties for the closest go to the earlier row, an absolute saving before an increment.

    Example:
        >>> row = lambda label, s, f: GapRow("X", label, label, "s", 100, 90, s, f, 0.3, abs(s - 0.3) <= 0.01,
        ...                                  abs(f - 0.3) <= 0.01, 0.0)
        >>> verdict([row("a", 0.10, 0.25), row("c", 0.2, 0.295)], 0.3).reproduced_by
        ('c (f)',)
        >>> v = verdict([row("a", 0.10, 0.25), row("c+e", 0.3, 0.3)], 0.3)  # c+e: no optimizer, AdamW state
        >>> v.reproduced_by, v.closest, v.closest_saving
        ((), 'a (f)', 0.25)
    """
    rows = [r for r in rows if holds_together(r.definition)]
    tol = points(tolerance_pp)
    found = tuple([r.definition for r in rows if r.within] + [f"{r.definition} (f)" for r in rows if r.increment_within])
    preds = [(r.definition, r.saving) for r in rows] + [(f"{r.definition} (f)", r.increment_saving) for r in rows]
    i = min(range(len(preds)), key=lambda j: (round(abs(preds[j][1] - ref), 4), j))
    label, value = preds[i]
    if found:
        text = (f"reproduced within {tol} by {', '.join(found)}: the reference is consistent "
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
    text = (f"no definition reproduces {ref:.1%} within {tol} (closest: {label} at {value:.1%}): "
            f"{side}; the reference's peak is not that of a step traced here at this workload (another program "
            "or workload, or CUDA kernels' own temporaries the CPU trace does not see)")
    return Verdict(found, label, value, text)


def memtracker():
    """A new PyTorch ``MemTracker`` that lets the root module run once per micro-batch. MemTracker refuses a
    second forward of the root within one tracking (it takes it for the next iteration); accumulation's
    micro-batches run the model once each, so the root's per-module statistics restart with each one. The
    device's peak, the one number read here, is not per module and runs on."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Repeated(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                del self.memory_tracking[module]  # the next micro-batch's forward of the root
            super()._pre_fw_hook(module, inputs)

    return Repeated()


def memtracker_can_trace(strategy: str) -> bool:
    """Whether MemTracker's peak is the device's under fake tensors: not with offload, whose host copies are
    fake CPU tensors like every device tensor, so MemTracker counts them on the device."""
    return not parse(strategy).offload


def memtracker_peak(session: lifecycle.Session, strategy: str) -> int:
    """The peak of one steady-state step (definition (a)) of ``strategy`` on a fake ``session``, counted by
    PyTorch's MemTracker instead of the book's storage tracker: the same step as ``session.step``, whose
    parameters, buffers, AdamW state and batch exist when it starts (``track_external``)."""
    s, model, batch, device = parse(strategy), session.model, session.batch, session.device
    off = OffloadConfig(min_bytes=session.options.offload_min_bytes)
    emulate = s.amp is not None and session.options.autocast == "cuda" and device.type != "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # (fake: no values to scale, as in Session.step)
    opt = session.optimizer(session.options.adamw)
    with session.active(), cuda_policy() if emulate else contextlib.nullcontext(), \
            enter(model, s, device, off, scaler) as ctx:
        if ctx.offload is not None:
            session._uncached_hooks(ctx.offload)
        mt = memtracker()
        mt.track_external(model, opt, *batch.values())
        with mt:
            train_step(model, opt, batch, s, entered=ctx)
    return mt.get_tracker_snapshot("peak")[device]["Total"]


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
