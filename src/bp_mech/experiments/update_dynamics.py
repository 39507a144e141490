"""Part 02 · 55 — TRAIN-UPDATE-DYNAMICS, the experiment: base LR / high LR without clipping / high LR
with global-norm clipping (the mechanism: ``bp_mech.update_dynamics``).

The three candidates run the same number of AdamW updates from the same initial weights on the same
batches (``trace``). Per update it records finiteness of the loss and of every gradient, the total
gradient norm before clipping, the clip coefficient, per parameter group the update norm and the
update-to-parameter ratio, and the loss. This is local stability over a few updates. It is not a
quality evaluation: a candidate that stays finite and lowers the training loss here still needs a
held-out evaluation.

Every step is the one training step (``bench.step.train_step``, plain strategy; clipping through its
``max_norm``); the trace watches it with an observer (``TraceObserver``) that reads the gradients and
the parameters around the optimizer's phase. Step time and peak come from a separate run on the
harness (``harness.measure``, own weights): on the CPU every arm gets its own model copy and AdamW,
alive together, timed interleaved on one intra-op thread; on CUDA they run one after another on the
one model. The arms do the same work, except that clipping adds a global norm and a scaling: the
clipped arm's time is compared with the unclipped high LR's (strictly more work, so measuring it faster
is noise), the high LR's with the base LR's. The decision never depends on the time. ``updates`` counts
the optimizer steps of an arm's runs: the traced updates and the measurement's (warm, tracked, warm-up
and timed steps); ``metrics.updates_by_run`` splits them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import dataclasses
import statistics
from dataclasses import dataclass

import torch

from bp_mech import update_dynamics
from bp_mech.bench.compare import all_finite
from bp_mech.bench.oom import Failed, attempt
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.step import train_step
from bp_mech.bench.strategy import PLAIN
from bp_mech.bench.timing import SMOKE_SCHEDULE, timing_noise
from bp_mech.instruments.workload import build_model, make_batches, param_count
from bp_mech.experiments import harness
from bp_mech.experiments.dry_run import own_weights_modes, steps_per_arm
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

CANDIDATES = ("base_lr", "high_lr", "high_lr_clip")
TIME_BASELINE = {"high_lr": "base_lr", "high_lr_clip": "high_lr"}  # the step each one's time is compared with

# Decision rule (per candidate), from its own trace (reasons: bp_mech.book.rules):
#   reject  if any update had a non-finite loss or gradient;
#   tune    if the loss spiked (some update's loss exceeds the lowest earlier loss by more than
#           SPIKE_MAX nats) or the last loss is not below the first; or if one update moved a
#           parameter group by more than MAX_UPDATE_RATIO of its norm; or if a gradient norm
#           exceeds GRAD_SPIKE_MAX times the median of the earlier updates' norms;
#   accept  otherwise. Local stability only.
SPIKE_MAX = 0.5
MAX_UPDATE_RATIO = 0.1  # ||delta p|| / ||p|| of a group in one update
GRAD_SPIKE_MAX = 2.0  # a gradient norm over the median of the earlier ones
RULE_OF_THUMB_RATIO = 1e-3  # CS231n's healthy update ratio (the figure's lower edge; decides nothing)
RULE = dict(SPIKE_MAX=SPIKE_MAX, MAX_UPDATE_RATIO=MAX_UPDATE_RATIO, GRAD_SPIKE_MAX=GRAD_SPIKE_MAX)


@dataclass(frozen=True)
class DynamicsConfig:
    base_lr: float = 1e-3  # AdamW learning rate of "base_lr"
    high_factor: float = 100.0  # "high_lr" and "high_lr_clip" use base_lr * high_factor
    max_norm: float = 1.0  # global-norm clipping threshold of "high_lr_clip"
    weight_decay: float = 0.1  # on the embedding, attention and MLP matrices; 0 on norms and biases
    updates: int = 20  # updates of the traced run, per candidate
    timed: int = 60  # timed steps per candidate (separate run, no snapshots; CPU: interleaved rounds)
    warmup: int = 3  # untimed steps (rounds) before them; the CPU runs one tracked update (the peak) first


def config_for(arch: str, device: str, smoke: bool = False) -> DynamicsConfig:
    """qwen05 gets a base LR typical of pretraining a 0.5B model; the GPU times more steps."""
    base = 1e-4 if arch == "qwen05" else 1e-3
    if smoke:
        return DynamicsConfig(base_lr=base, timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1], updates=4)
    gpu = torch.device(device).type == "cuda"
    return DynamicsConfig(base_lr=base, timed=20, warmup=2) if gpu else DynamicsConfig(base_lr=base)


def lr_of(name: str, cfg: DynamicsConfig) -> float:
    return cfg.base_lr if name == "base_lr" else cfg.base_lr * cfg.high_factor


def optimizer(model, name: str, cfg: DynamicsConfig, device):
    """The candidate's AdamW (``update_dynamics.grouped_adamw``: weight decay by parameter group)."""
    return update_dynamics.grouped_adamw(model, lr_of(name, cfg), cfg.weight_decay, device)


