"""Chapter 56's caveat on saved states, held on the real code: a save is atomic against a
killed process (temporary directory renamed into place) but nothing is fsynced, so after a
power loss only the manifest's sha256 tells a damaged file (that refusal is tested in
tests/test_continual_pretrain.py, "flipped byte")."""

import os

import torch

from bp_mech import state_format, training_state as ts
from bp_mech.instruments.workload import build_model, parse_workload
from bp_mech.bench.trainer import phase_trainer
from bp_mech.continual_data import TextStream
from bp_mech.continual_pretrain import TrainConfig


def _counting(calls, key, real):
    def wrapper(*args, **kwargs):
        calls[key] += 1
        return real(*args, **kwargs)
    return wrapper


def test_a_save_renames_into_place_and_never_fsyncs(tmp_path, monkeypatch):
    calls = {"fsync": 0, "rename": 0}
    for name, key in (("fsync", "fsync"), ("fdatasync", "fsync"), ("rename", "rename"),
                      ("replace", "rename")):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _counting(calls, key, getattr(os, name)))
    w = parse_workload("tiny-b1s8")
    t = phase_trainer(build_model(w), TrainConfig(), TextStream(torch.arange(64), 1, 8, 0))
    path = ts.save_training_state(t, tmp_path, {"workload_id": w.workload_id}, {"semantic_id": "X"})
    assert path.is_dir() and (tmp_path / state_format.LATEST).read_text().strip() == path.name
    assert calls["fsync"] == 0  # the caveat of chapter 56
    assert calls["rename"] >= 2  # the directory and ``latest``, each renamed into place
