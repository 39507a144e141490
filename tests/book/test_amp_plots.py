"""The mixed-precision figure's numbers (``bp_mech.book.amp_plots``): float16's range against the IEEE
binary16 constants, the shares that round to 0, stay subnormal or overflow, on hand-picked values and on
a real tiny step."""

import matplotlib
import pytest
import torch

from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.book.amp_plots import (
    StepGradients,
    fp16_range,
    matmul_output_gradients,
    plot_fp16_range,
)

matplotlib.use("Agg")


def test_range_is_binary16():
    r = fp16_range()  # binary16: 5 exponent bits (bias 15), 10 fraction bits
    assert r.subnormal == 2.0**-14 * 2.0**-10 and r.normal == 2.0**-14
    assert r.max == (2 - 2.0**-10) * 2.0**15


def test_shares_on_chosen_values():
    v = torch.tensor([2.0**-26, 2.0**-20, 1.0, 2.0**15])  # rounds to 0, subnormal, normal, normal
    g = StepGradients(v, 0, "x")
    assert g.underflow() == pytest.approx(0.25) and g.subnormal() == pytest.approx(0.25)
    assert g.overflow() == 0.0 and g.overflow(2.0) == pytest.approx(0.25)  # 2^16 > 65504
    # times 2^4: 2^-22 and 2^-16, both subnormal now, nothing rounds to 0
    assert g.underflow(2.0**4) == 0.0 and g.subnormal(2.0**4) == pytest.approx(0.5)


def test_real_step_records_every_linear_output():
    w = parse_workload("tiny-b2s8")
    g = matmul_output_gradients("tiny-b2s8")
    model = build_model(w)
    expected = sum(w.batch * w.seq * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert g.values.numel() + g.zeros == expected and bool((g.values > 0).all())
    assert g.workload == w.workload_id
    # scaling lifts small gradients: fewer elements round to 0 at the default initial scale
    assert g.underflow(2.0**16) <= g.underflow()
    fig = plot_fp16_range(g, 2.0**16, "t")
    assert len(fig.axes[0].lines) == 3  # the three landmarks
