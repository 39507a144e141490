"""``continual_eval``: domain gain, holdout drift and the resumed run's differences, by hand. The windows of
``eval_batches`` and ``token_loss`` against Transformers' own loss: ``tests/test_continual_pretrain.py``."""

import math

import pytest
import torch

from bp_mech.continual_eval import gain_and_drift, resume_difference


def test_gain_and_drift_between_the_first_and_the_last_evaluation():
    evals = [dict(update=0, domain=4.0, holdout=2.0), dict(update=3, domain=3.0, holdout=2.6),
             dict(update=6, domain=2.5, holdout=2.4)]
    assert gain_and_drift(evals) == dict(domain_gain=1.5, holdout_drift=pytest.approx(0.4), domain_gain_rel=0.375,
                                         holdout_drift_rel=pytest.approx(0.2), updates=6,
                                         max_holdout_drift=pytest.approx(0.6), max_drift_update=3)


def test_a_run_that_improves_the_holdout_has_negative_drift():
    r = gain_and_drift([dict(update=2, domain=3.0, holdout=2.0), dict(update=5, domain=3.5, holdout=1.5)])
    assert (r["domain_gain"], r["holdout_drift"], r["updates"]) == (-0.5, -0.5, 3)


def _run(losses, evals):
    return dict(steps=[dict(loss=x) for x in losses], evals=evals)


def test_a_resumed_run_that_repeats_the_main_one_is_bitwise_equal():
    main = _run([5.0, 4.0, 3.0, 2.0], [dict(update=4, domain=1.0, holdout=2.0)])
    resumed = _run([3.0, 2.0], [dict(update=4, domain=1.0, holdout=2.0)])
    w = [torch.tensor([1.0, -2.0])]
    r = resume_difference(main, resumed, dict(updates=1, skipped=1), w, [t.clone() for t in w])
    assert r == dict(from_update=1, loss_rel_diff=0.0, eval_abs_diff=0.0, weight_rel_diff=0.0, bitwise=True, steps=2)


def test_each_difference_is_measured_where_both_runs_have_it():
    main = _run([5.0, 4.0, 3.0], [dict(update=1, domain=1.0, holdout=2.0), dict(update=3, domain=0.5, holdout=2.5)])
    resumed = _run([4.4, 3.0], [dict(update=3, domain=0.75, holdout=2.5), dict(update=9, domain=0.0, holdout=0.0)])
    final, got = [torch.tensor([2.0, -4.0]), torch.ones(1)], [torch.tensor([2.0, -3.0]), torch.ones(1)]
    r = resume_difference(main, resumed, dict(updates=1, skipped=0), final, got)
    assert r["loss_rel_diff"] == pytest.approx(0.4 / 4.0)  # step 1 of main against the resumed run's first
    assert r["eval_abs_diff"] == 0.25  # update 9 is not in main: not compared
    assert r["weight_rel_diff"] == 1.0 / 4.0 and not r["bitwise"]
    shorter = resume_difference(main, _run([4.0], []), dict(updates=1, skipped=0), final, final)
    assert shorter["loss_rel_diff"] == math.inf and shorter["steps"] == 1