def max_norm_of(name: str, cfg: DynamicsConfig) -> float | None:
    """The clipping threshold of an arm (None: no clipping)."""
    return cfg.max_norm if name == "high_lr_clip" else None


class TraceObserver:
    """An observer of ``train_step``: around the optimizer's phase, the gradients' finiteness and total
    norm before clipping, and per parameter group the update norm and the update-to-parameter ratio."""

    def __init__(self, model) -> None:
        self.groups = update_dynamics.param_groups(model)
        self.row: dict = {}

    @contextlib.contextmanager
    def __call__(self, phase: str, state):
        if phase != "optimizer":
            yield
            return
        params = list(state.model.parameters())
        total = update_dynamics.global_grad_norm(p.grad for p in params)
        finite = all_finite(p.grad for p in params)
        before = {g: [p.detach().clone() for p in ps] for g, ps in self.groups.items()}
        yield
        self.row = dict(finite=finite, grad_norm=total.item(), groups={})
        for g, ps in self.groups.items():
            du, pn, r = update_dynamics.update_ratio(before[g], ps)
            self.row["groups"][g] = dict(update_norm=du, param_norm=pn, ratio=r)


def trace(model, init: dict, batches, name: str, cfg: DynamicsConfig,
          device) -> list[dict]:
    """``len(batches)`` updates of one arm from ``init``; one dict per update."""
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)  # after a failed arm, stale gradients may remain
    opt = optimizer(model, name, cfg, device)
    observe, out = TraceObserver(model), []
    clip = max_norm_of(name, cfg)
    for b in batches:
        loss = train_step(model, opt, b, observers=[observe], max_norm=clip).loss.item()
        row = observe.row
        norm = torch.tensor(row["grad_norm"])
        coef = update_dynamics.clip_coefficient(norm, cfg.max_norm).item()
        out.append(dict(loss=loss, finite=math.isfinite(loss) and row["finite"],
                        grad_norm=row["grad_norm"],
                        clip_coef=coef if name == "high_lr_clip" else 1.0,
                        would_clip=coef, groups=row["groups"]))
    return out


def measure(model, init: dict, batches, cfg: DynamicsConfig, device, progress=None, together: bool | None = None):
    """``harness.measure`` of every arm (own weights): on the CPU each its own copy of ``model``; on CUDA the
    one model, reloaded from ``init``; each with its AdamW and one warm update (which creates the optimizer
    state). ``{name: Measured | Failed}``."""
    def prepare(name, together):
        m = copy.deepcopy(model) if together else model
        m.load_state_dict(init)
        m.zero_grad(set_to_none=True)
        run = harness.Run.of(m, optimizer(m, name, cfg, device), batches, PLAIN, max_norm=max_norm_of(name, cfg))
        run.step(-1)  # the warm update
        return run

    return harness.measure(CANDIDATES, prepare, device, cfg.timed, cfg.warmup, together=together, progress=progress)


def grad_spike(norms: list[float]) -> float:
    """The largest ratio of a gradient norm to the median of the earlier ones (1.0 for one update).

    >>> grad_spike([2.0, 1.0, 3.0, 8.0])  # 8 against the median of 2, 1, 3
    4.0
    """
    def ratio(now, earlier):
        return now / earlier if earlier > 0 else (math.inf if now > 0 else 1.0)

    return max((ratio(norms[t], statistics.median(norms[:t])) for t in range(1, len(norms))), default=1.0)


