"""``planner.report``: the plan's sentences on plans made by hand (the optimizer traced, the loop, what fits
instead) and the table's unit. The command's table and JSON on traced plans: ``tests/planner/test_plan.py``."""

from types import SimpleNamespace as NS

import pytest

from bp_mech.planner import report


def _plan(**kw):
    base = dict(options=NS(optimizer="adamw", adamw="foreach"), definition=NS(weights=None, keep_outputs=False),
                model=dict(parameters=1000), finetune=None, outputs_saving=None, budget=2**30)
    return NS(**{**base, **kw})


@pytest.mark.parametrize("values, unit", [([2**30, 5], (2**30, "GiB")), ([2**20], (2**20, "MiB")),
                                          ([2**20 - 1], (2**10, "KiB")), ([], (2**10, "KiB"))])
def test_the_table_s_unit_is_the_largest_its_top_value_reaches(values, unit):
    assert report._unit(values) == unit


def test_the_optimizer_the_weights_and_the_parameters_that_train():
    assert report.optimizer_text(_plan()) == ("foreach AdamW, PyTorch's default on CUDA; float32 weights; "
                                              "all parameters trained")
    fused = _plan(options=NS(optimizer="sgd", adamw="fused"), definition=NS(weights="bfloat16", keep_outputs=False),
                  model=dict(parameters=1000, trainable=25), finetune=NS(name="lora-r8"))
    assert report.optimizer_text(fused) == ("fused SGD (momentum 0.9), not PyTorch's default on CUDA (foreach); "
                                            "bfloat16 weights, no float32 master copy; 25 of 1,000 parameters "
                                            "trained (2.50%, lora-r8)")
    assert report.optimizer_text(_plan(options=NS(optimizer="adamw8bit", adamw="foreach"))).startswith("8-bit AdamW")


def test_the_loop_line_says_what_dropping_the_outputs_saves():
    assert report.loop_line(_plan()) == f"loop: {report.LOOPS[False]}"
    kept = _plan(definition=NS(weights=None, keep_outputs=True), outputs_saving=3 * 2**20)
    assert report.loop_line(kept) == f"loop: {report.LOOPS[True]}; dropping the outputs saves 3.00 MiB of the plain " \
                                     "step's peak"
    dropped = _plan(outputs_saving=2**20)
    assert report.loop_line(dropped).endswith("saves 1.00 MiB of the plain step's peak (--keep-outputs plans the "
                                              "loop that keeps them)")


def test_what_fits_instead_a_smaller_batch_a_shorter_sequence_or_nothing():
    f = dict(strategy="checkpoint-all", needs=3 * 2**30, batch=None, seq=None, small_shape=(1, 2),
             small_needs=2 * 2**30, model_state=2**30 + 2**29)
    start = "no strategy fits 1.00 GiB: the leanest, checkpoint-all, needs 3.00 GiB (with headroom)"
    assert report.no_fit_message(_plan(fits_instead=NS(**{**f, "batch": 4}))) == \
        start + "; --batch 4 fits with it (one more row does not)"
    assert report.no_fit_message(_plan(fits_instead=NS(**{**f, "seq": 96}))) == \
        start + "; --seq 96 fits with it (one more token does not)"
    assert report.no_fit_message(_plan(fits_instead=NS(**f))) == \
        start + ("; even at batch 1 x seq 2 it needs 2.00 GiB, and parameters, gradients and optimizer state alone "
                 "hold 1.50 GiB")
