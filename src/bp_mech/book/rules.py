"""The decision rules of every experiment in one table, read from the code's constants, with the reason
for each threshold beside the names of the constants it reads.

A ``Rule`` states its condition as a format string whose fields name constants (``{decision.MAX_TIME_RATIO}``,
``{amp.MAX_TIME_COST:.0%}``; the aliases are ``MODULES``). ``rows`` fills them from the modules when the
table is made, so the table cannot disagree with the code; ``constants_read`` and ``DECIDERS`` let the
tests check that every threshold a decide function reads has a rule here (tests/book/test_rules.py),
and the equalities the reasons state (``LINKS``). The appendix "How this book measures" shows the table.
"""

from __future__ import annotations

import ast
import inspect
import string
import textwrap
from dataclasses import dataclass

from bp_mech.bench import compare, timing
from bp_mech.instruments.peak import fmt_bytes
from bp_mech.experiments import (accumulation, amp, attention_backward, continual_pretrain, decision,
                                 ledger, local_backward, scheduler, update_dynamics)
from bp_mech.planner import plan
from bp_mech.projects import baseline, memory_strategy, profiling
from bp_mech.records import registry

MODULES = dict(timing=timing, compare=compare, decision=decision, accumulation=accumulation, amp=amp,
               update_dynamics=update_dynamics, continual_pretrain=continual_pretrain, ledger=ledger,
               profiling=profiling, memory_strategy=memory_strategy, plan=plan, baseline=baseline,
               local_backward=local_backward, attention_backward=attention_backward, scheduler=scheduler)
TIMED = ("TRAIN-GRADIENT-ACCUMULATION", "TRAIN-AMP-BACKWARD", "TRAIN-CHECKPOINT", "TRAIN-OFFLOAD",
         "TRAIN-MEMORY-STRATEGY")  # the experiments whose decisions read a time ratio
STRATEGIES = ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD", "TRAIN-MEMORY-STRATEGY")  # decision.decide, per arm
SAVERS = STRATEGIES + ("TRAIN-GRADIENT-ACCUMULATION", "TRAIN-AMP-BACKWARD")  # share decision.MIN_PEAK_SAVING


@dataclass(frozen=True)
class Rule:
    """One line of the table: an outcome, when it happens, and why the thresholds are where they are."""

    experiments: tuple[str, ...]  # semantic IDs the rule decides for
    outcome: str  # accept | tune | reject | none (the time decides nothing)
    when: str  # the condition; its format fields are the constants the rule reads
    why: str  # the reason for the values; format fields as in ``when``


