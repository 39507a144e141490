"""``bp-mech plan``'s output and command: the plan of ``bp_mech.planner.plan`` as a table (bytes per lifecycle
stage, the peak, what fits, the counted time cost) or JSON. ``run`` takes the command's typed request
(``planner.request.PlanRequest``). Exit status: 0 when a candidate fits; 1 when none does (the plan is printed
all the same, with what would fit instead: ``Plan.fits_instead``, and that line on stderr); 2 for bad input (a
``PlanError``: one line, no traceback; a model that does not attend causally, ``planner.causal``, is one)."""

from __future__ import annotations

import gc
import json
import logging
import sys

from bp_mech.planner.definitions import StepDefinition
from bp_mech.instruments.peak import fmt_bytes
from bp_mech.ledger_table import STAGES
from bp_mech.instruments.adamw import torch_default_adamw
from bp_mech.planner.inputs import GiB, load_config
from bp_mech.planner.plan import ALLOCATOR_SLACK, CONTEXT_BYTES, Plan, plan
from bp_mech.planner.pool import default_workers
from bp_mech.planner.request import PlanRequest


def _unit(values) -> tuple[int, str]:
    """The table's unit: GiB, MiB or KiB, whichever the largest value needs (a tiny model's plan in GiB
    would read 0.00 everywhere)."""
    top = max(values, default=0)
    return next(((k, u) for u, k in (("GiB", GiB), ("MiB", 2**20)) if top >= k), (2**10, "KiB"))


