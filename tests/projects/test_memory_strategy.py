"""Part 02 · 76, the project: the decision (Pareto frontier, the pick under a budget) and its exercise
checks against the classic mistakes; the measured run (records, quality per strategy, the dry-run plan)."""

import math
import random

import pytest
import torch

from bp_mech.bench import strategy
from bp_mech.bench.compare import EXACT_TOL, LOW_TOL, REORDER_TOL, tolerance
from bp_mech.bench.oom import Failed
from bp_mech.experiments import harness
from bp_mech.planner.plan import headroom, needed_bytes
from bp_mech.projects import memory_strategy as ms, pareto
from bp_mech.records import registry
from bp_mech.records.results import load_record, save_record
from bp_mech.instruments.workload import build_model, make_batches, parse_workload
from bp_mech.checks import ex76
from conftest import mutant

EX = "ex76_memory_strategy"

# --- the decision --------------------------------------------------------------------------------


def test_pareto_front_matches_brute_force_dominance():
    rng = random.Random(0)
    for _ in range(200):
        pts = {f"p{i}": (rng.randint(1, 4), rng.randint(1, 4) * 0.5) for i in range(rng.randint(1, 9))}
        front = pareto.pareto_front(pts)
        assert front == ex76.reference_front(pts)  # every pair compared
        assert [pts[n] for n in front] == sorted(pts[n] for n in front)  # ordered by peak, then time


def test_pareto_front_ties_and_errors():
    assert pareto.pareto_front({"b": (1, 1.0), "a": (1, 1.0), "c": (1, 2.0), "d": (2, 1.0)}) == ["a", "b"]
    with pytest.raises(ValueError):
        pareto.pareto_front({"nan": (1, math.nan)})