@dataclass(frozen=True)
class Summary:
    """The scalars of one arm's trace: what the rule reads, and what its record keeps (``metrics.summary``)."""

    all_finite: bool  # every update's loss and gradients finite
    first_nonfinite: int | None  # the first update that was not (None: every one was)
    first_loss: float  # the first update's loss
    last_loss: float  # the last update's loss
    max_loss: float  # the largest loss
    spike: float  # the largest rise of a loss above the lowest earlier one, nats
    clipped_updates: int  # updates whose clip coefficient is below 1
    max_grad_norm: float  # the largest gradient norm before clipping
    grad_spike: float  # the largest gradient norm over the median of the earlier ones (``grad_spike``)
    max_ratio: dict[str, float]  # per parameter group, the largest ||delta p|| / ||p|| of one update
    max_ratio_at: dict  # where the largest of them happened: {"update": index, "group": name}


def summarize(rows: list[dict]) -> Summary:
    """The ``Summary`` of a trace (``trace``'s rows, or a record's ``metrics.trace``)."""
    losses = [r["loss"] for r in rows]
    spike = max((losses[t] - min(losses[:t]) for t in range(1, len(losses))), default=0.0)
    where = max(((r["groups"][g]["ratio"], t, g) for t, r in enumerate(rows) for g in r["groups"]),
                key=lambda x: -math.inf if math.isnan(x[0]) else x[0])
    return Summary(all_finite=all(r["finite"] for r in rows),
                   first_nonfinite=next((i for i, r in enumerate(rows) if not r["finite"]), None),
                   first_loss=losses[0], last_loss=losses[-1], max_loss=max(losses), spike=spike,
                   clipped_updates=sum(r["clip_coef"] < 1.0 for r in rows),
                   max_grad_norm=max(r["grad_norm"] for r in rows),
                   grad_spike=grad_spike([r["grad_norm"] for r in rows]),
                   max_ratio={g: max(r["groups"][g]["ratio"] for r in rows) for g in rows[0]["groups"]},
                   max_ratio_at=dict(update=where[1], group=where[2]))


def decide(s: Summary) -> Decision:
    """An arm's decision from its own trace, by the rule above.

    Args:
        s: the trace's ``Summary``.

    Returns:
        The ``Decision``; its reason names every number that fired the rule.

    Example:
        >>> s = Summary(True, None, 3.0, 2.0, 3.9, 0.9, 0, 1.0, 1.0, {"matrices": 0.01}, dict(update=1, group="matrices"))
        >>> decide(s).reason
        'finite, but the loss spiked by 0.90 nats (> SPIKE_MAX 0.5)'
    """
    if not s.all_finite or not all(math.isfinite(x) for x in (s.first_loss, s.last_loss, s.spike)):
        return Decision("reject", f"non-finite from update {s.first_nonfinite}", "lower the LR (clipping did not hold it)")
    why = []
    if s.spike > SPIKE_MAX:
        why.append(f"the loss spiked by {s.spike:.2f} nats (> SPIKE_MAX {SPIKE_MAX:g})")
    if s.last_loss >= s.first_loss:
        why.append(f"the loss did not fall ({s.first_loss:.3f} -> {s.last_loss:.3f})")
    ratio, at = max(s.max_ratio.values()), s.max_ratio_at
    if ratio > MAX_UPDATE_RATIO:
        why.append(f"update {at['update']} moved {at['group']} by {ratio:.2g}× its norm (> MAX_UPDATE_RATIO "
                   f"{MAX_UPDATE_RATIO:g})")
    if s.grad_spike > GRAD_SPIKE_MAX:
        why.append(f"a gradient norm reached {s.grad_spike:.1f}× the earlier median (> GRAD_SPIKE_MAX "
                   f"{GRAD_SPIKE_MAX:g})")
    if why:
        return Decision("tune", "finite, but " + "; ".join(why), "lower the LR or add warmup")
    return Decision("accept", f"finite, the loss fell ({s.first_loss:.3f} -> {s.last_loss:.3f}), no bound crossed",
                    "locally stable; judge quality on a held-out evaluation before adopting it")


