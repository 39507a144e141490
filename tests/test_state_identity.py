"""``state_identity``: the sections a resumed run must share with the saved one, built from their parts."""

from types import SimpleNamespace

import torch

from bp_mech.continual_data import text_sha256
from bp_mech.continual_pretrain import TrainConfig
from bp_mech.state_identity import MODEL_CONFIG_KEYS, identity, model_config_identity


def test_the_identity_keeps_the_workload_the_config_the_text_and_the_architecture():
    ids, config = torch.arange(20), SimpleNamespace(hidden_size=8, model_type="qwen2")
    ident = identity({"workload_id": "x"}, TrainConfig(lr=0.5), ids, 2, 4, config)
    assert ident["data"] == dict(text_sha256=text_sha256(ids), text_tokens=20, batch=2, seq=4)
    assert ident["train_config"]["lr"] == 0.5 and ident["workload"] == {"workload_id": "x"}
    assert ident["model_config"] == model_config_identity(config)
    assert identity({}, TrainConfig(), ids, 2, 4)["model_config"] is None  # not compared


def test_a_field_the_config_lacks_is_none():
    fields = model_config_identity(SimpleNamespace(hidden_size=8, model_type="qwen2"))
    assert fields == {k: {"hidden_size": 8, "model_type": "qwen2"}.get(k) for k in MODEL_CONFIG_KEYS}