RULES = (
    Rule(TIMED, "none", "a candidate with strictly more counted work measured faster, or its median and P95 "
         "ratios differ by more than {timing.MAX_RATIO_SPREAD}×",
         "Counted work that the clock contradicts can only be load. The spread allowed is the width of the "
         "memory strategies' own scale, from no cost (1×) to their time bound ({decision.MAX_TIME_RATIO}×): "
         "a disagreement wider than that is noise as large as anything the rule decides."),
    Rule(STRATEGIES, "reject", "loss or a gradient differs from plain's beyond the strategy's (loss, gradient) "
         "tolerance: checkpointing and offload {compare.EXACT_TOL[cpu]} on the CPU, {compare.EXACT_TOL[cuda]} on "
         "CUDA; micro-batches and the chunked loss {compare.REORDER_TOL}; autocast {compare.LOW_TOL}",
         "A memory strategy must not change the step. Checkpointing and offload repeat the same operations: bit "
         "for bit on the CPU, whose kernels are deterministic; on CUDA a recompute may pick other kernels and the "
         "backward may reassociate sums. Micro-batches and the chunked loss add float32 sums in another order. "
         "Autocast rounds matmul inputs to an 11-bit (fp16) or 8-bit (bf16) significand, layer after layer."),
    Rule(STRATEGIES, "reject", "peak saving below {decision.MIN_USEFUL_SAVING:.0%}",
         "The share at which Part 02 · 43's ledger calls a line large ({ledger.LARGE_SHARE:.0%} of a stage): "
         "below it the strategy removed no large line, so the memory that sets the peak is elsewhere "
         "(parameters, gradients, AdamW moments). The tool is wrong, not its setting."),
    Rule(SAVERS, "tune", "peak saving below {decision.MIN_PEAK_SAVING:.0%}",
         "One floor for every memory strategy: the allocator slack that bp-mech plan adds to every peak "
         "({plan.ALLOCATOR_SLACK:.0%}: block rounding, fragmentation). A smaller saving does not reliably "
         "change what fits. Where a memory budget is known, Part 02 · 76 decides by what fits instead."),
    Rule(STRATEGIES, "accept", "median step at most {decision.MAX_TIME_RATIO}× plain's (else tune)",
         "Checkpointing every layer recomputes each layer's forward once: with a backward of about two forwards, "
         "at most a third more work per step (4/3×; less, since the LM head and the loss are not recomputed). "
         "The bound is that ceiling and an eighth more (4/3 × 9/8) for what the FLOP count does not see: the "
         "checkpoint boundaries' bookkeeping, kernels launched twice. Offload buys the same memory as "
         "recomputing it, which is always possible: slower than that, it loses to checkpointing."),
    Rule(("TRAIN-GRADIENT-ACCUMULATION",), "reject", "the token-weighted first gradient differs from the full "
         "batch's by more than {accumulation.EQUIV_TOL[cpu]} (CPU) or {accumulation.EQUIV_TOL[cuda]} (CUDA), "
         "relative, global L2",
         "The same float32 sums in another order differ by rounding only, far below the bound; CUDA's kernels "
         "may also reassociate. A wrong loss normalisation is off by a factor, far above it."),
    Rule(("TRAIN-GRADIENT-ACCUMULATION",), "accept", "median step at most {accumulation.MAX_TIME_COST:.0%} above "
         "the full batch's (else tune)",
         "The memory strategies' bound ({decision.MAX_TIME_RATIO}×) stated as a rise: accumulation buys the "
         "same memory as checkpointing (a batch's activations), so it may cost what recomputing them costs. "
         "Its own work predicts less: the same FLOPs in k smaller passes, the weights read k times."),
    Rule(("TRAIN-AMP-BACKWARD",), "reject", "a step applied non-finite gradients, more than "
         "{amp.MAX_SKIPPED_FRACTION:.0%} of the steps were skipped, or the held-out loss is more than "
         "{amp.LOSS_REL_TOL:.0%} off FP32's",
         "A dynamic loss scale skips steps while it settles into the gradients' range, then rarely; "
         "{amp.MAX_SKIPPED_FRACTION:.0%} skipped means it never settles, and the LR clock loses as many "
         "updates. The loss is compared after all timed updates, not one step: twice autocast's one-step "
         "loss tolerance ({compare.LOW_TOL[0]:.0%}), for trajectories that drift apart update by update."),
    Rule(("TRAIN-AMP-BACKWARD",), "accept", "median step at most {amp.MAX_TIME_COST:.0%} above FP32's (else tune)",
         "Autocast adds no arithmetic, so the work predicts at most 1× (less where low-precision matmuls are "
         "faster). The allowance is the elementwise work it adds: a low-precision copy of every weight per "
         "forward and, for fp16, the unscale and the inf check over every gradient. A strategy that changes the "
         "arithmetic is not granted the recompute's time as well."),
    Rule(("TRAIN-UPDATE-DYNAMICS",), "tune", "some update's loss exceeds the lowest earlier loss by more than "
         "{update_dynamics.SPIKE_MAX} nats, or the last loss is not below the first (reject: non-finite)",
         "A rise of {update_dynamics.SPIKE_MAX} nats multiplies the perplexity by e^{update_dynamics.SPIKE_MAX}. "
         "Every candidate trains on the same batches from the same weights, so a rise that large is the "
         "learning rate's doing, not the data's. Local stability over a few updates only; the time decides "
         "nothing here."),
    Rule(("TRAIN-UPDATE-DYNAMICS",), "tune", "one update moved a parameter group by more than "
         "{update_dynamics.MAX_UPDATE_RATIO} of its norm (||Δp|| / ||p||), or a gradient norm before clipping "
         "exceeds {update_dynamics.GRAD_SPIKE_MAX}× the median of the earlier updates' norms",
         "The rule of thumb for a healthy run is an update ratio near {update_dynamics.RULE_OF_THUMB_RATIO} "
         "(Karpathy, CS231n notes, 'Neural Networks Part 3'). The bound sits two decades above it because a "
         "fresh random init has small weights and AdamW moves every element by about the learning rate, so a "
         "sane rate's first updates are large against them (lr / init std); a tenth of the norm in one update "
         "is a jump: ten such updates in one direction replace the weights, and the gradient, a local slope, "
         "says nothing about where such a step lands. At a fixed rate a gradient norm that doubles means the "
         "step landed where the loss is twice as steep; batch-to-batch variation at a stable rate is tens of "
         "percent, and a loss spike need not follow, so the norm catches jumps the loss misses."),
    Rule(("TRAIN-CONTINUAL-PRETRAIN",), "reject / tune", "domain loss fell by less than "
         "{continual_pretrain.MIN_DOMAIN_GAIN_REL:.0%} of the base's, {continual_pretrain.SPREAD_MULTIPLE} seed "
         "spreads (reject); holdout loss rose by more than {continual_pretrain.MAX_HOLDOUT_DRIFT_REL:.0%}, one seed "
         "spread (tune: forgetting)",
         "Both bounds come from the page's demo rerun at seeds 0 to 2, and on 2 threads instead of 1: the largest "
         "difference between two reruns' relative gain or drift, rounded up, is the seed spread "
         "{continual_pretrain.SEED_SPREAD_REL:.0%} (threads change no bit on the CPU; a seed changes the init, "
         "the data order, the base). A gain counts at {continual_pretrain.SPREAD_MULTIPLE} spreads, where no "
         "reseed makes or unmakes it; the holdout may move by what a reseed moves it, and a rise beyond that is "
         "forgetting, whose next step is replay. The spread is this demo's: on other texts or models, measure "
         "yours."),
    Rule(("TRAIN-CONTINUAL-PRETRAIN",), "accept", "every loss after the saved state and every final weight equal "
         "the uninterrupted run's within {continual_pretrain.RESUME_TOL[cpu]} (CPU) or "
         "{continual_pretrain.RESUME_TOL[cuda]} (CUDA), relative (else reject)",
         "The saved state must hold the whole training state. The CPU's kernels are deterministic, so a resumed "
         "run is the same run bit for bit; on CUDA, atomics in some backward kernels reorder float32 sums."),
    Rule(("TRAIN-STATE-LEDGER",), "accept", "every stage total and the peak within {ledger.STAGE_TOL:.0%}, every "
         "large line (at least {ledger.LARGE_SHARE:.0%} of its stage) within {ledger.CLASS_TOL:.0%} (else tune)",
         "The formula lists the large lines from shapes alone and leaves out scalars and small buffers; a stage "
         "off by more than a large line's share has missed a line. A line is bytes = elements × element size, "
         "so it is held tighter: only alignment and what it leaves out move it."),
    Rule(("TRAIN-PROFILING-DIAGNOSIS",), "accept", "a remedy's predicted saving within {profiling.ATTRIBUTION_TOL:.0%}"
         " of the plain peak of its measured saving (else tune)",
         "The large-line share of Part 02 · 43's ledger ({ledger.LARGE_SHARE:.0%}): a prediction that misses by "
         "less than a large line has named the right line."),
    Rule(("TRAIN-MEMORY-STRATEGY",), "pick", "the fastest candidate that passes the quality check and fits: "
         "peak × (1 + {plan.ALLOCATOR_SLACK:.0%}) + {plan.CONTEXT_BYTES:bytes} (CUDA) at most the budget: "
         "{memory_strategy.GPU_BUDGET:bytes} on CUDA, {memory_strategy.CPU_BUDGET_FRACTION:.0%} of plain's peak "
         "on the CPU; none when its time against the runner-up is noise",
         "bp-mech plan's rule: the caching allocator reserves more than it allocates (block rounding, "
         "fragmentation) and the CUDA context sits outside its counters. The GPU budget is the course's question; "
         "the CPU budget is one plain does not fit, so the pick has to trade time for memory."),
    Rule(("TRAIN-BASELINE",), "reject / tune", "a loss or an applied update's gradient norm is not finite, or two "
         "processes differ from one beyond {baseline.GRAD_TOL} (first gradient), {baseline.LOSS_TOL} (every "
         "loss) or {baseline.PARAM_TOL} (parameters, relative to the update) (reject); the holdout loss did "
         "not fall (tune)",
         "Two processes sum the same terms in another order: float32 rounding, 2^-24 per operation over sums "
         "of hundreds to thousands of terms, is of order 1e-6; the tolerances sit above it. AdamW divides by "
         "sqrt(v) + eps, which amplifies a gradient difference where a gradient is near eps in size: one order more for the "
         "parameters. Tokens per second is reported, never decided on."),
    Rule(("TRAIN-LOCAL-BACKWARD",), "accept", "float64 errors at most {local_backward.TOL64} against float64 "
         "autograd, finite differences within {local_backward.TOL_FD} (else reject)",
         "float64 rounding is near 1e-16, so more than the bound is a different formula; central differences "
         "keep truncation and cancellation far below theirs."),
    Rule(("TRAIN-ATTENTION-BACKWARD",), "accept", "float64 within {attention_backward.TOL64}, float32 within "
         "{attention_backward.TOL32} of SDPA, the layer within {attention_backward.TOL_MODULE} of Qwen2Attention, "
         "and saved bytes growing with exponent at most {attention_backward.LINEAR_MAX} where linear is claimed",
         "Two correct float32 implementations differ by rounding summed over T terms; the growth exponent of a "
         "linear state is 1, of a T×T one 2: the bound sits just above linear."),
    Rule(("TRAIN-SCHEDULER-CLOCK",), "accept", "every boundary on its nominal update and every applied update's "
         "rate equal to wsd_lr at its true index (else reject)",
         "The same float operations: exact, no tolerance."),
)

