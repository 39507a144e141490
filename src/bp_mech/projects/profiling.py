"""Part 02 · 74 — TRAIN-PROFILING-DIAGNOSIS: from the lifecycle ledger and the trace to a remedy.

``diagnose`` puts the pieces together for one workload on one device:

1. ``step_profile.profile_step``: the baseline full training step under ``torch.profiler`` (Chrome
   trace, the memory timeline by the profiler's categories, the operators by self time);
2. ``planner.lifecycle.Session(...).ledger(PLAIN)``: Part 02 · 43's ledger of the same step (tracked storages; on CUDA the
   allocator beside them), and ``diagnosis.cross_check`` of the two views at each stage;
3. ``diagnosis.dominant_state`` and ``diagnosis.rank``: the peak, the line that dominates it, and
   the remedies ranked by predicted saving, each attributed to the line it removes;
4. every remedy applied (its ``bench.strategy.Strategy``, ``Session.ledger(strategy)`` on the same session) and measured:
   ``outcome`` puts its predicted saving against the measured one; on CUDA the measured peaks are the
   allocator's.

Decision rule (per remedy): the attribution is accepted when the predicted saving is within
``ATTRIBUTION_TOL`` of the plain peak of the measured saving; otherwise "tune", with the error and
the point where the measured peak sits after the remedy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from bp_mech.planner import lifecycle
from bp_mech.bench.oom import Failed, attempt, release_memory
from bp_mech.bench.step import PHASES
from bp_mech.bench.optimizer import StepOptions
from bp_mech.bench.strategy import PLAIN
from bp_mech.ledger_table import Ledger
from bp_mech.projects import diagnosis, step_profile
from bp_mech.projects.diagnosis import POINT_LABELS, REMEDIES, Attribution, Dominant
from bp_mech.projects.step_profile import ProfileConfig
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

CANDIDATES = ("plain", *(r.name for r in REMEDIES))
ATTRIBUTION_TOL = 0.05  # |predicted - measured saving| / plain peak at which an attribution is accepted


@dataclass
class Diagnosis:
    """Everything ``diagnose`` found, for the records and the chapter."""

    workload_id: str
    device: str
    profile: step_profile.StepProfile  # the profiled baseline step
    plain: Ledger  # the plain step's ledger (measured)
    rows: dict  # diagnosis.ledger_rows(plain)
    dominant: Dominant  # diagnosis.dominant_state(rows)
    cross: dict  # diagnosis.cross_check(rows, profile.stages)
    known: dict  # diagnosis.known_lines(w)
    residual: dict  # diagnosis.reconcile(cross, known): per point and class, what the known lines leave
    ranked: list[Attribution]  # diagnosis.rank(rows, ...), largest predicted saving first
    measured: dict[str, Ledger | Failed] = field(default_factory=dict)  # remedy -> its ledger, or why none


def peak_of(led, device) -> int:
    """The measured peak: tracked storages (CPU), the allocator's largest phase peak (CUDA)."""
    if torch.device(device).type == "cuda" and led.allocator:
        return max(v for k, v in led.allocator.items() if k.endswith("_peak"))
    return led.peak


def diagnose(w, device="cpu", trace_path=None, remedies=REMEDIES, cfg: ProfileConfig = ProfileConfig(),
             progress=None) -> Diagnosis:
    """Profile (``cfg``: the profiler's schedule; one active step: the memory profiler's analysis grows
    with the operators recorded, and qwen05's step has 12x tiny's), cross-check, rank and measure
    (module docstring) for workload ``w`` on ``device``; ``trace_path``: write the Chrome trace there."""
    progress = progress or (lambda it, **kw: it)
    prof = step_profile.profile_step(w, device, cfg, trace_path)
    release_memory(device)
    session = lifecycle.Session(w, device)  # one model and AdamW, every strategy measured on it
    plain = session.ledger(PLAIN)
    rows = diagnosis.ledger_rows(plain)
    cross, known = diagnosis.cross_check(rows, prof.stages), diagnosis.known_lines(w)
    d = Diagnosis(w.workload_id, torch.device(device).type, prof, plain, rows, diagnosis.dominant_state(rows), cross,
                  known, diagnosis.reconcile(cross, known, rows), diagnosis.rank(rows, w, device, remedies))
    by_name = {r.name: r for r in remedies}
    for a in progress(d.ranked, desc="remedies"):
        release_memory(device)
        d.measured[a.remedy] = attempt(session.ledger, by_name[a.remedy].strategy)
    return d


