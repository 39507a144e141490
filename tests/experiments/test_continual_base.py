"""``experiments.continual_base``: a random-init model is pretrained (its general-text loss falls, the
updates applied), a pretrained one keeps its weights."""

import copy
from types import SimpleNamespace

import torch

from bp_mech.continual_eval import eval_batches, token_loss
from bp_mech.continual_pretrain import TrainConfig
from bp_mech.experiments import continual_base
from bp_mech.instruments.workload import build_model, load_text, parse_workload, tokenize

CFG = TrainConfig(updates=4, lr=3e-3, warmup=1, decay=1)


def test_a_random_init_model_learns_the_general_text():
    w = parse_workload("tiny-b2s16")
    ids = tokenize(load_text("general"))[:2000]
    untrained = build_model(w)
    model, rows = continual_base.base_model(w, ids, CFG)
    assert len(rows) == 4 and all(r.applied for r in rows)
    batches = eval_batches(ids[:512], 16, 8)
    assert token_loss(model, batches) < token_loss(untrained, batches)


def test_a_pretrained_workload_keeps_its_weights(monkeypatch):
    model = build_model(parse_workload("tiny-b1s8"))
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(continual_base, "build_model", lambda w, device: model)
    w = SimpleNamespace(source="pretrained", batch=1, seq=8)
    got, rows = continual_base.base_model(w, torch.arange(64), CFG)
    assert got is model and rows == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
