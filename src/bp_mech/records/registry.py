"""The experiment registry: every ID of DESIGN.md, the module that implements it, how to run it.

An experiment module (``bp_mech.experiments.<name>``, measuring the mechanism ``bp_mech.<name>``; a
project's is ``bp_mech.projects.<name>``) exposes:

* ``CANDIDATES``: the arms of its fixed comparison (tuple of str);
* ``run(ctx: RunContext) -> list[Record]``: run every candidate, one record each;
* optionally ``dry_run(ctx) -> dict`` (extra lines for ``--mode dry_run``),
  ``conformance() -> ConformanceRow`` (its framework-conformance check) and ``OPTIONS`` (the
  ``ctx.options`` it reads), with ``check_options(ctx)`` (the CLI calls it before anything runs).

The registry lists the IDs statically. The status of a row is computed from the chapter pages and
the cached records, never typed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

from bp_mech.records import provenance, results
from bp_mech.records.environment import attention_shape, environment_fields, numerics
from bp_mech.instruments.workload import Workload, parse_workload, workload_fields

MODES = ("cpu", "real_gpu", "dry_run")


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class Experiment:
    semantic_id: str  # stable ID from the seed
    page: str  # "Part 02 · 09"
    number: str  # what `bp-mech check` takes: "09", "amp", ...
    module: str  # the experiment module, e.g. "bp_mech.experiments.local_backward"
    doc: str  # the chapter page, relative to the repo root
    comparison: str  # the fixed comparison, as in the registry table
    metrics: str  # the main metrics
    gpu: bool  # part of the GPU suite (CPU mechanism + GPU cached)
    cpu_workload: str = "tiny-b2s64"  # default workload of --mode cpu
    gpu_workload: str = "qwen05-b2s512"  # default workload of --mode real_gpu

    @property
    def mechanism(self) -> str:
        """The module of the mechanism the chapter teaches (``bp_mech.<x>``); ``module`` is its experiment
        (``bp_mech.experiments.<x>``, or ``bp_mech.projects.<x>`` for a project page)."""
        return self.module.replace(".experiments.", ".")

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# GPU suite order: numeric paths first (AMP, 11, 19, 42), then 55, 56, 76, then the projects 73, 74.
EXPERIMENTS: dict[str, Experiment] = {e.semantic_id: e for e in [
    Experiment("TRAIN-AMP-BACKWARD", "Part 02 · 12b", "amp", "bp_mech.experiments.amp", "book/part02/12b-amp-backward.md",
       "FP32 → AMP, plus overflow samples", "finiteness, loss scale, skipped steps, peak, step time", True),
    Experiment("TRAIN-GRADIENT-ACCUMULATION", "Part 02 · 11", "11", "bp_mech.experiments.accumulation",
       "book/part02/11-gradient-accumulation.md", "full batch → 2 / 4 micro-batches accumulated",
       "param/loss difference, absolute and incremental peak, step median/P95", True,
       gpu_workload="qwen05-b2s256"),
    Experiment("TRAIN-CHECKPOINT", "Part 02 · 19", "19", "bp_mech.experiments.checkpointing", "book/part02/19-checkpointing.md",
       "plain saving → native gradient checkpointing", "loss / grad-norm equality, peak, step time, recompute count",
       True),
    Experiment("TRAIN-OFFLOAD", "Part 02 · 42", "42", "bp_mech.experiments.offload", "book/part02/42-offload.md",
       "GPU-resident → host offload of saved activations", "loss / grad-norm equality, D2H/H2D bytes, peak, step time",
       True),
    Experiment("TRAIN-UPDATE-DYNAMICS", "Part 02 · 55", "55", "bp_mech.experiments.update_dynamics", "book/part02/55-update-dynamics.md",
       "base LR / high LR no clip / high LR with clip",
       "finiteness, grad norm, clip coefficient, parameter delta, peak, step median/P95", True),
    Experiment("TRAIN-CONTINUAL-PRETRAIN", "Part 02 · 56", "56", "bp_mech.experiments.continual_pretrain",
       "book/part02/56-continual-pretrain.md", "0-update baseline → fixed-step full-sequence domain training",
       "domain / holdout token loss, finiteness, saved-state fields, peak, step median/P95", True),
    Experiment("TRAIN-MEMORY-STRATEGY", "Part 02 · 76", "76", "bp_mech.projects.memory_strategy",
       "book/projects/76-memory-strategy.md", "single and combined strategies (checkpoint, offload, AMP)",
       "quality–capacity–time decision", True),
    Experiment("TRAIN-LOCAL-BACKWARD", "Part 02 · 09", "09", "bp_mech.experiments.local_backward", "book/part02/09-local-backward.md",
       "hand-written local gradients → autograd", "output, input grad, parameter grads, error", False),
    Experiment("TRAIN-ATTENTION-BACKWARD", "Part 02 · 10", "10", "bp_mech.experiments.attention_backward",
       "book/part02/10-attention-backward.md", "hand-written attention backward → autograd",
       "dQ/dK/dV, saved state (bytes), numeric error", False, cpu_workload="tiny-b1s512"),
    Experiment("TRAIN-SCHEDULER-CLOCK", "Part 02 · 12", "12", "bp_mech.experiments.scheduler", "book/part02/12-scheduler-clock.md",
       "WSD clock under successful and skipped updates", "warmup/stable/decay boundaries, effective update count",
       False),
    Experiment("TRAIN-STATE-LEDGER", "Part 02 · 43", "43", "bp_mech.experiments.ledger", "book/part02/43-state-ledger.md",
       "baseline lifecycle → lifecycle after a strategy", "residency per stage, peak objects, theoretical peak",
       False),
    Experiment("TRAIN-BASELINE", "Part 02 · 73", "73", "bp_mech.projects.baseline", "book/projects/73-baseline.md",
       "fixed-model, fixed-data training baseline", "throughput and quality", True),
    Experiment("TRAIN-PROFILING-DIAGNOSIS", "Part 02 · 74", "74", "bp_mech.projects.profiling",
       "book/projects/74-profiling-diagnosis.md", "lifecycle ledger and trace fields",
       "dominant state, hot-spot list (operators by self time), candidate attribution", True),
]}


def get(semantic_id: str) -> Experiment:
    try:
        return EXPERIMENTS[semantic_id]
    except KeyError:
        raise RegistryError(f"unknown experiment ID {semantic_id!r}; known: {', '.join(EXPERIMENTS)}") from None


def by_number(number: str) -> Experiment:
    for e in EXPERIMENTS.values():
        if e.number == number.lower().lstrip("0") or e.number == number.lower():
            return e
    raise RegistryError(f"unknown chapter {number!r}; known: {', '.join(e.number for e in EXPERIMENTS.values())}")


def gpu_suite() -> list[Experiment]:
    return [e for e in EXPERIMENTS.values() if e.gpu]


def _notifies(make: Callable) -> Callable:
    """Wrap ``RunContext.record``: hand each record it makes to ``ctx.on_record`` (when set)."""
    import functools

    @functools.wraps(make)
    def record(self, candidate: str, **fields) -> results.Record:
        rec = make(self, candidate, **fields)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    return record


@dataclass
class RunContext:
    """Everything an experiment's ``run`` needs, and the factory of its records."""

    experiment: Experiment
    workload: Workload
    mode: str  # cpu | real_gpu | dry_run
    profile: str  # TRAIN-CPU | TRAIN-CUDA-MECHANISM
    run_label: str  # e.g. "cpu-default"
    progress: Callable = field(default=lambda it, **kw: it)  # tqdm-like wrapper for long loops
    on_record: Callable | None = None  # called with every record ``record`` makes (the CLI saves it at once)
    smoke: bool = False  # a smoke run: every code path once, SMOKE_SCHEDULE steps; its records are not evidence
    options: dict = field(default_factory=dict)  # experiment-specific options (the CLI's --domain-text, ...); a
    # module lists the ones it reads in OPTIONS
    _base: dict | None = None

    @property
    def device(self) -> str:
        return "cuda" if self.mode == "real_gpu" else "cpu"

    @property
    def evidence_level(self) -> str:
        return "gpu-measured" if self.mode == "real_gpu" else "cpu-mechanism"

    @property
    def memory_source(self) -> str:
        return "cuda-allocator" if self.mode == "real_gpu" else "tracked-cpu"

    @_notifies
    def record(self, candidate: str, **fields) -> results.Record:
        """A record with identity, workload, environment and provenance filled in."""
        if self._base is None:
            self._base = dict(
                **workload_fields(self.workload),
                **environment_fields(self.profile, self.device),
                **provenance.provenance(self.experiment.module),
            )
            # the settings that decide the numbers, with the SDPA kernel of this workload's attention shape
            self._base["numerics"] = numerics(self.device, attention_shape(self.workload))
        base = dict(self._base, evidence_level=self.evidence_level)
        base.update(fields)
        return results.Record(semantic_id=self.experiment.semantic_id, run_label=self.run_label,
                              page=self.experiment.page, candidate=candidate, **base)