def estimate_at(w, like="cuda", remedies=REMEDIES, progress=None) -> dict:
    """The same diagnosis at workload ``w`` (the GPU's, e.g. ``qwen05-b2s512``) without the device:
    the plain step and every remedy under fake tensors (``lifecycle.Session(fake=True)``, the
    settings of ``like``: fused AdamW and CUDA's offload threshold), predicted against estimated
    saving. Evidence level ``estimated``: a check of the attribution at full size, not a measurement."""
    progress = progress or (lambda it, **kw: it)
    session = lifecycle.Session(w, "cpu", fake=True, options=StepOptions().for_device(like))
    plain = session.ledger(PLAIN)
    rows = diagnosis.ledger_rows(plain)
    by_name = {r.name: r for r in remedies}
    out = []
    for a in progress(diagnosis.rank(rows, w, like, remedies), desc="estimates"):
        led = session.ledger(by_name[a.remedy].strategy)
        out.append(dict(remedy=a.remedy, line=a.line, line_at_peak=a.line_at_peak,
                        predicted_saving=a.predicted_saving, estimated_saving=plain.peak - led.peak,
                        error=(a.predicted_saving - plain.peak + led.peak) / plain.peak,
                        estimated_peak_point=diagnosis.peak_point(diagnosis.ledger_rows(led))))
    return dict(workload_id=w.workload_id, evidence_level="estimated", memory_source="fake-tensor", like=like,
                peak=plain.peak, dominant=dataclasses.asdict(diagnosis.dominant_state(rows)), ledger=rows,
                remedies=out)


@dataclass(frozen=True)
class Outcome:
    """A remedy's predicted saving against the measured one (bytes; errors as a share of the plain peak)."""

    remedy: str
    line: str  # the ledger class it removes
    predicted_saving: int
    naive_saving: int
    failure: str | None  # why it could not be measured
    measured_saving: int | None = None
    peak: int | None = None  # its measured peak
    error: float | None = None  # (predicted - measured) / plain peak
    naive_error: float | None = None
    measured_peak_point: str | None = None
    predicted_peak_point: str | None = None
    decision: str | None = None  # accept when |error| <= ATTRIBUTION_TOL
    next_step: str | None = None


def decide(error: float, measured_point: str, predicted_point: str) -> Decision:
    """A remedy's attribution decision, by the rule above.

    Args:
        error: (predicted - measured saving) / the plain peak.
        measured_point: where the measured peak sits after the remedy (``diagnosis.POINT_LABELS``' key).
        predicted_point: where the prediction put it.

    Returns:
        The ``Decision``; its reason names the error and the bound.

    Example:
        >>> decide(0.08, "backward", "backward").verdict
        'tune'
    """
    miss = f"the prediction misses by {error:+.1%} of the plain peak"
    if abs(error) <= ATTRIBUTION_TOL:
        return Decision("accept", f"{miss} (<= ATTRIBUTION_TOL {ATTRIBUTION_TOL:.0%})")
    return Decision("tune", f"{miss} (> ATTRIBUTION_TOL {ATTRIBUTION_TOL:.0%})",
                    f"{miss} (tolerance {ATTRIBUTION_TOL:.0%}); after the remedy the peak is "
                    f"{POINT_LABELS[measured_point]} (predicted: {POINT_LABELS[predicted_point]})")


def outcome(d: Diagnosis, a: Attribution) -> Outcome:
    """Predicted against measured saving of one ranked remedy ``a``, the decision by ``ATTRIBUTION_TOL``
    and, where it fails, why."""
    led = d.measured.get(a.remedy, Failed("not measured"))
    base = dict(remedy=a.remedy, line=a.line, predicted_saving=a.predicted_saving, naive_saving=a.naive_saving)
    if isinstance(led, Failed):
        return Outcome(**base, failure=led.failure, **Decision.failed(led.failure).record_fields())
    plain_peak, peak = peak_of(d.plain, d.device), peak_of(led, d.device)
    measured = plain_peak - peak
    error = (a.predicted_saving - measured) / plain_peak
    point = diagnosis.peak_point(diagnosis.ledger_rows(led))
    decided = decide(error, point, a.predicted_peak_point)
    return Outcome(**base, failure=None, measured_saving=measured, peak=peak, error=error,
                   naive_error=(a.naive_saving - measured) / plain_peak, measured_peak_point=point,
                   predicted_peak_point=a.predicted_peak_point, **decided.record_fields())


