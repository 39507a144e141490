"""Part 02 · 11 — TRAIN-GRADIENT-ACCUMULATION, the experiment: the full batch against 2 and 4
micro-batches (``bp_mech.accumulation``) on the same padded data and the same initial weights, at two
sequence lengths.

The arms are the strategies ``plain`` (the full batch), ``micro2`` and ``micro4``. Per arm it records
the loss, gradient and parameter differences to the full batch (the equivalence run,
``experiments.accumulation_updates``: token-weighted through the one training step under the
arm's strategy, naive through the chapter's ``accumulation.accumulated_backward``, the mistake
shown), the absolute and incremental peak, and the step median/P95 of the one training step
(``bench.step.train_step`` under the arm's strategy: Transformers' token-weighted loss over k
micro-batches). The measurement is the harness's
(``harness.measure``, own weights): on the CPU every arm gets its own model copy and AdamW, alive
together, timed interleaved on one intra-op thread; on CUDA they run one after another on the one
model. A micro-batch arm does strictly more work than the full batch (k passes for one update), so
measuring it faster is noise (``bench.timing.timing_noise``). ``updates`` counts the optimizer steps of
an arm's runs: the token-weighted equivalence run, the naive one (micro-batch arms) and the measurement
(warm, tracked, warm-up and timed steps); ``metrics.updates_by_run`` splits them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from bp_mech import accumulation, accumulation_framework
from bp_mech.bench.compare import relative_l2
from bp_mech.bench.oom import Failed, attempt
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.bench.timing import SMOKE_SCHEDULE, timing_noise
from bp_mech.instruments.workload import Workload, build_model
from bp_mech.instruments.adamw import make_adamw
from bp_mech.experiments.accumulation_updates import train_updates
from bp_mech.experiments.dry_run import own_weights_modes, steps_per_arm
from bp_mech.experiments import decision, harness
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

CANDIDATES = ("plain", "micro2", "micro4")  # strategy names: the full batch, 2 and 4 micro-batches
ARMS = {name: parse(name) for name in CANDIDATES}
MICRO = {name: s.micro_batches for name, s in ARMS.items()}  # micro-batches per update

# Decision rule (per micro-batch candidate and sequence length, against the full batch):
#   reject  if the token-weighted first gradient differs from the full batch's by more than
#           EQUIV_TOL (relative, global L2);
#   tune    if the peak saving (1 - peak / the full batch's peak) is below decision.MIN_PEAK_SAVING, the
#           floor every memory strategy shares (whatever the time);
#   none    if the time ratio is noise (``measure.timing_noise``), or the candidate failed;
#   accept  if the median step rises by at most MAX_TIME_COST;
#   tune    otherwise: correct, but it saves too little memory for its time (use it only when
#           the full batch does not fit).
# The gradient, not the parameters: AdamW's first step is about lr * sign(g) per element, so an
# element whose gradient is within rounding of zero may step 2 lr the other way; the parameter
# difference this makes grows with the model (sqrt of the element count) and is only reported.
EQUIV_TOL = {"cpu": 1e-5, "cuda": 1e-4}  # float32 ||g - g_full|| / ||g_full||, first update
MAX_UPDATE_DIFF = 0.05  # parameters after AdamW, ||a - b|| / ||update||: an eps-level gradient may flip a 2 lr step
MAX_TIME_COST = 0.50



@dataclass(frozen=True)
class AccumConfig:
    micro_max: int = 4  # finest split; effective batch E = workload.batch * micro_max
    updates: int = 3  # updates of the equivalence run (same E-sequence batches for every candidate)
    lr: float = 1e-3  # AdamW learning rate
    timed: int = 60  # timed steps per candidate, one update each (CPU: interleaved rounds)
    warmup: int = 3  # untimed steps (rounds) before them; the CPU runs one tracked update (the peak) first
    max_pad_fraction: float = 0.75  # each row loses a random share in [0, this) of its tail to padding
    short_divisor: int = 2  # the second sequence length is seq // short_divisor


def config_for(device, smoke: bool = False) -> AccumConfig:
    if smoke:
        return AccumConfig(timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1])
    return AccumConfig(timed=20, warmup=2) if torch.device(device).type == "cuda" else AccumConfig()


def seq_lengths(w: Workload, cfg: AccumConfig) -> list[int]:
    return sorted({max(2, w.seq // cfg.short_divisor), w.seq})


# --- the equivalence run ---------------------------------------------------------------

def equivalence(model, init: dict, batches, cfg: AccumConfig, device) -> dict:
    """Each candidate and normalisation against the full batch: {candidate: {norm: diffs}}."""
    ref = train_updates(model, init, batches, 1, "token", cfg, device)
    p0 = [init[n] for n, _ in model.named_parameters()]  # tied weights appear once
    ref_last = accumulation.snapshot(model.parameters())
    zero = dict.fromkeys(("loss_rel_diff", "grad_rel_diff", "param_rel_diff_1", "param_rel_diff",
                          "param_diff_vs_update"), 0.0)
    out = {PLAIN.name: {"token": dict(zero, finite=ref["finite"], losses=ref["losses"]), "naive": None}}
    for name in CANDIDATES[1:]:
        out[name] = {}
        for norm in ("token", "naive"):
            r = train_updates(model, init, batches, MICRO[name], norm, cfg, device)
            out[name][norm] = dict(
                finite=r["finite"], losses=r["losses"],
                loss_rel_diff=abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0]),
                grad_rel_diff=relative_l2(r["grad"], ref["grad"]),
                param_rel_diff_1=relative_l2(r["params_1"], ref["params_1"]),
                param_rel_diff=relative_l2(model.parameters(), ref_last),
                param_diff_vs_update=relative_l2(model.parameters(), ref_last, p0),
            )
    return out


# --- the measured step ---------------------------------------------------------------

def measure(model, init: dict, batches, cfg: AccumConfig, device, progress=None, together: bool | None = None):
    """``harness.measure`` of every arm (own weights): on the CPU each its own copy of ``model``, on CUDA the
    one model reloaded from ``init``; each with its AdamW and one warm update under its strategy (the
    optimizer's state exists before anything is measured). ``{name: Measured | Failed}``.

    ``Measured.resident_bytes`` is the parameters and the AdamW state (exp_avg, exp_avg_sq, step) that
    exist before a step: the incremental peak, absolute peak minus that, is what the step itself adds
    (gradients, activations, logits, temporaries, the batch, library workspaces)."""
    def prepare(name, together):
        m = copy.deepcopy(model) if together else model
        m.load_state_dict(init)
        m.zero_grad(set_to_none=True)
        run = harness.Run.of(m, make_adamw(m.parameters(), cfg.lr, device), batches, ARMS[name])
        run.step(-1)  # the warm update: the optimizer's state exists before anything is measured
        return run

    return harness.measure(CANDIDATES, prepare, device, cfg.timed, cfg.warmup, together=together, progress=progress)


def decide(equiv_diff: float | None, tol: float, peak_saving: float | None, time_ratio: float | None,
           noise: str | None = None) -> Decision:
    """A micro-batch arm's decision against the full batch, by the rule above.

    Args:
        equiv_diff: the token-weighted first gradient's relative L2 difference from the full batch's.
        tol: its bound (``EQUIV_TOL`` of the device).
        peak_saving: 1 - peak / the full batch's (None: no full-batch measurement).
        time_ratio: median step / the full batch's (None: no full-batch measurement).
        noise: why the time ratio is noise (``bench.timing.timing_noise``), or None.

    Returns:
        The ``Decision``; its reason names the numbers that fired the rule.

    Example:
        >>> decide(2e-5, 1e-5, 0.3, 1.1).reason
        'token-weighted gradient off the full batch by 2.00e-05 > EQUIV_TOL 1e-05'
    """
    if equiv_diff is None or equiv_diff > tol:
        off = "not compared" if equiv_diff is None else f"off the full batch by {equiv_diff:.2e} > EQUIV_TOL {tol:g}"
        return Decision("reject", f"token-weighted gradient {off}", "fix the loss normalisation")
    if peak_saving is None or time_ratio is None:
        return Decision(None, "no full-batch measurement to compare with (it failed)", "see the failure field")
    saving = f"correct (gradient within {equiv_diff:.1e}), peak saving {peak_saving:.1%}"
    if peak_saving < decision.MIN_PEAK_SAVING:
        return Decision("tune", f"{saving} < MIN_PEAK_SAVING {decision.MIN_PEAK_SAVING:.0%}",
                        "the peak barely falls: prefer the full batch while it fits")
    if noise is not None:
        return Decision(None, f"{saving}, but the time ratio {time_ratio:.2f}x is noise ({noise})",
                        "time it on the target GPU or a quiet machine")
    rise = f"the median step rises by {time_ratio - 1:.0%}"
    if time_ratio - 1 <= MAX_TIME_COST:
        return Decision("accept", f"{saving}; {rise} (<= MAX_TIME_COST {MAX_TIME_COST:.0%})",
                        "use it when the full batch does not fit; it saves memory at a bounded time cost")
    return Decision("tune", f"{saving}, but {rise} (> MAX_TIME_COST {MAX_TIME_COST:.0%})",
                    "the saving does not pay for the time: prefer the full batch while it fits")


def run(ctx) -> list:
    cfg, dev = config_for(ctx.device, ctx.smoke), ctx.device
    model = build_model(ctx.workload, dev)
    init = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    recs = []
    for seq in ctx.progress(seq_lengths(ctx.workload, cfg), desc="sequence lengths"):
        w = ctx.workload.replace(seq=seq)  # its own workload_id and run label: never merged
        sub = dataclasses.replace(ctx, workload=w, run_label=f"{ctx.run_label}-s{seq}", _base=None)
        batches = [{k: v.to(dev) for k, v in b.items()}
                   for b in accumulation.padded_batches(w, max(cfg.updates, 2), cfg.micro_max, cfg.max_pad_fraction)]
        eq = attempt(equivalence, model, init, batches[:cfg.updates], cfg, dev)
        eq, eq_failure = (None, eq.failure) if isinstance(eq, Failed) else (eq, None)
        measured = measure(model, init, batches, cfg, dev, progress=ctx.progress)
        recs += [arm_record(sub, name, cfg, batches, (eq or {}).get(name), measured[name], measured[PLAIN.name],
                            eq_failure) for name in CANDIDATES]
    return recs


def arm_record(ctx, name: str, cfg: AccumConfig, batches, eq: dict | None, m, base, eq_failure: str | None):
    """One arm's record: equivalence (token + naive), measurement, ratios against the full batch, decision."""
    eq = json_safe(eq)
    tok = (eq or {}).get("token") or {}
    failure = m.failure if isinstance(m, Failed) else eq_failure
    m = m if isinstance(m, harness.Measured) else None
    base = base if isinstance(base, harness.Measured) else None
    compared = m is not None and base is not None
    peak_saving = 1 - m.peak.allocated / base.peak.allocated if compared else None
    time_ratio = m.timing.median_s / base.timing.median_s if compared else None
    noise = timing_noise(m.timing, base.timing, more_work=True) if compared and name != PLAIN.name else None
    if failure:
        decided = Decision.failed(failure)
    elif name == PLAIN.name:
        decided = Decision(None, "the baseline", "every other arm is compared with it")
    else:
        decided = decide(tok.get("grad_rel_diff"), EQUIV_TOL[torch.device(ctx.device).type], peak_saving, time_ratio,
                         noise)
    k, E = MICRO[name], ctx.workload.batch * cfg.micro_max
    by_run = dict(equivalence_token=cfg.updates if eq else None,
                  equivalence_naive=(cfg.updates if eq else None) if name != PLAIN.name else 0,
                  measurement=m and m.updates)  # the warm update, then the measured steps
    ran = [n for n in by_run.values() if n is not None]
    measured = m.record_fields() if m else dict(memory_source=None)
    measured.update(updates=sum(ran) if ran else None, skipped_updates=0 if ran else None)
    return ctx.record(
        name, strategy=name, input_shape=[E // k, ctx.workload.seq], effective_batch=E, **measured,
        output_error=tok.get("loss_rel_diff"), grad_error=tok.get("grad_rel_diff"), all_finite=tok.get("finite"),
        timing_noise=noise, failure=failure, **decided.record_fields(),
        metrics=dict(
            micro_batches=k, micro_batch_size=E // k, seq=ctx.workload.seq, lr=cfg.lr, timed_steps=cfg.timed,
            target_tokens=[[int(accumulation.count_targets(mb["labels"])) for mb in accumulation.split(b, k)]
                           for b in batches],
            resident_bytes=m and m.resident_bytes,
            incremental_peak=m and m.peak.allocated - m.resident_bytes, updates_by_run=by_run,
            peak_saving=peak_saving, time_ratio=time_ratio,
            p95_ratio=m.timing.p95_s / base.timing.p95_s if compared else None,
            step_samples_s=m and m.timing.samples, wall_samples_s=m and m.timing.wall_samples,
            interleaved=m and m.timing.interleaved, token=tok or None, naive=(eq or {}).get("naive"),
            rule=dict(EQUIV_TOL=EQUIV_TOL[torch.device(ctx.device).type], MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING,
                      MAX_TIME_COST=MAX_TIME_COST)))


def dry_run(ctx) -> dict:
    """Workloads, steps and, per mode, an estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, seqs = ctx.workload, seq_lengths(ctx.workload, AccumConfig())

    def mode_schedule(dev):
        cfg = config_for(dev, ctx.smoke)
        E, updates = w.batch * cfg.micro_max, 1 + steps_per_arm(cfg.timed, cfg.warmup)  # warm + measured
        # equivalence: full once, each micro arm twice (token, naive); k micro-batch passes per update
        passes = {c: MICRO[c] * (cfg.updates * (1 if c == PLAIN.name else 2) + updates) for c in CANDIDATES}
        seconds = sum(dry_run_seconds(w.arch, E * s // MICRO[c], n, dev) for s in seqs for c, n in passes.items())
        loads = 8 * len(seqs) * (0.5 if dev == "cuda" else 0.0)  # load_state_dict from the host copy
        return cfg.timed, cfg.warmup, dict(equivalence_updates=cfg.updates,
                                           estimated_seconds=round(ASSUMED_BUILD_S[dev] + seconds + loads, 1))

    return dict(workloads=[w.replace(seq=s).workload_id for s in seqs],
                run_labels=[f"{ctx.run_label}-s{s}" for s in seqs],
                effective_batch=w.batch * AccumConfig.micro_max, micro_batches=dict(MICRO), optimizer="AdamW",
                normalisations=["token-weighted", "naive mean of means"], lr=AccumConfig.lr,
                modes=own_weights_modes(mode_schedule),
                estimate_basis=ASSUMED_BASIS + "; + 0.5 s per state load from the host (cuda)",
                rule=dict(EQUIV_TOL=EQUIV_TOL, MIN_PEAK_SAVING=decision.MIN_PEAK_SAVING, MAX_TIME_COST=MAX_TIME_COST))


def conformance():
    """The hand-written loop vs ``accumulation_framework.accelerate_updates``: first gradient and final parameters."""
    from bp_mech.records.registry import ConformanceRow
    from bp_mech.instruments.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    cfg = AccumConfig(updates=2)
    batches = accumulation.padded_batches(w, cfg.updates, cfg.micro_max, cfg.max_pad_fraction)
    model = build_model(w)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    worst, update_worst, finite = 0.0, 0.0, True
    p0 = [init[n] for n, _ in model.named_parameters()]
    for k in (2, 4):
        ours = train_updates(model, init, batches, k, "token", cfg, "cpu")
        ours_params, finite = accumulation.snapshot(model.parameters()), finite and ours["finite"]
        first_grad = accumulation_framework.accelerate_updates(model, init, batches, k, cfg.lr)
        worst = max(worst, relative_l2(first_grad, ours["grad"]))
        # the same float32 operations in the same order (Transformers' loss is cross_entropy(sum) / N over
        # the shifted labels, as ours; Accelerate's * k then / k is exact for k a power of two): the
        # differences come out 0. The tolerances only guard a library version that sums in another order,
        # which AdamW would turn, at an element with |g| ~ eps, into a step of up to 2 lr (see the tests)
        update_worst = max(update_worst, relative_l2(model.parameters(), ours_params, p0))
    return ConformanceRow("Part 02 · 11", "TRAIN-GRADIENT-ACCUMULATION",
                          "Accelerate Accelerator(gradient_accumulation_steps=k).accumulate + num_items_in_batch",
                          worst <= EQUIV_TOL["cpu"] and update_worst <= MAX_UPDATE_DIFF and finite,
                          f"first gradient, k = 2 and 4, padded uneven micro-batches: max rel. difference {worst:.2e} "
                          f"(tol {EQUIV_TOL['cpu']:g}, float32); parameters after {cfg.updates} AdamW updates, "
                          f"relative to the update: {update_worst:.2e} (tol {MAX_UPDATE_DIFF:g})")
