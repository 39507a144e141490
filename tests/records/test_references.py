"""``records.references``: the course's reference figures in words (each time phrase, the summary that says
whose run it is), and the lookups by experiment and by strategy."""

import dataclasses

import pytest

from bp_mech.records import references
from bp_mech.records.references import REFERENCES, for_experiment, for_strategy

BASE = REFERENCES["TRAIN-CHECKPOINT"]


@pytest.mark.parametrize("ratio, phrase", [(1.0, "time about equal"), (1.0199, "time about equal"),
                                           (1.192, "median step up about 19.2%"), (0.8, "median step down about 20.0%"),
                                           (5.87, "median step 5.87×"), (2.0, "median step 2×")])
def test_the_time_phrase(ratio, phrase):
    assert dataclasses.replace(BASE, median_ratio=ratio).time_phrase() == phrase


def test_the_summary_names_the_course_s_run_and_every_figure():
    assert BASE.summary() == (f"{references.PHRASE} (RTX 5070 Ti, Qwen2.5-0.5B, run label b2s512_default2): gradient "
                              "checkpointing vs plain saving: peak down about 33.7%, median step up about 19.2%, "
                              "decision accept")
    acc = REFERENCES["TRAIN-GRADIENT-ACCUMULATION"]
    assert " at seq 256: peak down up to about 17.3%" in acc.summary()
    assert acc.summary().endswith("; short sequences: decision tune") and "decision None" not in acc.summary()
    assert BASE.source == f"{references.PHRASE} (RTX 5070 Ti, Qwen2.5-0.5B)"


def test_lookups_by_experiment_and_by_strategy():
    assert for_experiment("TRAIN-OFFLOAD") is REFERENCES["TRAIN-OFFLOAD"] and for_experiment("TRAIN-BASELINE") is None
    assert for_strategy("fp16").semantic_id == "TRAIN-AMP-BACKWARD" and for_strategy("micro2") is None