def summary(d: Diagnosis) -> dict:
    """The diagnosis of the plain step as record metrics (JSON-safe)."""
    p = d.profile
    return json_safe(dict(
        dominant=dataclasses.asdict(d.dominant), ledger=d.rows, profiler_stages=p.stages, cross_check=d.cross,
        known_lines=d.known, residual=d.residual,
        backward_moment=diagnosis.backward_moment(d.rows["backward_peak"], d.known),
        operators=p.operators, self_total_us=p.self_total_us, phase_us=p.phase_us, step_us_profiled=p.step_us,
        profiled_steps=len(p.phases) // len(PHASES), profiler_extra=p.extra,
        ranked=[a.to_dict(changes=False) for a in d.ranked]))


def run(ctx) -> list:
    """One record for the plain step (the diagnosis in ``metrics``), one per remedy (predicted against
    measured saving, the decision by ``ATTRIBUTION_TOL``)."""
    w, dev = ctx.workload, ctx.device
    d = diagnose(w, dev, progress=ctx.progress)
    gpu = dev == "cuda"

    def fields(led):
        reserved = [v for k, v in led.allocator.items() if k.endswith("_reserved")] if gpu else []
        return dict(peak_allocated=peak_of(led, dev), memory_source=ctx.memory_source,
                    updates=led.updates - (led.skipped or 0), skipped_updates=led.skipped, all_finite=led.finite,
                    peak_reserved=max(reserved, default=None))

    top = d.ranked[0].remedy if d.ranked else None
    metrics = summary(d)
    if not gpu and not ctx.smoke:  # the attribution at the GPU workload's full size, under fake tensors
        from bp_mech.instruments.workload import parse_workload

        metrics["at_gpu_workload"] = json_safe(estimate_at(parse_workload(ctx.experiment.gpu_workload),
                                                           progress=ctx.progress))
    recs = [ctx.record(PLAIN.name, strategy=PLAIN.name, **fields(d.plain),
                       next_step=f"apply {top} (largest predicted saving)" if top else None, metrics=metrics)]
    for r in REMEDIES:
        if why := r.unfit(w):
            recs.append(ctx.record(r.name, strategy=r.name, failure=why, memory_source=ctx.memory_source,
                                   next_step="pick a batch the micro-batches divide"))
    for a in d.ranked:
        o, led = outcome(d, a), d.measured[a.remedy]
        extra = fields(led) if not isinstance(led, Failed) else dict(memory_source=ctx.memory_source)
        recs.append(ctx.record(a.remedy, strategy=a.remedy, **extra, failure=o.failure, decision=o.decision,
                               next_step=o.next_step,
                               metrics=json_safe(dict(dataclasses.asdict(o), attribution=a.to_dict()))))
    return recs


PROFILER_OVERHEAD = 3  # dry run: a profiled step (stacks, shapes, memory) costs about 3 plain passes
PROFILE_ANALYSIS_S = {"cpu": 3.0, "cuda": 10.0}  # dry run: the memory profiler's analysis of one active step
ESTIMATE_S = 40.0  # dry run: --mode cpu's full-size estimate (qwen05-b2s512 under fake tensors, 6 strategies)


def dry_run(ctx) -> dict:
    """The profiler schedule, the remedies, the decision rule and an estimate of the seconds per mode: two
    model builds (the profiled one, the ledgers' session), the profiled steps at ``PROFILER_OVERHEAD`` x a
    plain pass and their analysis, two updates per ledger (a warm-up and the measured one), and on the CPU
    the full-size estimate (not in a smoke run)."""
    from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
    from bp_mech.experiments.dry_run import per_mode

    w, cfg = ctx.workload, ProfileConfig()
    tokens, ledgers = w.batch * w.seq, 1 + len(REMEDIES)

    def fields(dev):
        secs = (2 * ASSUMED_BUILD_S[dev] + dry_run_seconds(w.arch, tokens, PROFILER_OVERHEAD * cfg.steps, dev)
                + PROFILE_ANALYSIS_S[dev] * cfg.active + dry_run_seconds(w.arch, tokens, 2 * ledgers, dev)
                + (ESTIMATE_S if dev == "cpu" and not ctx.smoke else 0.0))
        return dict(profiler_schedule=dict(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active),
                    full_size_estimate=dev == "cpu" and not ctx.smoke, estimated_seconds=round(secs, 1))

    return dict(remedies={r.name: dict(line=r.line, how=r.how) for r in REMEDIES},
                profiler=dict(profile_memory=True, record_shapes=True, with_stack=True),
                decision_rule=f"accept when |predicted - measured saving| <= {ATTRIBUTION_TOL:.0%} of the plain peak",
                estimate_basis=ASSUMED_BASIS + f"; profiled steps at {PROFILER_OVERHEAD} x a pass, + the memory "
                               "profiler's analysis per active step", modes=per_mode(fields))
