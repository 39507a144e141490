"""``rng_state``: after setting a captured state, torch's, Python's and NumPy's global generators draw again
exactly what they drew after the capture; the captured dict is not consumed."""

import copy
import random

import numpy as np
import torch

from bp_mech.rng_state import rng_states, set_rng_states


def _draws():
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), np.random.randn()


def test_the_draws_after_a_capture_repeat_after_setting_it():
    np.random.randn()  # a cached Gaussian: NumPy's state includes it
    state = rng_states("cpu")
    kept = copy.deepcopy(state)
    first = _draws()
    _draws()
    set_rng_states(state)
    assert _draws() == first
    set_rng_states(state)  # a second time: the dict still holds the capture
    assert _draws() == first
    assert torch.equal(state["torch"], kept["torch"]) and state["numpy"] == kept["numpy"]


def test_a_state_survives_torch_save_with_weights_only(tmp_path):
    state = rng_states("cpu")
    first = _draws()
    torch.save(state, tmp_path / "rng.pt")
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == first and set(state) == {"torch", "python", "numpy"}
