"""One ``Decision`` for every rule (``bp_mech.records.decision``): each decide function returns it on each of
its branches, with a verdict of the ``Verdict`` literal (or None), a reason that names the numbers that fired
it, and the record fields a record takes from it."""

import inspect
import typing

import pytest

from bp_mech.experiments import (accumulation, amp, attention_backward, continual_pretrain_rule, decision, ledger,
                                 local_backward, scheduler, update_dynamics)
from bp_mech.ledger_table import STAGES, Ledger
from bp_mech.projects import baseline, profiling
from bp_mech.records import results
from bp_mech.records.decision import VERDICTS, Decision, Verdict


def _ledgers(saved: int) -> tuple[Ledger, Ledger]:
    def rows(a):
        return {s: dict.fromkeys(ledger.LARGE_CLASSES, 100) | {"saved_activations": a} for s in STAGES}

    return Ledger("formula", "plain", rows(saved)), Ledger("tracked-cpu", "plain", rows(100))


def _summary(**changes) -> update_dynamics.Summary:
    base = dict(all_finite=True, first_nonfinite=None, first_loss=5.0, last_loss=4.0, max_loss=5.0, spike=0.0,
                clipped_updates=0, max_grad_norm=1.0, grad_spike=1.0, max_ratio={"mlp": 0.01},
                max_ratio_at=dict(update=0, group="mlp"))
    return update_dynamics.Summary(**(base | changes))


# (rule, arguments, verdict, what its reason must say: the numbers that fired it)
BRANCHES = [
    (decision.decide, (False, 0.3, 1.0), "reject", ["tolerance"]),
    (decision.decide, (True, 0.03, 1.0), "reject", ["3.0%", "MIN_USEFUL_SAVING 5%"]),
    (decision.decide, (True, 0.07, 1.0), "tune", ["7.0%", "MIN_PEAK_SAVING 10%"]),
    (decision.decide, (True, 0.3, 1.2, "spread"), None, ["1.20x", "noise (spread)"]),
    (decision.decide, (True, 0.3, 1.2), "accept", ["30.0%", "1.20x", "MAX_TIME_RATIO 1.5x"]),
    (decision.decide, (True, 0.3, 1.8), "tune", ["1.80x", "MAX_TIME_RATIO 1.5x"]),
    (amp.decide, (False, 0.0, 0.0, 0.2, 1.0), "reject", ["non-finite"]),
    (amp.decide, (True, 0.3, 0.0, 0.2, 1.0), "reject", ["30%", "MAX_SKIPPED_FRACTION 25%"]),
    (amp.decide, (True, 0.0, 0.03, 0.2, 1.0), "reject", ["3.00%", "LOSS_REL_TOL 2%"]),
    (amp.decide, (True, 0.0, 0.0, 0.05, 1.0), "tune", ["5.0%", "MIN_PEAK_SAVING 10%"]),
    (amp.decide, (True, 0.0, 0.0, 0.2, 1.0, "spread"), None, ["1.00x", "noise (spread)"]),
    (amp.decide, (True, 0.0, 0.0, 0.2, 1.05), "accept", ["20.0%", "1.05x", "1.1x"]),
    (amp.decide, (True, 0.0, 0.0, 0.2, 1.3), "tune", ["1.30x", "MAX_TIME_COST 1.1x"]),
    (accumulation.decide, (2e-5, 1e-5, 0.3, 1.0), "reject", ["2.00e-05", "EQUIV_TOL 1e-05"]),
    (accumulation.decide, (1e-7, 1e-5, None, None), None, ["no full-batch measurement"]),
    (accumulation.decide, (1e-7, 1e-5, 0.05, 1.0), "tune", ["5.0%", "MIN_PEAK_SAVING 10%"]),
    (accumulation.decide, (1e-7, 1e-5, 0.3, 1.1, "spread"), None, ["1.10x", "noise (spread)"]),
    (accumulation.decide, (1e-7, 1e-5, 0.3, 1.2), "accept", ["30.0%", "rises by 20%", "MAX_TIME_COST 50%"]),
    (accumulation.decide, (1e-7, 1e-5, 0.3, 1.7), "tune", ["rises by 70%", "MAX_TIME_COST 50%"]),
    (attention_backward.decide, ("autograd", 0.0, 0.0, None, 2.0), None, ["reference"]),
    (attention_backward.decide, ("recompute", 0.0, 0.0, 0.0, 1.5), "reject", ["T^1.50", "LINEAR_MAX 1.1"]),
    (attention_backward.decide, ("recompute", 1e-12, 1e-7, 1e-7, 1.0), "accept", ["1e-12", "1e-07", "T^1.00"]),
    (local_backward.decide, ("gelu", 1e-16, 1e-9, 1e-9), "reject", ["gelu", "1e-09 > TOL64 1e-10"]),
    (local_backward.decide, ("gelu", 1e-16, 1e-14, 1e-9), "accept", ["gelu", "1e-14", "1e-09"]),
    (scheduler.decide, ({"warmup_end": 0, "end": 0}, 0.0), "accept", ["warmup_end, end"]),
    (scheduler.decide, ({"warmup_end": 3, "end": 0}, 0.0), "reject", ["warmup_end by +3"]),
    (update_dynamics.decide, (_summary(all_finite=False, first_nonfinite=2),), "reject", ["update 2"]),
    (update_dynamics.decide, (_summary(spike=0.7),), "tune", ["0.70 nats", "SPIKE_MAX 0.5"]),
    (update_dynamics.decide, (_summary(),), "accept", ["5.000 -> 4.000"]),
    (continual_pretrain_rule.decide_domain, (0.1, 0.0, False), "reject", ["not finite"]),
    (continual_pretrain_rule.decide_domain, (0.005, 0.0, True), "reject", ["0.50%", "MIN_DOMAIN_GAIN_REL 18%"]),
    (continual_pretrain_rule.decide_domain, (0.3, 0.07, True), "tune", ["+7.00%", "MAX_HOLDOUT_DRIFT_REL 6%"]),
    (continual_pretrain_rule.decide_domain, (0.3, 0.01, True), "accept", ["30.00%", "+1.00%"]),
    (continual_pretrain_rule.decide_resume, (0.0, 0.0, "cuda"), "accept", ["RESUME_TOL 0.0001 on cuda"]),
    (continual_pretrain_rule.decide_resume, (0.0, 2e-3, "cuda"), "reject", ["0.002", "RESUME_TOL 0.0001"]),
    (ledger.decide, _ledgers(100), "accept", ["+0.0%", "STAGE_TOL 5%", "CLASS_TOL 3%"]),
    (ledger.decide, _ledgers(80), "tune", ["-20.0%", "CLASS_TOL 3%"]),
    (baseline.decide, (False, 5.0, 4.0), "reject", ["not finite"]),
    (baseline.decide, (True, 5.0, 4.0, 2, (0.0, 1e-3, 0.0)), "reject", ["loss 0.001 > LOSS_TOL 1e-05"]),
    (baseline.decide, (True, 5.0, 5.5), "tune", ["5.0000 -> 5.5000"]),
    (baseline.decide, (True, 5.0, 4.0, 2, (0.0, 0.0, 0.0)), "accept", ["5.0000 -> 4.0000"]),
    (profiling.decide, (0.02, "backward", "backward"), "accept", ["+2.0%", "ATTRIBUTION_TOL 5%"]),
    (profiling.decide, (-0.08, "backward", "forward"), "tune", ["-8.0%", "ATTRIBUTION_TOL 5%"]),
]


