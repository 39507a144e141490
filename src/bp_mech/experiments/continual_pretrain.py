"""Part 02 · 56 — TRAIN-CONTINUAL-PRETRAIN, the experiment: the 0-update baseline against a fixed number
of full-sequence domain updates, and a run resumed from a saved state (the mechanism:
``bp_mech.continual_pretrain``, ``bp_mech.training_state``).

1. The base: the workload's model, after a short deterministic pretraining on the general text when it
   is a random-init one (``config`` source; a pretrained workload starts from its weights).
2. ``baseline``: the base's per-token loss on the domain evaluation text (the domain text's last
   ``domain_eval_fraction``, never trained on) and on the holdout text.
3. ``domain``: ``updates`` domain updates from the base, both losses every ``eval_every`` updates; the
   full training state is saved at ``save_at``.
4. ``resumed``: a fresh trainer, built as a new process builds it (random init, new AdamW, clock at 0),
   loads that saved state (or ``--resume-from``'s) and runs to the same end; its losses must equal the
   uninterrupted run's, bit for bit on the CPU.

Every step is the book's one training step (``bench.trainer.phase_trainer``: ``bench.step.train_step``,
plain float32, whose GradScaler is disabled). Step time and peak are the domain step's
(``harness.measure``: one tracked step for the peak,
warm-up and timed steps on one intra-op thread on the CPU; the allocator on CUDA). On the CPU the whole
run uses one intra-op thread (the ``threads`` option: another count): the machines are shared, and a resumed
run must use the same kernels.
The shipped texts (``continual_data.load_texts``: this book's prose, its held-out tail, this package's Python
source) are tens of kilobytes: they verify the measurement chain, not a conclusion about a domain.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bp_mech import continual_data, continual_eval, state_format, state_identity, training_state
from bp_mech import continual_pretrain as cpt
from bp_mech.bench.oom import Failed, attempt
from bp_mech.bench.rates import ASSUMED_BASIS, ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.step import StepResult, optimizer_state
from bp_mech.bench.strategy import PLAIN
from bp_mech.bench.trainer import phase_trainer
from bp_mech.bench.timing import CPU_TIMING_THREADS, timing_threads
from bp_mech.instruments.workload import WorkloadError, build_model, param_count, workload_fields
from bp_mech.experiments import harness
from bp_mech.experiments.continual_base import base_model
from bp_mech.experiments.dry_run import own_weights_modes, schedule, steps_per_arm
# the decision rule (domain: gain and drift; resumed: equal to the uninterrupted run), its constants and the
# warning every decision carries
from bp_mech.experiments.continual_pretrain_rule import (MAX_HOLDOUT_DRIFT_REL, MIN_DOMAIN_GAIN_REL, RESUME_TOL,
                                                          SEED_SPREAD_REL, SHIPPED_TEXTS_WARNING, SPREAD_MULTIPLE,
                                                          decide_domain, decide_resume)
from bp_mech.records.decision import Decision
from bp_mech.records.results import json_safe

SEMANTIC_ID = "TRAIN-CONTINUAL-PRETRAIN"
CANDIDATES = ("plain", "domain", "resumed")  # plain: the base, 0 domain updates
OPTIONS = ("domain_text", "holdout_text", "state_dir", "resume_from", "threads")  # what ctx.options may hold
EVAL_BATCH = 16  # windows per evaluation batch (the loss per token does not depend on it)


@dataclass(frozen=True)
class CPTConfig:
    pretrain: cpt.TrainConfig  # the base: general-text pretraining of a random-init model (updates 0: none)
    domain: cpt.TrainConfig  # the domain run
    save_at: int = 20  # the update whose full training state the resume demo saves and reloads
    eval_every: int = 5  # updates between two evaluations of both losses (plus 0, the saved state and the end)
    domain_eval_fraction: float = 0.3  # the domain text's tail kept for evaluation, never trained on
    timed: int = 60  # timed steps of the measurement (CPU: interleaved rounds)
    warmup: int = 3  # untimed steps before them

    @property
    def eval_at(self) -> set[int]:
        return set(range(0, self.domain.updates + 1, self.eval_every)) | {self.save_at, self.domain.updates}


def config_for(arch: str, device, smoke: bool = False) -> CPTConfig:
    """tiny on the CPU: 1200 pretraining updates on the prose (about three passes over it: the base's
    holdout loss is still falling, far below the unigram plateau, so it has learned English worth keeping)
    and 200 domain updates at a third of that rate (seconds); the gain and the drift are many times their
    spread over seeds and thread counts (``continual_pretrain_rule.SEED_SPREAD_REL``). qwen05 on CUDA
    (random init): a few updates, since memory and time are what that run measures."""
    rounds, warmup = schedule(device, smoke)
    if smoke:
        return CPTConfig(cpt.TrainConfig(updates=4, lr=3e-3, warmup=1, decay=1),
                         cpt.TrainConfig(updates=6, lr=3e-3, warmup=1, decay=2), save_at=3, eval_every=3,
                         timed=rounds, warmup=warmup)
    if arch == "qwen05":
        return CPTConfig(cpt.TrainConfig(updates=6, lr=3e-4, warmup=1, decay=2),
                         cpt.TrainConfig(updates=12, lr=1e-4, warmup=2, decay=4), save_at=6, eval_every=6,
                         timed=rounds, warmup=warmup)
    return CPTConfig(cpt.TrainConfig(updates=1200, lr=3e-3, warmup=20, decay=300),
                     cpt.TrainConfig(updates=200, lr=1e-3, warmup=10, decay=60), eval_every=20,
                     timed=rounds, warmup=warmup)


def check_options(ctx) -> dict:
    """The run's inputs, checked before anything runs (the CLI calls it first): the config, the texts
    (``--domain-text``/``--holdout-text`` readable and long enough), the domain text's split, and the
    saved state of ``--resume-from`` (manifest, identity and files, ``state_format.read_manifest``)."""
    w = ctx.workload
    cfg = config_for(w.arch, ctx.device, ctx.smoke)
    texts = continual_data.load_texts(ctx.options.get("domain_text"), ctx.options.get("holdout_text"), w)
    try:
        train_ids, domain_eval = continual_data.split_text(texts["domain"].ids, cfg.domain_eval_fraction)
    except ValueError as e:
        raise WorkloadError(f"domain text {texts['domain'].source}: {e}") from None
    wl, resume_dir = workload_fields(w), None
    if ctx.options.get("resume_from"):  # resolved now: this run's own saves may move a 'latest' it names
        expected = state_identity.identity(wl, cfg.domain, train_ids, w.batch, w.seq)
        resume_dir, _ = state_format.read_manifest(ctx.options["resume_from"], expected, SEMANTIC_ID)
    return dict(cfg=cfg, texts=texts, train_ids=train_ids, domain_eval=domain_eval, wl=wl, resume_dir=resume_dir)


def run(ctx) -> list:
    inputs = check_options(ctx)
    with timing_threads(ctx.device, int(ctx.options.get("threads") or CPU_TIMING_THREADS)):
        out = attempt(train_and_resume, ctx, **inputs)
    if isinstance(out, Failed):  # out of memory: every arm records it, nothing else
        return [ctx.record(c, failure=out.failure, next_step=f"failed: {out.failure}") for c in CANDIDATES]
    return records(ctx, inputs["cfg"], **out)


def train_and_resume(ctx, cfg: CPTConfig, texts, train_ids, domain_eval, wl, resume_dir) -> dict:
    """The base, the domain run (saved state at ``save_at``), the resumed run, the measurement."""
    w, dev, opts, N = ctx.workload, ctx.device, ctx.options, cfg.domain.updates
    model, pre_rows = base_model(w, texts["general"].ids, cfg.pretrain, dev)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    evals = {"domain": continual_eval.eval_batches(domain_eval, w.seq, EVAL_BATCH),
             "holdout": continual_eval.eval_batches(texts["holdout"].ids, w.seq, EVAL_BATCH)}
    record_id = dict(semantic_id=SEMANTIC_ID, page=ctx.experiment.page, run_label=ctx.run_label, candidate="domain")

    def new_trainer(m):
        stream = continual_data.TextStream(train_ids, w.batch, w.seq, cfg.domain.seed, dev)
        return phase_trainer(m, cfg.domain, stream, dev)

    saved = []  # (directory, seconds)

    def save(t):
        t0 = time.perf_counter()
        saved.append((training_state.save_training_state(t, root, wl, record_id), time.perf_counter() - t0))

    with tempfile.TemporaryDirectory(prefix="bp-mech-56-") as tmp:
        root = Path(opts.get("state_dir") or tmp)
        save_at = {cfg.save_at} | ({N} if opts.get("state_dir") else set())
        main = cpt.domain_run(new_trainer(model), evals, cfg.eval_at, N, save_at, save, ctx.progress)
        final = [p.detach().clone() for p in model.parameters()]
        fresh = new_trainer(build_model(w, dev))  # as a new process builds it: random init, new AdamW, clock 0
        t0 = time.perf_counter()
        manifest = training_state.load_training_state(fresh, resume_dir or saved[0][0], wl, SEMANTIC_ID)
        load_s = time.perf_counter() - t0
        resumed = cpt.domain_run(fresh, evals, cfg.eval_at, N, progress=ctx.progress)
        resume = continual_eval.resume_difference(main, resumed, manifest["clock"], final,
                                                  list(fresh.model.parameters()))
        del fresh, final
    model.load_state_dict(base)
    measured = measure(model, base, new_trainer, cfg, dev, ctx.progress)
    files = manifest["files"]
    state = dict(fields=list(state_format.FIELDS), files={f: v["bytes"] for f, v in files.items()},
                bytes=sum(v["bytes"] for v in files.values()), save_s=saved[0][1] if saved else None, load_s=load_s,
                saved=[str(p) for p, _ in saved] if opts.get("state_dir") else None,
                resumed_from=str(resume_dir) if resume_dir else "this run's saved state",
                at_update=manifest["clock"]["updates"], clock=manifest["clock"], scaler=manifest["scaler"],
                data_position=manifest["data_position"])
    common = dict(texts={k: dict(source=t.source, tokens=len(t.ids), sha256=continual_data.text_sha256(t.ids))
                         for k, t in texts.items()},
                  domain_split=dict(train_tokens=len(train_ids), eval_tokens=len(domain_eval)),
                  base=dict(source="pretrained weights" if w.source == "pretrained" else
                            "random init + pretraining on the general text",
                            pretrain_updates=sum(r.applied for r in pre_rows),
                            pretrain_losses=[r.loss for r in pre_rows],
                            pretrain_config=dataclasses.asdict(cfg.pretrain)),
                  domain_config=dataclasses.asdict(cfg.domain), warning=SHIPPED_TEXTS_WARNING)
    return dict(main=main, resumed=resumed, resume=resume, measured=measured, state=state, common=common)


def records(ctx, cfg: CPTConfig, main, resumed, resume, measured, state, common) -> list:
    return [plain_record(ctx, main, common), domain_record(ctx, cfg, main, measured, state, common),
            resumed_record(ctx, resumed, resume, state, common)]


def measure(model, base: dict, new_trainer, cfg: CPTConfig, device, progress=None):
    """The domain step on the harness (``harness.measure``): a trainer from the base, one warm update
    (AdamW's moments), then the tracked and timed steps of its ``step`` (the one training step). Returns the
    ``Measured`` or ``Failed``."""
    def prepare(name, together):
        m = copy.deepcopy(model) if together else model
        m.load_state_dict(base)
        t = new_trainer(m)

        def step(i):
            row = t.step()
            return StepResult(torch.tensor(row.loss), row.applied)

        run = harness.Run(step, lambda: [list(m.parameters()), optimizer_state(t.optimizer)])
        run.step(-1)  # the warm update
        return run

    return harness.measure(("domain",), prepare, device, cfg.timed, cfg.warmup, progress=progress)["domain"]


def finite(*xs) -> bool:
    return all(x is not None and math.isfinite(x) for x in xs)


def plain_record(ctx, main: dict, common: dict):
    e0 = main["evals"][0]
    return ctx.record(PLAIN.name, strategy=PLAIN.name, updates=0, skipped_updates=0,
                      all_finite=finite(e0["domain"], e0["holdout"]),
                      metrics=json_safe(dict(domain_loss=e0["domain"], holdout_loss=e0["holdout"], **common)))


def domain_record(ctx, cfg: CPTConfig, main: dict, m, state: dict, common: dict):
    failure = m.failure if isinstance(m, Failed) else None
    m = m if isinstance(m, harness.Measured) else None
    steps, evals = main["steps"], main["evals"]
    gd = continual_eval.gain_and_drift(evals)
    ok = all(finite(r["loss"]) for r in steps) and all(finite(e["domain"], e["holdout"]) for e in evals)
    decided = Decision.failed(failure) if failure else decide_domain(gd["domain_gain_rel"], gd["holdout_drift_rel"], ok)
    applied = sum(r["applied"] for r in steps)
    measured = m.record_fields() if m else dict(memory_source=None)
    measured.update(updates=applied + (m.updates if m else 0),
                    skipped_updates=len(steps) - applied + (m.skipped if m else 0))
    return ctx.record(
        "domain", strategy=PLAIN.name, **measured, all_finite=ok, failure=failure,
        **decided.record_fields(),
        metrics=json_safe(dict(
            **gd, evals=evals, steps=steps, saved_state=state, step_samples_s=m and m.timing.samples,
            wall_samples_s=m and m.timing.wall_samples,
            updates_by_run=dict(domain=applied, measurement=m.updates if m else None), timed_steps=cfg.timed,
            rule=dict(MIN_DOMAIN_GAIN_REL=MIN_DOMAIN_GAIN_REL, MAX_HOLDOUT_DRIFT_REL=MAX_HOLDOUT_DRIFT_REL,
                      SEED_SPREAD_REL=SEED_SPREAD_REL, SPREAD_MULTIPLE=SPREAD_MULTIPLE), **common)))


def resumed_record(ctx, resumed: dict, resume: dict, state: dict, common: dict):
    steps = resumed["steps"]
    applied = sum(r["applied"] for r in steps)
    decided = decide_resume(resume["loss_rel_diff"], resume["weight_rel_diff"], ctx.device)
    return ctx.record(
        "resumed", updates=applied, skipped_updates=len(steps) - applied,
        all_finite=all(finite(r["loss"]) for r in steps), output_error=json_safe(resume["loss_rel_diff"]),
        **decided.record_fields(),
        metrics=json_safe(dict(resume=resume, saved_state=state, evals=resumed["evals"], steps=steps,
                               clock_updates=resume["from_update"] + applied, rule=dict(RESUME_TOL=RESUME_TOL),
                               **common)))


# --- dry run, conformance, plots -------------------------------------------------------------------

STATE_BYTES_S = 1e9  # dry run: saved state bytes per second written (or read) and hashed


def dry_run(ctx) -> dict:
    """Updates, saved state and, per mode, an estimate (``modes.real_gpu.estimated_seconds``: one GPU)."""
    w = ctx.workload

    def mode_schedule(dev):
        cfg = config_for(w.arch, dev, ctx.smoke)
        N, k = cfg.domain.updates, cfg.save_at
        pre = cfg.pretrain.updates if w.source == "config" else 0
        passes = pre + N + (N - k) + 1 + steps_per_arm(cfg.timed, cfg.warmup)
        state_bytes = 3 * 4 * param_count(w.arch)  # float32 weights and AdamW's two moments
        saves = 1 + bool(ctx.options.get("state_dir"))
        seconds = (2 * ASSUMED_BUILD_S[dev] + dry_run_seconds(w.arch, w.batch * w.seq, passes, dev)
                   + (saves + 1) * state_bytes / STATE_BYTES_S)
        return cfg.timed, cfg.warmup, dict(pretrain_updates=pre, domain_updates=N, save_at=k,
                                           eval_at=sorted(cfg.eval_at), state_bytes=state_bytes,
                                           estimated_seconds=round(seconds, 1))

    return dict(texts={n: ctx.options.get(f"{n}_text") or f"shipped:{n}" for n in ("general", "domain", "holdout")},
                base="pretrained weights" if w.source == "pretrained" else
                "random-init architecture + a short pretraining on the general text (loss values verify the chain only)",
                state_fields=list(state_format.FIELDS), options={k: str(v) for k, v in ctx.options.items()},
                modes=own_weights_modes(mode_schedule),
                rule=dict(MIN_DOMAIN_GAIN_REL=MIN_DOMAIN_GAIN_REL, MAX_HOLDOUT_DRIFT_REL=MAX_HOLDOUT_DRIFT_REL,
                          RESUME_TOL=RESUME_TOL),
                estimate_basis=ASSUMED_BASIS + f"; + two model builds and the saved state's bytes at {STATE_BYTES_S:.0e} "
                "B/s per save and per load")


def conformance():
    """The round trip against Transformers and Accelerate (``continual_pretrain_conformance``)."""
    from bp_mech.experiments.continual_pretrain_conformance import conformance as row

    return row()