def make_context(semantic_id: str, mode: str = "cpu", workload: str | Workload | None = None,
                 run_label: str | None = None, progress: Callable | None = None,
                 source: dict | None = None, on_record: Callable | None = None, smoke: bool = False,
                 options: dict | None = None) -> RunContext:
    exp = get(semantic_id)
    if mode not in MODES:
        raise RegistryError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if workload is None:
        workload = exp.gpu_workload if mode == "real_gpu" else exp.cpu_workload
    w = parse_workload(workload, **(source or {})) if isinstance(workload, str) else workload
    profile = "TRAIN-CUDA-MECHANISM" if mode == "real_gpu" else "TRAIN-CPU"
    label = run_label or f"{'gpu' if mode == 'real_gpu' else 'cpu'}-default"
    ctx = RunContext(exp, w, mode, profile, label, on_record=on_record, smoke=smoke, options=dict(options or {}))
    if progress is not None:
        ctx.progress = progress
    return ctx


def dry_run(ctx: RunContext) -> dict:
    """What ``run`` would do, without touching a model (``--mode dry_run``)."""
    mod = ctx.experiment.load()
    out = dict(semantic_id=ctx.experiment.semantic_id, page=ctx.experiment.page, mode=ctx.mode,
               workload=ctx.workload.workload_id, model_id=ctx.workload.hub_id, model_source=ctx.workload.source,
               candidates=list(getattr(mod, "CANDIDATES", ())),
               evidence_if_run={"cpu": "cpu-mechanism", "real_gpu": "gpu-measured"})
    if hasattr(mod, "dry_run"):
        out.update(mod.dry_run(ctx))
    return out


