"""Every causal LM Transformers builds, through ``bp-mech plan`` (``bp_mech.planner.sweep``): each model type of
the causal-LM mapping, its default config cut to two layers, at batch 1 x seq 64, is planned or refused
with one line; none crashes. The planned ones include every family validated against a real step
(test_plan.py).

The whole sweep takes minutes on two cores, so it is a computed record (``book.computations.sweep_outcomes``),
made by ``make records`` (or ``python -m bp_mech.planner.sweep`` to see it) and refused when the code or
the libraries changed since; these tests read it. A sample of model types is planned live here and must
come out as the record says."""

import pytest

from bp_mech.book import computations
from bp_mech.planner import inputs, plan, sweep
from bp_mech.planner.pool import default_workers

# planned live by every test run: two validated families, and every 16th model type of the mapping
SAMPLE_EVERY = 16


@pytest.fixture(scope="module")
def outcomes():
    return computations.sweep_outcomes()


def test_a_sample_planned_now_comes_out_as_the_record_says(outcomes):
    types = sweep.model_types()
    sample = ["qwen2", "gpt2", *types[::SAMPLE_EVERY]]
    live = sweep.sweep(sample, workers=default_workers())
    assert {t: outcomes[t] for t in sample} == live


def test_no_model_type_crashes(outcomes):
    crashed = {t: d for t, (kind, d) in outcomes.items() if kind == "crashed"}
    assert not crashed, crashed
    assert set(outcomes) == set(sweep.model_types()) and len(outcomes) > 150


def test_refusals_are_one_line_and_say_why(outcomes):
    for t, (kind, detail) in outcomes.items():
        if kind in ("refused", "no-config"):
            assert detail and "\n" not in detail and "Traceback" not in detail, (t, detail)


def test_the_validated_families_are_planned_with_every_mechanism(outcomes):
    for family in inputs.FAMILIES:
        kind, detail = outcomes[family]
        assert kind == "planned", (family, detail)
        assert "could not be traced" not in detail, (family, detail)


def test_most_families_are_planned(outcomes):
    """Transformers 5.17 (pinned) builds 178 causal LMs; the plan takes 151 of them. The rest: 13 default
    configs Transformers itself cannot build or read, and operations fake tensors cannot run (a value read
    in Python: data-dependent routing, ``nonzero``). Issue 30: the encoders among them (BERT-style models with
    ``is_decoder`` false, XLM as an encoder: some 17) are refused now, one line each (``planner.causal``)."""
    planned = sum(kind == "planned" for kind, _ in outcomes.values())
    encoders = sum(kind == "refused" and "does not attend causally" in d for kind, d in outcomes.values())
    assert planned + encoders >= 150 and planned >= 130, (planned, encoders)


def test_a_strategy_that_does_not_apply_is_left_out_with_its_reason():
    from transformers import AutoConfig

    from bp_mech.bench import strategy as S
    from bp_mech.bench.optimizer import StepOptions

    config = sweep.two_layers(AutoConfig.for_model("gemma2"))  # soft-capped logits
    p = plan.plan(config, 1, 16, 2**40, options=StepOptions().for_device("cuda"),
                  candidates=(S.PLAIN, S.parse("chunked-loss")))
    assert [r.strategy for r in p.rows] == ["plain"]
    assert "soft-caps its logits" in p.skipped["chunked-loss"]