# The equalities the reasons above state; tests/book/test_rules.py holds the code to them.
LINKS = (("timing.MAX_RATIO_SPREAD", "decision.MAX_TIME_RATIO"), ("decision.MAX_TIME_RATIO", "4 / 3 * 9 / 8"),
         ("decision.MIN_USEFUL_SAVING", "ledger.LARGE_SHARE"), ("decision.MIN_PEAK_SAVING", "plan.ALLOCATOR_SLACK"),
         ("1 + accumulation.MAX_TIME_COST", "decision.MAX_TIME_RATIO"),
         ("amp.LOSS_REL_TOL", "2 * compare.LOW_TOL[0]"), ("ledger.STAGE_TOL", "ledger.LARGE_SHARE"),
         ("profiling.ATTRIBUTION_TOL", "ledger.LARGE_SHARE"),
         ("continual_pretrain.MIN_DOMAIN_GAIN_REL",
          "continual_pretrain.SPREAD_MULTIPLE * continual_pretrain.SEED_SPREAD_REL"),
         ("continual_pretrain.MAX_HOLDOUT_DRIFT_REL", "continual_pretrain.SEED_SPREAD_REL"),
         ("update_dynamics.MAX_UPDATE_RATIO", "100 * update_dynamics.RULE_OF_THUMB_RATIO"),
         ("update_dynamics.MAX_UPDATE_RATIO", "1 / 10"), ("update_dynamics.GRAD_SPIKE_MAX", "2"))

