"""Part 02 · 74 — TRAIN-PROFILING-DIAGNOSIS: from the lifecycle ledger and the trace to a remedy.

``diagnose`` puts the pieces together for one workload on one device:

1. ``step_profile.profile_step``: the baseline full training step under ``torch.profiler`` (Chrome
   trace, the memory timeline by the profiler's categories, the operators by self time);
2. ``ledger_measure.Session``: Part 02 · 43's ledger of the same step (tracked storages; on CUDA the
   allocator beside them), and ``diagnosis.cross_check`` of the two views at each stage;
3. ``diagnosis.dominant_state`` and ``diagnosis.rank``: the peak, the line that dominates it, and
   the remedies ranked by predicted saving, each attributed to the line it removes;
4. every remedy applied (its ``strategy.Strategy``, measured on the same session) and measured:
   ``outcome`` puts its predicted saving against the measured one; on CUDA the measured peaks are the
   allocator's.

Decision rule (per remedy): the attribution is accepted when the predicted saving is within
``ATTRIBUTION_TOL`` of the plain peak of the measured saving; otherwise "tune", with the error and
the point where the measured peak sits after the remedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bp_mech.bench import lifecycle as ledger_measure
from bp_mech.ledger import CLASS_LABELS, CLASSES
from bp_mech.bench.oom import oom_as_failure, release_memory
from bp_mech.book.plots import figure
from bp_mech.projects import diagnosis, step_profile
from bp_mech.projects.diagnosis import POINT_LABELS, REMEDIES
from bp_mech.projects.step_profile import CATEGORIES, ProfileConfig
from bp_mech.records.results import json_safe
from bp_mech.bench.strategy import PLAIN

CANDIDATES = ("plain", *(r.name for r in REMEDIES))
ATTRIBUTION_TOL = 0.05  # |predicted - measured saving| / plain peak at which an attribution is accepted


@dataclass
class Diagnosis:
    """Everything ``diagnose`` found, for the records and the chapter."""

    workload_id: str
    device: str
    profile: step_profile.StepProfile  # the profiled baseline step
    plain: object  # ledger.Ledger of the plain step (measured)
    rows: dict  # diagnosis.ledger_rows(plain)
    dominant: dict  # diagnosis.dominant_state(rows)
    cross: dict  # diagnosis.cross_check(rows, profile.stages)
    known: dict  # diagnosis.known_lines(w)
    residual: dict  # diagnosis.reconcile(cross, known): per point and class, what the known lines leave
    ranked: list  # diagnosis.rank(rows, ...), largest predicted saving first
    measured: dict = field(default_factory=dict)  # remedy -> (Ledger | None, failure | None)


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
    session = ledger_measure.Session(w, device)  # one model and AdamW, every strategy measured on it
    plain = session.measure(PLAIN)
    rows = diagnosis.ledger_rows(plain)
    cross, known = diagnosis.cross_check(rows, prof.stages), diagnosis.known_lines(w)
    d = Diagnosis(w.workload_id, torch.device(device).type, prof, plain, rows, diagnosis.dominant_state(rows), cross,
                  known, diagnosis.reconcile(cross, known, rows), diagnosis.rank(rows, w, device, remedies))
    by_name = {r.name: r for r in remedies}
    for a in progress(d.ranked, desc="remedies"):
        release_memory(device)
        d.measured[a["remedy"]] = oom_as_failure(session.measure, by_name[a["remedy"]].strategy)
    return d


def estimate_at(w, like="cuda", remedies=REMEDIES, progress=None) -> dict:
    """The same diagnosis at workload ``w`` (the GPU's, e.g. ``qwen05-b2s512``) without the device:
    the plain step and every remedy under fake tensors (``ledger_measure.Session(fake=True)``, the
    settings of ``like``: fused AdamW and CUDA's offload threshold), predicted against estimated
    saving. Evidence level ``estimated``: a check of the attribution at full size, not a measurement."""
    from bp_mech.ledger import LedgerConfig

    progress = progress or (lambda it, **kw: it)
    session = ledger_measure.Session(w, "cpu", fake=True, options=LedgerConfig().for_device(like))
    plain = session.measure(PLAIN)
    rows = diagnosis.ledger_rows(plain)
    by_name = {r.name: r for r in remedies}
    out = []
    for a in progress(diagnosis.rank(rows, w, like, remedies), desc="estimates"):
        led = session.measure(by_name[a["remedy"]].strategy)
        out.append(dict(remedy=a["remedy"], line=a["line"], line_at_peak=a["line_at_peak"],
                        predicted_saving=a["predicted_saving"], estimated_saving=plain.peak - led.peak,
                        error=(a["predicted_saving"] - plain.peak + led.peak) / plain.peak,
                        estimated_peak_point=diagnosis.peak_point(diagnosis.ledger_rows(led))))
    return dict(workload_id=w.workload_id, evidence_level="estimated", memory_source="fake-tensor", like=like,
                peak=plain.peak, dominant=diagnosis.dominant_state(rows), ledger=rows, remedies=out)


def outcome(d: Diagnosis, a: dict) -> dict:
    """Predicted against measured saving of one ranked remedy ``a`` (bytes; errors as a share of the
    plain peak), the decision by ``ATTRIBUTION_TOL`` and, where it fails, why."""
    led, failure = d.measured.get(a["remedy"], (None, "not measured"))
    base = dict(remedy=a["remedy"], line=a["line"], predicted_saving=a["predicted_saving"],
                naive_saving=a["naive_saving"], failure=failure)
    if led is None:
        return dict(base, measured_saving=None, error=None, decision=None, next_step=f"failed: {failure}")
    plain_peak, peak = peak_of(d.plain, d.device), peak_of(led, d.device)
    measured = plain_peak - peak
    error = (a["predicted_saving"] - measured) / plain_peak
    point = diagnosis.peak_point(diagnosis.ledger_rows(led))
    ok = abs(error) <= ATTRIBUTION_TOL
    why = None if ok else (f"the prediction misses by {error:+.1%} of the plain peak (tolerance "
                           f"{ATTRIBUTION_TOL:.0%}); after the remedy the peak is {POINT_LABELS[point]} (predicted: "
                           f"{POINT_LABELS[a['predicted_peak_point']]})")
    return dict(base, peak=peak, measured_saving=measured, error=error,
                naive_error=(a["naive_saving"] - measured) / plain_peak, measured_peak_point=point,
                predicted_peak_point=a["predicted_peak_point"],
                decision="accept" if ok else "tune", next_step=why)


def summary(d: Diagnosis) -> dict:
    """The diagnosis of the plain step as record metrics (JSON-safe)."""
    p = d.profile
    return json_safe(dict(
        dominant=d.dominant, ledger=d.rows, profiler_stages=p.stages, cross_check=d.cross, known_lines=d.known,
        residual=d.residual, backward_moment=diagnosis.backward_moment(d.rows["backward_peak"], d.known),
        operators=p.operators, self_total_us=p.self_total_us, phase_us=p.phase_us, step_us_profiled=p.step_us,
        profiled_steps=len(p.phases) // len(step_profile.PHASES), profiler_extra=p.extra,
        ranked=[{k: v for k, v in a.items() if k != "changes"} for a in d.ranked]))


def run(ctx) -> list:
    """One record for the plain step (the diagnosis in ``metrics``), one per remedy (predicted against
    measured saving, the decision by ``ATTRIBUTION_TOL``)."""
    w, dev = ctx.workload, ctx.device
    d = diagnose(w, dev, progress=ctx.progress)
    gpu = dev == "cuda"

    def fields(led):
        reserved = [v for k, v in led.allocator.items() if k.endswith("_reserved")] if gpu else []
        return dict(peak_allocated=peak_of(led, dev), memory_source=ctx.memory_source, updates=led.updates,
                    update_count=led.updates - (led.skipped or 0), skipped_updates=led.skipped,
                    all_finite=led.finite, peak_reserved=max(reserved, default=None))

    top = d.ranked[0]["remedy"] if d.ranked else None
    metrics = summary(d)
    if not gpu and not ctx.smoke:  # the attribution at the GPU workload's full size, under fake tensors
        from bp_mech.bench.workload import parse_workload

        metrics["at_gpu_workload"] = json_safe(estimate_at(parse_workload(ctx.experiment.gpu_workload),
                                                           progress=ctx.progress))
    recs = [ctx.record("plain", **fields(d.plain), next_step=f"apply {top} (largest predicted saving)" if top else None,
                       metrics=metrics)]
    for r in REMEDIES:
        if why := r.unfit(w):
            recs.append(ctx.record(r.name, failure=why, memory_source=ctx.memory_source,
                                   next_step="pick a batch the micro-batches divide"))
    for a in d.ranked:
        o = outcome(d, a)
        led, _ = d.measured[a["remedy"]]
        extra = fields(led) if led is not None else dict(memory_source=ctx.memory_source)
        recs.append(ctx.record(a["remedy"], **extra, failure=o["failure"], decision=o["decision"],
                               next_step=o["next_step"],
                               metrics=json_safe(dict(o, attribution=dict(a)))))
    return recs


PROFILER_OVERHEAD = 3  # planning: a profiled step (stacks, shapes, memory) costs about 3 plain passes
PROFILE_ANALYSIS_S = {"cpu": 3.0, "cuda": 10.0}  # planning: the memory profiler's analysis of one active step
ESTIMATE_S = 40.0  # planning: --mode cpu's full-size estimate (qwen05-b2s512 under fake tensors, 6 strategies)


def plan(ctx) -> dict:
    """The dry-run plan: the profiler schedule, the remedies, the decision rule and an estimate of the
    seconds per mode: two model builds (the profiled one, the ledgers' session), the profiled steps at
    ``PROFILER_OVERHEAD`` x a plain pass and their analysis, two updates per ledger (a warm-up and the
    measured one), and on the CPU the full-size estimate (not in a smoke run)."""
    from bp_mech.experiments.harness import plan_per_mode
    from bp_mech.bench.workload import PLAN_BASIS, PLAN_BUILD_S, plan_seconds

    w, cfg = ctx.workload, ProfileConfig()
    tokens, ledgers = w.batch * w.seq, 1 + len(REMEDIES)

    def fields(dev):
        secs = (2 * PLAN_BUILD_S[dev] + plan_seconds(w.arch, tokens, PROFILER_OVERHEAD * cfg.steps, dev)
                + PROFILE_ANALYSIS_S[dev] * cfg.active + plan_seconds(w.arch, tokens, 2 * ledgers, dev)
                + (ESTIMATE_S if dev == "cpu" and not ctx.smoke else 0.0))
        return dict(profiler_schedule=dict(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active),
                    full_size_estimate=dev == "cpu" and not ctx.smoke, estimated_seconds=round(secs, 1))

    return dict(remedies={r.name: dict(line=r.line, how=r.how) for r in REMEDIES},
                profiler=dict(profile_memory=True, record_shapes=True, with_stack=True),
                decision_rule=f"accept when |predicted - measured saving| <= {ATTRIBUTION_TOL:.0%} of the plain peak",
                estimate_basis=PLAN_BASIS + f"; profiled steps at {PROFILER_OVERHEAD} x a pass, + the memory "
                               "profiler's analysis per active step", modes=plan_per_mode(fields))


# --- figures ---------------------------------------------------------------------------------------

CATEGORY_COLORS = dict(parameter="darkgreen", optimizer_state="goldenrod", gradient="mediumblue",
                       activation="red", autograd_detail="royalblue", temporary="mediumpurple", input="black",
                       unknown="grey")  # torch's own memory-timeline colours
# each ledger class in the colour of the category it maps to (diagnosis.CATEGORY_TO_CLASS); logits & loss apart
LEDGER_COLORS = dict(parameters="darkgreen", optimizer_states="goldenrod", gradients="mediumblue",
                     saved_activations="red", logits_loss="darkorange", other="grey")


def plot_memory_timeline(p: step_profile.StepProfile, title: str):
    """The profiler's live bytes by category over the active steps (stacked), the phases marked."""
    fig, ax = figure(7.5, 3.8)
    t = [x / 1e3 for x in p.times_us]
    scale = 2**20
    ax.stackplot(t, *[[b / scale for b in p.bytes_by_category[c]] for c in CATEGORIES],
                 labels=[c.replace("_", " ") for c in CATEGORIES], colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
                 step="post", alpha=0.85)
    width = max(end for _, _, end in p.phases)
    for i, (name, start, end) in enumerate(p.phases):
        ax.axvspan(start / 1e3, end / 1e3, color="grey", alpha=0.08 if i % 2 else 0.0)
        if end - start > 0.05 * width:  # (zero_grad is too short to label)
            ax.text((start + end) / 2e3, ax.get_ylim()[1] * 0.97, name, ha="center", va="top", fontsize=7)
    ax.set_xlabel("time since the first profiled step (ms, under the profiler)")
    ax.set_ylabel("live bytes (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_operators(p: step_profile.StepProfile, title: str):
    """The top operators by self time per step (horizontal bars, largest on top)."""
    fig, ax = figure(7.0, 0.35 * len(p.operators) + 1.2)
    ops = list(reversed(p.operators))
    short = [o["name"].replace("aten::", "") for o in ops]
    ax.barh(range(len(ops)), [o["self_us"] / 1e3 for o in ops], color="tab:blue")
    ax.set_yticks(range(len(ops)), [n if len(n) <= 28 else n[:10] + "…" + n[-17:] for n in short])
    for i, o in enumerate(ops):
        ax.text(o["self_us"] / 1e3, i, f" {o['share']:.1%}", va="center", fontsize=7)
    ax.set_xlim(0, 1.2 * max((o["self_us"] / 1e3 for o in ops), default=1.0))
    ax.set_xlabel(f"self {'CPU' if p.device == 'cpu' else 'device'} time per step (ms, under the profiler)")
    ax.set_title(title)
    return fig


def plot_cross_check(rows: dict, profiled: dict, title: str):
    """At each point the profiler has: the ledger's classes (left bar) beside the profiler's categories
    (right bar), stacked, in MiB."""
    fig, ax = figure(7.5, 3.8)
    points = list(profiled)
    for i, pt in enumerate(points):
        bottom = 0.0
        for c in CLASSES:
            v = rows[pt][c] / 2**20
            ax.bar(i - 0.2, v, 0.38, bottom=bottom, color=LEDGER_COLORS[c], label=CLASS_LABELS[c] if i == 0 else None)
            bottom += v
        bottom = 0.0
        for c in CATEGORIES:
            v = profiled[pt].get(c, 0) / 2**20
            ax.bar(i + 0.2, v, 0.38, bottom=bottom, color=CATEGORY_COLORS[c], hatch="//", edgecolor="white",
                   label=f"profiler: {c.replace('_', ' ')}" if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(points)), [POINT_LABELS[p].replace("in the ", "").replace(" ", "\n", 1) for p in points],
                  fontsize=7)
    ax.set_ylabel("live bytes (MiB): ledger | profiler")
    ax.set_title(title)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_savings(outcomes: list[dict], title: str):
    """Per remedy: the naive, the predicted and the measured saving at the peak (MiB)."""
    fig, ax = figure(7.0, 3.6)
    names = [o["remedy"] for o in outcomes]
    for k, (key, label) in enumerate((("naive_saving", "naive (peak stays)"), ("predicted_saving", "predicted"),
                                      ("measured_saving", "measured"))):
        ax.bar([i + (k - 1) * 0.27 for i in range(len(names))], [(o[key] or 0) / 2**20 for o in outcomes], 0.26,
               label=label)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("peak saving (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