def format_text(p: Plan) -> str:
    """The plan as a table (GiB, MiB or KiB per lifecycle stage, the peak, what fits) and the recommendation."""
    m = p.model
    k, unit = _unit([r.needs for r in p.rows])

    def num(n) -> str:
        return f"{n / k:.2f}"

    eager = ", eager attention (no SDPA: its T x T scores are in the trace)" if m.get("attention") == "eager" else ""
    if p.shard:
        eager += f"; rank 0 of {p.gpus} GPUs, {p.shard}, batch {p.batch} per GPU (global {p.gpus * p.batch})"
    lines = [f"bp-mech plan: {m['model_type']} ({m['parameters'] / 1e6:.1f} M parameters, {m['layers']} layers{eager}), "
             f"batch {p.batch} x seq {p.seq}, budget {fmt_bytes(p.budget)} — estimated (fake tensors, "
             f"{optimizer_text(p)}){'' if m['validated'] else ' — this family is not validated (tests/planner/test_plan.py)'}",
             f"fits when peak x {1 + ALLOCATOR_SLACK:.2f} + {fmt_bytes(CONTEXT_BYTES)} "
             "(CUDA context) <= budget; +time: counted recompute FLOPs and offload transfers over a plain "
             "step (upper bound); measured: a cached GPU record's time over its own plain step ('-': none"
             f"{f' of {p.device_name}' if p.device_name else ''}); {unit} per stage:", loop_line(p), ""]
    head = ["strategy", *STAGES, "peak", "needs", "fits", "+time", "measured"]
    rows = [[r.strategy, *(num(r.stages[x]) for x in STAGES), num(r.peak), num(r.needs),
             "yes" if r.fits else "no", f"{r.cost.extra:+.0%}",
             f"x{r.measured.time_ratio:.2f}" if r.measured else "-"] for r in p.rows]
    if p.shard:  # what sharding adds, on its own lines: gathered parameters and the collectives' buffers
        head += ["gathered", "collective"]
        for row, r in zip(rows, p.rows):
            row += [num(r.sharded.get("gathered", 0)), num(r.sharded.get("collective", 0))]
    if p.fits:  # --batch max / --seq max: each strategy's largest size beside its row
        axis = p.fits[0].axis
        head.append(f"max {axis}")
        for row, f in zip(rows, p.fits):  # (*: the axis's limit reached, not the budget)
            row.append(f"{f.size}{'*' if f.next_needs is None else ''}" if f.size else "none")
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        lines.append("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    if p.fits:
        axis, other = p.fits[0].axis, ("seq", p.seq) if p.fits[0].axis == "batch" else ("batch", p.batch)
        lines.append(f"max {axis}: the largest {axis} at {other[0]} {other[1]} each strategy fits the budget at (it "
                     f"fits, one more does not: {sum(f.traces for f in p.fits)} steps traced); the table is at "
                     f"batch {p.batch} x seq {p.seq}")
        if capped := next((f for f in p.fits if f.size and f.next_needs is None), None):
            what = ("the config's max_position_embeddings: it fits there, and the config takes no longer sequence"
                    if axis == "seq" else "the largest batch the search looks for: it fits there, and the search "
                    "goes no further")
            lines.append(f"*: {capped.size} is {what}")
    if p.shard:
        lines.append("gathered: the unsharded parameters FSDP holds at once (within parameters); collective: the "
                     "all-gather / reduce-scatter buffers" + (" and DDP's gradient buckets" if p.shard == "ddp" else "")
                     + " (within other); the most alive at any moment of the step")
    lines += [f"skipped {k}: {v}" for k, v in p.skipped.items()]
    lines += [f"cached GPU records not used: {e}" for e in p.cache_errors]
    best = next((r for r in p.rows if r.strategy == p.recommended), None)
    if best is not None:
        c = best.cost
        line = (f"\nrecommended: {best.strategy} — peak {fmt_bytes(best.peak)} at {best.peak_stage}, needs "
                f"{fmt_bytes(best.needs)} of {fmt_bytes(p.budget)}; time {c.extra:+.0%} of a plain step (counted: "
                f"{c.recomputes} recomputed sublayers, {c.recompute_flops / 1e12:.2f} TFLOP, "
                f"{(c.d2h_bytes + c.h2d_bytes) / 1e9:.2f} GB over the host link)")
        if "micro" in best.strategy:
            line += "; its micro-batches do the same FLOPs in smaller kernels, which the count does not price"
        if best.measured:
            ms = best.measured
            line += f"; measured x{ms.time_ratio:.2f} on {ms.device} at {ms.workload} ({ms.record})"
        lines.append(line)
        big = best.peak / 200  # lines of at least 0.5 % of the peak
        lines.append("  at its peak: " + ", ".join(f"{name} {fmt_bytes(v)}" for name, v in best.peak_ledger.items()
                                                  if v >= big))
    if p.recommended is None and p.fits_instead is not None:
        lines.append("\n" + no_fit_message(p))
    lines.append(f"({len(p.rows)} {'strategy' if len(p.rows) == 1 else 'strategies'} traced in {p.elapsed_s:.1f} s)")
    return "\n".join(lines)


def adamw_text(p: Plan) -> str:
    """The AdamW implementation the plan traced, and whether it is PyTorch's default on CUDA."""
    impl = p.options.adamw
    return f"{impl} AdamW" + (", PyTorch's default on CUDA" if impl == torch_default_adamw("cuda") else
                              f", not PyTorch's default on CUDA ({torch_default_adamw('cuda')})")


_OPTIMIZER_NAMES = dict(sgd="SGD (momentum 0.9)", adafactor="Adafactor")


def optimizer_text(p: Plan) -> str:
    """The optimizer and implementation the plan traced, the weights' dtype, and how many parameters train."""
    kind, impl, default = p.options.optimizer, p.options.adamw, torch_default_adamw("cuda")
    if kind == "adamw":
        opt = adamw_text(p)
    elif kind == "adamw8bit":
        opt = "8-bit AdamW (bitsandbytes' blockwise kernels, one implementation)"
    else:
        opt = f"{impl} {_OPTIMIZER_NAMES[kind]}" + (", PyTorch's default on CUDA" if impl == default else
                                                    f", not PyTorch's default on CUDA ({default})")
    weights = f"{p.definition.weights} weights, no float32 master copy" if p.definition.weights else "float32 weights"
    m = p.model
    trains = (f"{m['trainable']:,} of {m['parameters']:,} parameters trained ({m['trainable'] / m['parameters']:.2%}, "
              f"{p.finetune.name if p.finetune else 'full'})") if "trainable" in m else "all parameters trained"
    return f"{opt}; {weights}; {trains}"


LOOPS = {False: "outputs dropped before backward (Trainer's compute_loss)",
         True: "outputs kept through backward (out = model(**batch); out.loss.backward(), as in Accelerate's examples)"}


def loop_line(p: Plan) -> str:
    """Which loop was planned, and what dropping the outputs before backward saves on the plain step."""
    line = f"loop: {LOOPS[p.definition.keep_outputs]}"
    if p.outputs_saving is not None:
        line += (f"; dropping the outputs saves {fmt_bytes(p.outputs_saving)} of the plain step's peak"
                 + ("" if p.definition.keep_outputs else " (--keep-outputs plans the loop that keeps them)"))
    return line


def no_fit_message(p: Plan) -> str:
    f = p.fits_instead
    if f.batch:
        alt = f"; --batch {f.batch} fits with it (one more row does not)"
    elif f.seq:
        alt = f"; --seq {f.seq} fits with it (one more token does not)"
    else:
        alt = (f"; even at batch {f.small_shape[0]} x seq {f.small_shape[1]} it needs {fmt_bytes(f.small_needs)}, "
               f"and parameters, gradients and optimizer state alone hold {fmt_bytes(f.model_state)}")
    return (f"no strategy fits {fmt_bytes(p.budget)}: the leanest, {f.strategy}, needs {fmt_bytes(f.needs)} "
            f"(with headroom){alt}")


NO_FIT = 1  # the exit status when no candidate fits (bad input is a PlanError: 2)
FIT_SEQ = 64  # --seq max: the sequence the table is traced at (each strategy's largest one beside it)


def model_classes() -> None:
    """Import Transformers' model classes as ``bp-mech plan`` does before its first plan: with the collector off,
    then frozen (``gc.freeze``). Their modules make hundreds of thousands of objects that live as long as the
    process, which every full collection would scan again (about 1 s of the command's start, measured)."""
    gc.disable()
    try:
        import transformers.models.auto.modeling_auto  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def run(r: PlanRequest, progress=None) -> int:
    """``bp-mech plan``: print the plan of request ``r`` (text or ``--json``).

    Args:
        r: the command's request (``planner.request.PlanRequest``, checked when it was made).
        progress: wraps the traces' iterator (a progress bar), or None.

    Returns:
        0 when a candidate fits; ``NO_FIT`` (1) when none does (the plan printed all the same, with what would
        fit instead, and that line on stderr).

    Raises:
        PlanError: a config or shape the plan cannot take (one line, exit 2).
    """
    from bp_mech.instruments.workload import parse_workload, qwen2_config

    batch, seq = r.batch, r.seq
    if r.config:
        config = load_config(r.config)
    else:
        w = parse_workload(r.workload)
        config, batch, seq = qwen2_config(w.arch), batch or w.batch, seq or w.seq
    fit = "batch" if batch == "max" else "seq" if seq == "max" else None
    if fit == "batch":  # the table at the smallest batch every candidate splits into
        batch = 2
    elif fit == "seq":
        limit = getattr(config.get_text_config(), "max_position_embeddings", None) or 0
        seq = min(FIT_SEQ, limit) if limit > 0 else FIT_SEQ
    definition = StepDefinition(keep_outputs=r.keep_outputs, weights=r.weights and r.weights.value)
    # a meta kernel that fails logs its traceback there; the plan says why in one line (PlanError, a row's reason)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.disabled, was = True, log.disabled
    try:
        p = plan(config, batch, seq, r.budget, r.device_name, options=r.options, progress=progress,
                 workers=r.workers or default_workers(), definition=definition, finetune=r.finetune, fit=fit,
                 gpus=r.gpus, shard=r.shard, candidates=r.candidates, full_depth=r.full_depth)
    finally:
        log.disabled = was
    print(json.dumps(p.to_dict(), indent=1, default=str) if r.json else format_text(p))
    if p.recommended is None:
        print(f"bp-mech: {no_fit_message(p) if p.fits_instead else 'no strategy could be traced'}", file=sys.stderr)
        return NO_FIT
    return 0
