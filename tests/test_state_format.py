"""``state_format``: tied names found by storage, offset and shape (not by name), ``latest`` resolved, a
file's hash by hashlib. Every refusal of a bad saved state (each field, each
file): ``tests/test_continual_pretrain.py``."""

import hashlib
import torch

from bp_mech.state_format import file_sha256, resolve, tied_names, unique_tensors
from bp_mech.instruments.workload import build_model, parse_workload


def test_a_tied_model_has_one_tensor_under_two_names():
    model = build_model(parse_workload("tiny-b1s8"))
    names = tied_names(model.state_dict())
    assert names["lm_head.weight"] == "model.embed_tokens.weight"
    assert sum(a != b for a, b in names.items()) == 1
    kept = unique_tensors(model.state_dict())
    assert "lm_head.weight" not in kept and len(kept) == len(names) - 1


def test_views_at_another_offset_or_shape_are_other_tensors():
    base = torch.arange(12.0)
    state = {"a": base, "b": base[:], "c": base[2:], "d": base.view(3, 4), "e": base.clone()}
    assert tied_names(state) == {"a": "a", "b": "a", "c": "c", "d": "d", "e": "e"}
    assert list(unique_tensors(state)) == ["a", "c", "d", "e"]


def test_latest_names_the_state_and_a_state_directory_is_itself(tmp_path):
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "latest").write_text("step-000004\n")
    assert resolve(tmp_path) == tmp_path / "step-000004"
    (tmp_path / "state.json").write_text("{}")  # a root that is itself a saved state
    assert resolve(tmp_path) == tmp_path
    assert resolve(tmp_path / "elsewhere") == tmp_path / "elsewhere"  # read_manifest says what is wrong


def test_a_file_s_hash_is_hashlib_s_over_all_its_chunks(tmp_path):
    data = bytes(range(256)) * 300
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
