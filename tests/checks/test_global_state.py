"""``checks.global_state``: ``state`` sees every switch a graded function could leave flipped (and a module's train
flag and hooks), ``restore`` puts each back, ``clean`` starts from one state and gives the caller its own back."""

import pytest
import torch

from bp_mech.checks.global_state import clean, restore, state

FLIPS = {"grad mode": lambda: torch.set_grad_enabled(False),
         "default dtype": lambda: torch.set_default_dtype(torch.float64),
         "CPU autocast": lambda: torch.set_autocast_enabled("cpu", True),
         "torch RNG state": lambda: torch.rand(1)}


@pytest.mark.parametrize("what", list(FLIPS))
def test_state_sees_each_switch_and_restore_puts_it_back(what):
    before = state({})
    try:
        FLIPS[what]()
        after = state({})
        assert [w for w in before if before[w] != after[w]] == [what]
    finally:
        restore(before, {})
    assert state({}) == before


def test_a_module_s_train_flag_and_hooks_are_part_of_its_state():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = state({"model": m})
    m.eval()
    m[0].register_forward_hook(lambda *a: None)
    assert state({"model": m}) != before
    restore(before, {"model": m})
    assert m.training and m[0].training and not m[0]._forward_hooks


def test_clean_starts_from_one_state_and_gives_the_caller_its_own_back():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    before = state({})
    try:
        with clean():
            assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
            assert torch.get_num_threads() == 1
            torch.set_default_dtype(torch.float16)
        assert state({}) == before
    finally:
        restore({**before, "grad mode": True, "default dtype": torch.float32}, {})