def run(ctx) -> list:
    cfg, dev = config_for(ctx.workload.arch, ctx.device, ctx.smoke), ctx.device
    model = build_model(ctx.workload, dev)
    init = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    batches = make_batches(ctx.workload, cfg.updates, device=dev)
    traces = {name: attempt(trace, model, init, batches, name, cfg, dev)
              for name in ctx.progress(CANDIDATES, desc="candidates")}
    measured = measure(model, init, batches, cfg, dev, progress=ctx.progress)
    return [candidate_record(ctx, name, cfg, traces[name], measured) for name in CANDIDATES]


def candidate_record(ctx, name: str, cfg: DynamicsConfig, traced, measured: dict):
    """One arm's record from its trace (its rows, or ``Failed``) and every arm's measurement."""
    m = measured[name]
    rows = None if isinstance(traced, Failed) else traced
    failure = (traced.failure if rows is None else None) or (m.failure if isinstance(m, Failed) else None)
    m = m if isinstance(m, harness.Measured) else None
    summary = summarize(rows) if rows else None
    decided = Decision.failed(failure) if failure else decide(summary) if summary else None
    summary, rows = json_safe(summary and dataclasses.asdict(summary)), json_safe(rows)  # NaN/inf: null
    base = measured.get(TIME_BASELINE.get(name))
    base_timing = base.timing if isinstance(base, harness.Measured) else None
    compared = m is not None and base_timing is not None
    noise = timing_noise(m.timing, base_timing, more_work=name == "high_lr_clip") if compared else None
    by_run = dict(trace=len(rows) if rows else None, measurement=m and m.updates)  # warm + measured steps
    ran = [n for n in by_run.values() if n is not None]
    measured = m.record_fields() if m else dict(memory_source=None)
    measured.update(updates=sum(ran) if ran else None, skipped_updates=0 if ran else None)
    return ctx.record(
        name, strategy=PLAIN.name, **measured, all_finite=summary["all_finite"] if summary else None,
        timing_noise=noise, failure=failure, **(decided.record_fields() if decided else {}),
        metrics=dict(lr=lr_of(name, cfg), max_norm=max_norm_of(name, cfg), weight_decay=cfg.weight_decay,
                     timed_steps=cfg.timed, summary=summary, trace=rows, updates_by_run=by_run,
                     step_samples_s=m and m.timing.samples, wall_samples_s=m and m.timing.wall_samples,
                     interleaved=m and m.timing.interleaved, time_baseline=TIME_BASELINE.get(name),
                     time_ratio=m.timing.median_s / base_timing.median_s if compared else None,
                     p95_ratio=m.timing.p95_s / base_timing.p95_s if compared else None,
                     rule=RULE))


def dry_run(ctx) -> dict:
    """LRs, updates and, per mode, an estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w = ctx.workload

    def mode_schedule(dev):
        cfg = config_for(w.arch, dev, ctx.smoke)
        passes = cfg.updates + 1 + steps_per_arm(cfg.timed, cfg.warmup)  # traced + warm + measured
        overhead_s = cfg.updates * 0.05 + 2 * 0.5 if dev == "cuda" else 0.0  # snapshots + ratios, 2 loads from the host
        per_arm = dry_run_seconds(w.arch, w.batch * w.seq, passes, dev) + overhead_s
        seconds = ASSUMED_BUILD_S[dev] + len(CANDIDATES) * per_arm
        return cfg.timed, cfg.warmup, dict(lrs={c: lr_of(c, cfg) for c in CANDIDATES}, traced_updates=cfg.updates,
                                           estimated_seconds=round(seconds, 1))

    return dict(max_norm=DynamicsConfig.max_norm, weight_decay=DynamicsConfig.weight_decay, optimizer="AdamW",
                groups=list(update_dynamics.GROUPS), params=param_count(w.arch), modes=own_weights_modes(mode_schedule),
                rule=RULE,
                estimate_basis=ASSUMED_BASIS + "; + 0.05 s per traced update and 1 s of state loads per arm (cuda)")


def conformance():
    """Our clipping against ``torch.nn.utils.clip_grad_norm_`` (``update_dynamics_conformance``)."""
    from bp_mech.experiments.update_dynamics_conformance import conformance as row

    return row()
