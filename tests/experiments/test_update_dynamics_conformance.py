"""``experiments.update_dynamics_conformance``: the row passes on the package's clipping and fails on a
clipping that is off by a little (so it can tell)."""

from bp_mech import update_dynamics
from bp_mech.experiments.update_dynamics_conformance import CONFORMANCE_TOL, conformance


def test_the_row_passes_on_the_package_s_clipping():
    row = conformance()
    assert row.passed and row.reference == "torch.nn.utils.clip_grad_norm_" and f"{CONFORMANCE_TOL:g}" in row.detail


def test_a_clipping_off_by_a_thousandth_fails(monkeypatch):
    right = update_dynamics.clip_by_global_norm_

    def off(params, max_norm):
        return right(params, max_norm * 1.001)  # clips to a slightly larger norm

    monkeypatch.setattr(update_dynamics, "clip_by_global_norm_", off)
    assert not conformance().passed