def run(ctx: RunContext) -> list[results.Record]:
    mod = ctx.experiment.load()
    return mod.run(ctx)


# --- the map: chapter -> mechanism -> experiment -> exercise -> tests ---------------------

def chapter_map(root: Path) -> list[dict]:
    """Where each chapter lives, in book order: its page, the mechanism module the chapter teaches,
    the experiment module that measures it, the exercise file and the test files (those that exist)."""
    def rel(paths):
        return [str(p.relative_to(root)) for p in paths]

    rows = []
    for e in sorted(EXPERIMENTS.values(), key=lambda e: e.doc):
        name = e.mechanism.rsplit(".", 1)[1]
        tests = sorted((root / "tests").glob(f"test_{name}.py")) + sorted((root / "tests").glob(f"*/test_{name}.py"))
        rows.append(dict(semantic_id=e.semantic_id, page=e.page, chapter=e.doc, mechanism=e.mechanism,
                         experiment=e.module, exercise=rel(sorted((root / "exercises").glob(f"ex{e.number}_*.py" if e.number.isdigit() else f"ex_{e.number}_*.py"))),
                         tests=rel(tests)))
    return rows


# --- status, computed ---------------------------------------------------------------

@dataclass
class ConformanceRow:
    page: str  # registry page
    semantic_id: str
    reference: str  # the framework mechanism it is checked against
    passed: bool
    detail: str  # the measured difference and its tolerance


def status(e: Experiment, root: Path, results_dir: Path) -> str:
    """Computed from the chapter page and the cached records (valid, not stale)."""
    if not (root / e.doc).exists():
        return "in progress (no chapter yet)"
    recs = [r for _, r in results.load_records(results_dir, e.semantic_id) if r.failure is None]
    fresh = [r for r in recs if not provenance.is_stale(r, e.module)]
    cpu = any(r.evidence_level == "cpu-mechanism" for r in fresh)
    gpu = [r for r in recs if r.evidence_level == "gpu-measured"]
    stale_cpu = any(r.evidence_level == "cpu-mechanism" for r in recs)
    text = ("complete CPU mechanism" if cpu else
            "CPU mechanism (cached CPU records are stale: code changed since)" if stale_cpu else
            "CPU mechanism (no CPU record cached)")
    if e.gpu:
        if not gpu:
            text += "; no GPU record cached yet"
        elif any(not provenance.is_stale(r, e.module) for r in gpu):
            text += " + GPU cached"
        else:
            text += " + GPU cached (stale: code changed since)"
    return text