def test_choose_for_budget_rule():
    gib = 2**30
    pts = {"plain": (10 * gib, 1.0), "ckpt": (7 * gib, 1.3), "lean": (5 * gib, 2.0)}
    assert pareto.choose_for_budget(pts, 16 * gib, 0.1, gib // 2) == "plain"
    assert pareto.choose_for_budget(pts, 9 * gib, 0.25, gib // 4) == "ckpt"  # 7 x 1.25 + 0.25 = 9 GiB: equality fits
    assert pareto.choose_for_budget(pts, 9 * gib, 0.25, gib // 2) == "lean"
    assert pareto.choose_for_budget(pts, 4 * gib, 0.0, 0) is None
    assert needed_bytes(4 * gib, 0.1, gib // 2) == pytest.approx(4.9 * gib)
    with pytest.raises(ValueError):
        needed_bytes(gib, -0.1, 0)


# --- the exercise checks: pass on the answers, reject the classic mistakes ---------------------------


def _front_strict_both(points):  # "dominates" with < in both coordinates: keeps equal-peak, longer-time points
    return sorted((n for n, p in points.items() if not any(q[0] < p[0] and q[1] < p[1] for q in points.values())),
                  key=lambda n: (points[n][0], points[n][1], n))


def _front_no_strict(points):  # <= in both without "strictly better in one": equal points remove each other
    return sorted((n for n, p in points.items()
                   if not any(m != n and q[0] <= p[0] and q[1] <= p[1] for m, q in points.items())),
                  key=lambda n: (points[n][0], points[n][1], n))


def _sweep(points, keep):  # sweep by peak with a wrong keep-test
    out, best = [], math.inf
    for n in sorted(points, key=lambda n: (points[n][0], points[n][1], n)):
        if keep(points[n][1], best):
            out.append(n)
            best = min(best, points[n][1])
    return out


def _front_unordered(points):  # the right set in insertion order
    front = set(pareto.pareto_front(points))
    return [n for n in points if n in front]


def _front_maximizing(points):  # the frontier of the wrong corner
    return pareto.pareto_front({n: (-p, -t) for n, (p, t) in points.items()})


def _choose(fits, key=lambda p: (p[1], p[0])):
    def choose(points, budget, slack, context):
        ok = sorted(n for n, p in points.items() if fits(p[0], budget, slack, context))
        return min(ok, key=lambda n: key(points[n])) if ok else None
    return choose


RIGHT = lambda p, b, s, c: p * (1 + s) + c <= b  # noqa: E731


def _choose_min_peak_when_none_fits(points, budget, slack, context):
    return pareto.choose_for_budget(points, budget, slack, context) or min(points, key=lambda n: points[n][0])


def _choose_last_name_on_full_tie(points, budget, slack, context):
    ok = sorted((n for n, p in points.items() if RIGHT(p[0], budget, slack, context)), reverse=True)
    return min(ok, key=lambda n: (points[n][1], points[n][0])) if ok else None


MUTANTS = {
    "front-strict-in-both": (ex76.check_pareto_front, dict(pareto_front=_front_strict_both)),
    "front-equal-points-removed": (ex76.check_pareto_front, dict(pareto_front=_front_no_strict)),
    "front-sweep-keeps-equal-time": (ex76.check_pareto_front,
                                     dict(pareto_front=lambda p: _sweep(p, lambda t, best: t <= best))),
    "front-sweep-drops-duplicates": (ex76.check_pareto_front,
                                     dict(pareto_front=lambda p: _sweep(p, lambda t, best: t < best))),
    "front-random-strict-in-both": (ex76.check_pareto_front__random, dict(pareto_front=_front_strict_both)),
    "front-random-unordered": (ex76.check_pareto_front__random, dict(pareto_front=_front_unordered)),
    "front-maximizing": (ex76.check_pareto_front__random, dict(pareto_front=_front_maximizing)),
    "budget-without-headroom": (ex76.check_choose_for_budget,
                                dict(choose_for_budget=_choose(lambda p, b, s, c: p <= b))),
    "headroom-without-context": (ex76.check_choose_for_budget,
                                 dict(choose_for_budget=_choose(lambda p, b, s, c: p * (1 + s) <= b))),
    "slack-on-the-budget": (ex76.check_choose_for_budget,
                            dict(choose_for_budget=_choose(lambda p, b, s, c: p <= b * (1 - s) - c))),
    "edge-does-not-fit": (ex76.check_choose_for_budget,
                          dict(choose_for_budget=_choose(lambda p, b, s, c: p * (1 + s) + c < b))),
    "least-peak-not-least-time": (ex76.check_choose_for_budget,
                                  dict(choose_for_budget=_choose(RIGHT, lambda p: p))),
    "something-when-nothing-fits": (ex76.check_choose_for_budget,
                                    dict(choose_for_budget=_choose_min_peak_when_none_fits)),
    "time-tie-to-larger-peak": (ex76.check_choose_for_budget__ties,
                                dict(choose_for_budget=_choose(RIGHT, lambda p: (p[1], -p[0])))),
    "full-tie-to-last-name": (ex76.check_choose_for_budget__ties,
                              dict(choose_for_budget=_choose_last_name_on_full_tie)),
    "random-without-headroom": (ex76.check_choose_for_budget__random,
                                dict(choose_for_budget=_choose(lambda p, b, s, c: p <= b))),
    "random-without-context": (ex76.check_choose_for_budget__random,
                               dict(choose_for_budget=_choose(lambda p, b, s, c: p * (1 + s) <= b))),
    "random-least-peak": (ex76.check_choose_for_budget__random, dict(choose_for_budget=_choose(RIGHT, lambda p: p))),
}


def test_checks_pass_on_the_answers():
    answers = mutant(EX)
    for check in ex76.CHECKS:
        check(answers)


@pytest.mark.parametrize("name", MUTANTS)
def test_checks_catch_the_classic_mistakes(name):
    check, overrides = MUTANTS[name]
    with pytest.raises(AssertionError, match=r"^(pareto_front|choose_for_budget): "):
        check(mutant(EX, **overrides))


# --- the decision over measured candidates ---------------------------------------------------------


def _m(peak, median, p95=None, work=(0, 0, 0), equal=True):
    return pareto.Candidate(peak, median, median if p95 is None else p95, work, equal)


def test_budget_decision_picks_the_fastest_fitting_equal_candidate():
    cands = {"plain": _m(100, 1.0), "ckpt": _m(60, 1.3, work=(4, 0, 0)), "lean": _m(40, 2.0, work=(4, 10, 1)),
             "broken": _m(10, 0.5, equal=False)}  # fails the quality check: never on the front, never picked
    d = pareto.budget_decision(cands, 80, 0.1, 5)  # fits: peak <= 75 / 1.1 = 68.2
    assert d.pareto == ["lean", "ckpt", "plain"] and d.fitting == ["ckpt", "lean"]
    assert d.pick == d.fastest_fitting == "ckpt" and d.runner_up == "lean" and d.noise is None
    assert d.max_peak_bytes == pytest.approx(75 / 1.1)
    nothing = pareto.budget_decision(cands, 40, 0.1, 5)
    assert nothing.pick is None and nothing.leanest == "lean"
    assert nothing.leanest_needs_bytes == pytest.approx(49)
    assert "nothing fits" in pareto.pick_text(nothing)


def test_a_noisy_time_picks_nothing():
    # "lean" does strictly more counted work than "ckpt" (more recomputes, same otherwise) yet ran faster
    cands = {"ckpt": _m(60, 1.3, work=(4, 0, 0)), "lean": _m(40, 1.2, work=(8, 0, 0))}
    d = pareto.budget_decision(cands, 100, 0.0, 0)
    assert d.fastest_fitting == "lean" and d.pick is None and "more work" in d.noise
    # median and P95 ratios that disagree by more than MAX_RATIO_SPREAD
    d = pareto.budget_decision({"a": _m(60, 1.0, 5.0), "b": _m(40, 1.1, 1.2, work=(1, 0, 0))}, 100, 0.0, 0)
    assert d.pick is None and "differ" in d.noise
    assert "does not separate" in pareto.pick_text(d)


def test_tolerance_follows_what_the_strategy_changes():
    parse = strategy.parse
    assert tolerance(parse("checkpoint-all+offload"), "cpu") == (0.0, 0.0)
    assert tolerance(parse("checkpoint-all+offload"), "cuda") == EXACT_TOL["cuda"]
    assert tolerance(parse("micro2"), "cpu") == tolerance(parse("chunked-loss"), "cpu") == REORDER_TOL
    assert tolerance(parse("checkpoint-all+fp16+chunked-loss"), "cpu") == LOW_TOL
    assert ms.budget_for("cuda", None) == ms.GPU_BUDGET and ms.budget_for("cpu", 1000) == 800
    assert headroom("cpu")[1] == 0 and headroom("cuda")[1] > 0


# --- the measured run ----------------------------------------------------------------------------


# every mechanism once, and the combination of all but accumulation: the run's code paths, in half the time
SOME = ("plain", "checkpoint-all", "offload", "fp16", "micro2", "chunked-loss",
        "checkpoint-all+offload+fp16+chunked-loss")


def test_run_writes_valid_records(tmp_path, cpu_only, monkeypatch):
    """Quality, capacity, time and the decision of every candidate, from one smoke run of the tiny model."""
    assert set(SOME) <= set(ms.CANDIDATES)
    monkeypatch.setattr(ms, "candidates", lambda ctx: SOME)  # a smoke run would measure SMOKE_CANDIDATES only
    ctx = registry.make_context("TRAIN-MEMORY-STRATEGY", "cpu", "tiny-b2s32", smoke=True)
    recs = ms.run(ctx)
    assert [r.candidate for r in recs] == list(SOME)
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    plain, L = by["plain"], len(by["plain"].metrics["forward_calls"]["layer"])
    assert plain.decision is None and plain.output_error is None and plain.recompute_count == 0
    steps = sum(ms.schedule("cpu", smoke=True)) + 1  # the tracked step, warm-up, timed
    for name, r in by.items():
        s = strategy.parse(name)
        assert r.failure is None and r.all_finite and r.metrics["equal"], name
        assert r.memory_source == "tracked-cpu" and r.evidence_level == "cpu-mechanism" and r.threads == 1
        assert r.strategy == name
        assert r.updates + r.skipped_updates == steps == len(r.metrics["applied_per_step"])
        assert r.recompute_count == (2 * L if s.checkpoint == "checkpoint-all" else 0), name  # micro2: no recompute
        assert (r.transfer_bytes is not None) == s.offload
        if s.offload:
            assert r.transfer_bytes["d2h"] == r.transfer_bytes["h2d"] > 0
        assert abs(r.metrics["plan"]["error"]) <= 0.02, (name, r.metrics["plan"])  # bp-mech plan's validated bound
        if name == "plain":
            continue
        loss_tol, grad_tol = tolerance(s, "cpu")
        assert r.output_error <= loss_tol and r.grad_error <= grad_tol, name
        if s.amp is None and s.micro_batches == 1 and s.chunked_loss is None:
            assert r.metrics["bitwise_equal"], name  # checkpointing and offload change no operation
        if s.amp is not None:
            assert r.grad_error > 1e-6, name  # fp16 rounding shows: autocast really ran
    assert by["checkpoint-all"].peak_allocated < plain.peak_allocated
    assert by["offload"].peak_allocated < plain.peak_allocated
    decision = plain.metrics["budget"]
    assert all(r.metrics["budget"] == decision for r in by.values())
    assert pareto.budget_decision(pareto.from_records(list(by.values())), decision["budget_bytes"],
                                  *headroom("cpu")).to_dict() == decision  # the records hold everything the rule needs
    assert decision["budget_bytes"] == int(ms.CPU_BUDGET_FRACTION * plain.peak_allocated)
    assert decision["pareto"] == pareto.pareto_front({n: (r.peak_allocated, r.step_median_s) for n, r in by.items()})


def test_an_out_of_memory_candidate_is_its_failure_and_the_run_goes_on(cpu_only, monkeypatch):
    real = harness.train_step

    def oom_under_offload(model, opt, batch, s, *a, **k):
        if s.offload:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, opt, batch, s, *a, **k)

    monkeypatch.setattr(harness, "train_step", oom_under_offload)
    w = parse_workload("tiny-b2s32")
    model = build_model(w)
    names = ("plain", "offload", "checkpoint-all")
    results = ms.measure(model, make_batches(w, 2), "cpu", names, smoke=True)
    assert isinstance(results["offload"], Failed) and results["offload"].failure.startswith("out of memory")
    ctx = registry.make_context("TRAIN-MEMORY-STRATEGY", "cpu", w)
    recs = {r.candidate: r for r in ms.budget_records(ctx, results)}
    assert recs["offload"].failure and recs["offload"].decision is None and recs["offload"].peak_allocated is None
    assert recs["checkpoint-all"].metrics["bitwise_equal"]
    assert "offload" not in recs["plain"].metrics["budget"]["pareto"]
    assert not any(l.gradient_checkpointing for l in model.model.layers)  # every configuration was undone


def test_the_dry_run_estimates_the_gpu_run_at_about_three_minutes():
    p = registry.dry_run(registry.make_context("TRAIN-MEMORY-STRATEGY", "dry_run", "qwen05-b2s512"))
    gpu, cpu = p["modes"]["real_gpu"], p["modes"]["cpu"]
    assert p["candidates"] == list(ms.CANDIDATES)
    assert gpu["timed_rounds"] >= 20 and gpu["budget_bytes"] == ms.GPU_BUDGET and gpu["estimated_seconds"] <= 180
    assert (cpu["timed_rounds"], cpu["warmup_rounds"]) == ms.CPU_SCHEDULE and cpu["threads"] == 1


@pytest.mark.gpu
def test_gpu_run_records_allocator_peaks(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    recs = ms.run(registry.make_context("TRAIN-MEMORY-STRATEGY", "real_gpu", "tiny-b2s64", smoke=True))
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    for name, r in by.items():
        assert r.failure is None and r.memory_source == "cuda-allocator" and r.metrics["equal"], name
        assert r.peak_reserved >= r.peak_allocated > 0 and "plan" in r.metrics
    assert by["checkpoint-all"].peak_allocated < by["plain"].peak_allocated


def test_a_smoke_run_measures_every_mechanism_once_in_three_candidates():
    smoke = registry.make_context("TRAIN-MEMORY-STRATEGY", "dry_run", "qwen05-b1s128", smoke=True)
    full = registry.make_context("TRAIN-MEMORY-STRATEGY", "dry_run", "qwen05-b2s512")
    assert ms.candidates(smoke) == ms.SMOKE_CANDIDATES and ms.candidates(full) == ms.CANDIDATES
    parts = [strategy.parse(n) for n in ms.SMOKE_CANDIDATES]
    assert set(ms.SMOKE_CANDIDATES) <= set(ms.CANDIDATES) and ms.SMOKE_CANDIDATES[0] == "plain"
    assert any(p.checkpoint != "plain" for p in parts) and any(p.offload for p in parts)
    assert any(p.amp for p in parts) and any(p.micro_batches > 1 for p in parts) and any(p.chunked_loss for p in parts)
