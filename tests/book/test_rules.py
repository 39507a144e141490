"""The table of decision rules (bp_mech.book.rules) against the code it describes: every threshold a decide
function reads has a rule, every value comes from the module now, the equalities the reasons state hold, and
the comparisons the table states (at most, below) are the ones the decide functions make."""

import itertools
import math

import pytest

from bp_mech.book import rules
from bp_mech.experiments import accumulation, amp, decision
from bp_mech.records import registry

COVERED = set(itertools.chain.from_iterable(rules.fields(r.when) for r in rules.RULES))


@pytest.mark.parametrize("alias, function", [(a, f) for a, fs in rules.DECIDERS.items() for f in fs])
def test_every_threshold_a_decider_reads_has_a_rule(alias, function):
    missing = rules.constants_read(alias, function) - COVERED - rules.IGNORED
    assert not missing, f"{alias}.{function} reads {sorted(missing)}: add a Rule with its reason to bp_mech.book.rules"


def test_every_experiment_that_decides_is_a_decider_and_has_a_rule():
    aliases = {mod.__name__: a for a, mod in rules.MODULES.items()}
    for e in registry.EXPERIMENTS.values():
        mod = e.load()
        if hasattr(mod, "decide"):
            assert "decide" in rules.DECIDERS[aliases[e.module]], e.module
        assert any(e.semantic_id in r.experiments for r in rules.RULES), f"{e.semantic_id} has no rule"
    assert {s for r in rules.RULES for s in r.experiments} <= set(registry.EXPERIMENTS)


def test_the_decider_check_sees_a_constant():
    assert rules.constants_read("decision", "decide") == {"decision.MIN_USEFUL_SAVING", "decision.MIN_PEAK_SAVING",
                                                          "decision.MAX_TIME_RATIO"}
    assert "accumulation.EQUIV_TOL" in rules.constants_read("accumulation", "arm_record")  # a dict of numbers


def test_every_field_names_a_constant():
    for r in rules.RULES:
        for name in rules.fields(r.when) + rules.fields(r.why):
            alias, const = name.split(".")
            assert hasattr(rules.MODULES[alias], const), name
        assert rules.fill(r.when) and "{" not in rules.fill(r.when) + rules.fill(r.why)


@pytest.mark.parametrize("left, right", rules.LINKS)
def test_the_equalities_the_reasons_state_hold(left, right):
    assert math.isclose(rules.value(left), rules.value(right), rel_tol=1e-12), (left, right)


def test_rows_read_the_values_now(monkeypatch):
    monkeypatch.setattr(decision, "MAX_TIME_RATIO", 1.7)
    monkeypatch.setattr(amp, "MAX_TIME_COST", 0.25)
    rows = rules.rows()
    assert any(r["when"] == "median step at most 1.7× plain's (else tune)" for r in rows)
    assert any(r["when"].startswith("median step at most 25% above FP32's") for r in rows)
    assert all(set(r) == {"chapters", "outcome", "when", "why", "constants"} for r in rows)
    assert rows[0]["chapters"] == "11, 12b, 19, 42, 76"


def test_bytes_and_plain_floats_are_formatted():
    assert rules.fill("{plan.CONTEXT_BYTES:bytes} {local_backward.TOL64} {decision.MIN_PEAK_SAVING:.0%}") == \
        "512.00 MiB 1e-10 10%"


def test_the_memory_strategies_rule_compares_as_the_table_says():
    lo, hi, t = decision.MIN_USEFUL_SAVING, decision.MIN_PEAK_SAVING, decision.MAX_TIME_RATIO
    assert decision.decide(True, hi, t).verdict == "accept"  # at most the bound, at least the floor
    assert decision.decide(True, hi, math.nextafter(t, 2)).verdict == "tune"
    assert decision.decide(True, math.nextafter(hi, 0), 1.0).verdict == "tune"
    assert decision.decide(True, math.nextafter(lo, 0), 1.0).verdict == "reject"
    assert decision.decide(True, hi, 1.0, noise="spread").verdict is None
    assert decision.decide(False, 1.0, 1.0).verdict == "reject"


def test_accumulation_and_amp_compare_as_the_table_says():
    tol = accumulation.EQUIV_TOL["cpu"]
    s, c = decision.MIN_PEAK_SAVING, accumulation.MAX_TIME_COST
    assert accumulation.decide(tol, tol, s, 1 + c).verdict == "accept"
    assert accumulation.decide(tol, tol, s, math.nextafter(1 + c, 2)).verdict == "tune"
    assert accumulation.decide(tol, tol, math.nextafter(s, 0), 1.0).verdict == "tune"
    assert accumulation.decide(math.nextafter(tol, 1), tol, s, 1.0).verdict == "reject"
    s, c, f, loss = decision.MIN_PEAK_SAVING, amp.MAX_TIME_COST, amp.MAX_SKIPPED_FRACTION, amp.LOSS_REL_TOL
    assert amp.decide(True, f, loss, s, 1 + c).verdict == "accept"
    assert amp.decide(True, f, loss, s, math.nextafter(1 + c, 2)).verdict == "tune"
    assert amp.decide(True, f, loss, math.nextafter(s, 0), 1.0).verdict == "tune"
    assert amp.decide(True, math.nextafter(f, 1), 0.0, s, 1.0).verdict == "reject"
    assert amp.decide(True, 0.0, math.nextafter(loss, 1), s, 1.0).verdict == "reject"