# Where each module decides: the functions whose constants must all have a rule.
DECIDERS = dict(timing=("timing_noise",), compare=("tolerance",), decision=("decide",),
                accumulation=("decide", "arm_record"), amp=("decide",), update_dynamics=("decide",),
                continual_pretrain=("decide_domain", "decide_resume"), ledger=("decide", "class_errors"),
                profiling=("decide",), memory_strategy=("budget_for",), plan=("headroom", "needed_bytes"),
                baseline=("decide", "beyond"), local_backward=("decide",), attention_backward=("decide",),
                scheduler=("decide",))


IGNORED = frozenset({"accumulation.MICRO"})  # read by a decider but not a threshold: micro-batches per arm


class _Formatter(string.Formatter):
    """``str.format`` with one more spec, ``bytes`` (``fmt_bytes``), and floats without a spec as ``g``."""

    def format_field(self, v, spec):
        if spec == "bytes":
            return fmt_bytes(v)
        if isinstance(v, float) and not spec:
            return format(v, "g")
        return super().format_field(v, spec)


def fill(text: str) -> str:
    """``text`` with its fields (``{alias.NAME:spec}``) replaced by the constants' values now."""
    return _Formatter().vformat(text, (), MODULES)


def fields(text: str) -> list[str]:
    """The constants ``text`` names, as ``"alias.NAME"``, in order."""
    names = [f for _, f, _, _ in string.Formatter().parse(text) if f]
    return list(dict.fromkeys(".".join(n.split("[")[0].split(".")[:2]) for n in names))


def value(expr: str):
    """The value of ``expr``, a Python expression over ``"alias.NAME"`` constants (``LINKS``)."""
    return eval(expr, {}, dict(MODULES))  # our own constant names, never input


def constants_read(alias: str, function: str) -> set[str]:
    """The module-level numeric constants (UPPER_CASE names holding a number, or a dict or tuple of numbers)
    that ``function`` of module ``alias`` reads, as ``"alias.NAME"``."""
    mod = MODULES[alias]
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(mod, function))))
    return {f"{alias}.{n.id}" for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id.isupper() and _numeric(getattr(mod, n.id, None))}


def _numeric(v) -> bool:
    if isinstance(v, dict):
        v = tuple(v.values())
    if isinstance(v, tuple):
        return bool(v) and all(_numeric(x) for x in v)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def rows() -> list[dict]:
    """The table: per rule the chapters it decides for, the outcome, the condition with the code's values,
    why, and the constants it reads; every value read from the modules now."""
    page = lambda sid: registry.get(sid).page.replace("Part 02 · ", "")  # noqa: E731
    return [{"chapters": ", ".join(page(s) for s in r.experiments), "outcome": r.outcome, "when": fill(r.when),
             "why": fill(r.why), "constants": ", ".join(fields(r.when))} for r in RULES]
