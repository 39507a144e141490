"""``instruments.adamw``: the implementation picked per device, and one step of each against AdamW by hand
(float64, the update of Loshchilov & Hutter with PyTorch's bias correction)."""

import pytest
import torch

from bp_mech.instruments.adamw import ADAMW_IMPLS, adamw_impl, make_adamw, torch_default_adamw


def test_the_package_picks_fused_on_cuda_and_foreach_elsewhere():
    assert adamw_impl("cuda") == adamw_impl(torch.device("cuda", 1)) == "fused"
    assert adamw_impl("cpu") == "foreach"
    assert make_adamw([torch.nn.Parameter(torch.ones(1))], 1e-3, "cpu").defaults["foreach"] is True


def test_torch_s_own_default_is_the_for_loop_on_the_cpu_and_foreach_on_cuda():
    assert torch_default_adamw("cpu") == "for-loop"
    assert torch_default_adamw("cuda") == "foreach"


@pytest.mark.parametrize("impl", [i for i in ADAMW_IMPLS if i != "fused"])
def test_two_steps_equal_adamw_by_hand(impl):
    lr, (b1, b2), eps, wd = 0.1, (0.9, 0.999), 1e-8, 0.01
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = make_adamw([p], lr, "cpu", impl, weight_decay=wd, eps=eps, betas=(b1, b2))
    w, m, v = p.detach().double().clone(), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(([0.3, -1.0, 2.0], [0.1, 0.2, -0.4]), start=1):
        p.grad = torch.tensor(g)
        opt.step()
        g = torch.tensor(g, dtype=torch.float64)
        w = w * (1 - lr * wd)  # decoupled weight decay
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-7)


def test_an_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown AdamW implementation 'apex'"):
        make_adamw([torch.nn.Parameter(torch.ones(1))], 1e-3, "cpu", "apex")
