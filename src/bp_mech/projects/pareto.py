"""Part 02 · 76, the decision: which memory strategy to run, from measured (peak, step time) points.

* ``pareto_front``: the candidates no other one beats in both peak and step time (both minimized);
* ``choose_for_budget``: the fastest candidate whose peak fits a budget with headroom
  (``bp_mech.planner.plan.needed_bytes``: the rule of ``bp-mech plan``, allocator slack on the peak
  plus the CUDA context);
* ``budget_decision``: both over the candidates that pass the quality check; a time ratio that is
  noise (``bench.timing.timing_noise``) decides nothing.

The memory–time plot of the Pareto set is ``bp_mech.book.project_plots.plot_frontier``.

Pure functions of the numbers: the exercises of chapter 76 ask for the first two, and
``bp_mech.projects.memory_strategy`` applies them to its measured candidates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bp_mech.bench.timing import timing_noise
from bp_mech.instruments.peak import fmt_bytes
from bp_mech.planner.plan import needed_bytes


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the Pareto-optimal points of ``{name: (peak, time)}`` (both minimized),
    ordered by increasing peak, then time, then name. Equal points do not dominate each
    other: both stay.

    One sweep in order of increasing peak: a point is optimal when its time is below
    every time seen so far, or when it repeats the point that set that time (the same
    peak and time).
    """
    if not all(math.isfinite(v) for p in points.values() for v in p):
        raise ValueError(
            f"pareto_front needs finite (peak, time) points, got {points}")
    front, best = [], None  # best: the last optimal point, the least time so far
    for name in sorted(points, key=lambda n: (points[n][0], points[n][1], n)):
        p = tuple(points[name])
        if best is None or p[1] < best[1] or p == best:
            front.append(name)
            best = p
    return front


def choose_for_budget(points: dict[str, tuple[float, float]], budget: float,
                      slack: float, context: float) -> str | None:
    """The fastest candidate that fits ``budget``:
    ``needed_bytes(peak, slack, context) <= budget``; a tie in time goes to the smaller
    peak, then the name. None when nothing fits."""
    fitting = [n for n, (peak, _) in points.items()
               if needed_bytes(peak, slack, context) <= budget]
    if not fitting:
        return None
    return min(fitting, key=lambda n: (points[n][1], points[n][0], n))


@dataclass(frozen=True)
class Candidate:
    """One candidate as the decision sees it (from a measurement or from a record)."""

    peak: int  # allocated peak of a full step, bytes
    median_s: float  # median step time
    p95_s: float  # P95 step time
    work: tuple[int, int, int]  # counted work: sublayer recomputes, offload D2H bytes, chunked-loss recomputes
    equal: bool  # finite, and loss and gradients within its tolerance of the plain step

    def more_work(self, other: "Candidate") -> bool:
        """Strictly more counted work than ``other``: no less of each kind, more of one."""
        return all(a >= b for a, b in zip(self.work, other.work)) and self.work != other.work


def from_records(recs) -> dict[str, Candidate]:
    """``Candidate`` of every record that did not fail."""
    return {r.candidate: Candidate(r.peak_allocated, r.step_median_s, r.step_p95_s,
                                  (r.recompute_count, (r.transfer_bytes or {}).get("d2h", 0),
                                   r.metrics["chunked_loss_recomputes"]), r.metrics["equal"])
            for r in recs if r.failure is None}


@dataclass(frozen=True)
class BudgetDecision:
    """The decision for a budget among the candidates that pass the quality check."""

    budget_bytes: float | None  # the budget (None: no budget, no pick)
    slack: float  # the allocator's slack on the peak
    context_bytes: float  # bytes outside the allocator (the CUDA context)
    pareto: list[str]  # the Pareto set, by increasing peak
    max_peak_bytes: float | None = None  # the largest peak that fits
    fitting: list[str] = dataclasses.field(default_factory=list)  # the candidates that fit, fastest first
    pick: str | None = None  # the fastest that fits, unless its time against the runner-up is noise
    fastest_fitting: str | None = None  # the fastest that fits, noise or not
    runner_up: str | None = None  # the next fastest that fits
    noise: str | None = None  # why the pick's time against the runner-up's is noise
    leanest: str | None = None  # when nothing fits: the candidate with the least peak
    leanest_needs_bytes: float | None = None  # and the budget it needs

    def to_dict(self) -> dict:
        """The fields as a dict (what a record's ``metrics["budget"]`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BudgetDecision":
        """The decision a record holds (``to_dict``'s output); unknown or missing required keys raise."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(d) - names:
            raise ValueError(f"BudgetDecision: unknown fields {sorted(unknown)}")
        return cls(**d)


def budget_decision(cands: dict[str, Candidate], budget: float | None, slack: float, context: float) -> BudgetDecision:
    """The decision for ``budget`` among the candidates that pass the quality check: the Pareto set, the
    largest peak that fits, the fitting candidates (fastest first) and the pick (``choose_for_budget``).
    No pick when the pick's time against the runner-up is noise (``bench.timing.timing_noise``: it does
    strictly more counted work yet ran faster, or the median and P95 ratios disagree): the time does not
    separate them. When nothing fits: the leanest candidate and the budget it needs."""
    points = {n: (c.peak, c.median_s) for n, c in cands.items() if c.equal}
    out = BudgetDecision(budget, slack, context, pareto_front(points) if points else [])
    if budget is None or not points:
        return out
    fitting = sorted((n for n, (p, _) in points.items() if needed_bytes(p, slack, context) <= budget),
                     key=lambda n: (points[n][1], points[n][0], n))
    out = dataclasses.replace(out, max_peak_bytes=(budget - context) / (1 + slack), fitting=fitting)
    pick = choose_for_budget(points, budget, slack, context)
    if pick is None:
        leanest = min(points, key=lambda n: (points[n][0], points[n][1], n))
        return dataclasses.replace(out, leanest=leanest,
                                   leanest_needs_bytes=needed_bytes(points[leanest][0], slack, context))
    runner = next((n for n in fitting if n != pick), None)  # the next fastest: "fitting" is in pick order
    noise = runner and timing_noise(cands[pick], cands[runner], cands[pick].more_work(cands[runner]), against=runner)
    return dataclasses.replace(out, pick=None if noise else pick, fastest_fitting=pick, runner_up=runner,
                               noise=noise or None)


def pick_text(d: BudgetDecision) -> str:
    """A ``budget_decision`` in words: the pick; or the two the time does not separate; or what would fit."""
    if d.pick:
        return d.pick
    if d.noise:
        return (f"none: {d.fastest_fitting} or {d.runner_up}, the time does not separate them (the first "
                f"against the second: {d.noise})")
    if d.leanest:

        return f"none: nothing fits; the leanest, {d.leanest}, needs {fmt_bytes(d.leanest_needs_bytes)} with the headroom"
    return "none: no candidate passed the quality check" if d.budget_bytes is not None else "none: no budget"