@pytest.mark.parametrize("rule, args, verdict, says", BRANCHES,
                         ids=[f"{r.__module__.split('.')[-1]}.{r.__name__}-{v}-{i}"
                              for i, (r, _, v, _) in enumerate(BRANCHES)])
def test_every_branch_of_every_rule_is_a_decision_that_names_its_numbers(rule, args, verdict, says):
    d = rule(*args)
    assert type(d) is Decision and d.verdict == verdict and (d.verdict is None or d.verdict in typing.get_args(Verdict))
    assert d.reason and all(s in d.reason for s in says), d.reason
    assert d.record_fields() == dict(decision=verdict, next_step=d.next_step and f"{d.reason}: {d.next_step}")
    if verdict in ("tune", "reject"):
        assert d.next_step, "a tune or a reject says what to do next"


def test_every_rule_is_covered_and_typed():
    rules = {(r.__module__, r.__name__) for r, *_ in BRANCHES}
    assert len(rules) == 12
    for module, name in rules:
        fn = getattr(__import__(module, fromlist=[name]), name)
        assert inspect.signature(fn).return_annotation in (Decision, "Decision"), (module, name)
        params = inspect.signature(fn).parameters
        assert "summary" not in params and "check" not in params, (module, name)  # typed inputs, no dict bags
    for rule in {r for r, *_ in BRANCHES}:  # each rule's accept and its tune or reject are listed
        verdicts = {v for r, _, v, _ in BRANCHES if r is rule}
        assert "accept" in verdicts and verdicts & {"tune", "reject"}, rule


def test_the_verdicts_are_the_records_decisions():
    assert VERDICTS == ("accept", "tune", "reject") == results.DECISIONS


def test_a_decision_checks_itself():
    with pytest.raises(ValueError, match="unknown verdict 'maybe'"):
        Decision("maybe", "why")
    with pytest.raises(ValueError, match="states its reason"):
        Decision("accept", "")
    f = Decision.failed("out of memory: CUDA")
    assert f.record_fields() == dict(decision=None, next_step="failed: out of memory: CUDA: see the failure")
    assert Decision(None, "noise").record_fields() == dict(decision=None, next_step=None)
    assert Decision("tune", "x", "y") == Decision("tune", "x", "y") and hash(Decision("tune", "x", "y"))
