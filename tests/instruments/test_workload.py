import json

import pytest
import torch

from bp_mech.instruments.workload import (ARCHITECTURES, Workload, WorkloadError, build_model, load_text, make_batches, model_commit,
                              param_count,
                              parse_workload, resolve_pretrained, tokenize, workload_fields)


def test_workload_ids_are_stable_and_parse_back():
    w = parse_workload("tiny-b2s128")
    assert (w.arch, w.batch, w.seq, w.workload_id) == ("tiny", 2, 128, "tiny-b2s128")
    assert parse_workload("qwen05-b2s256-8gib").workload_id == "qwen05-b2s256-8gib"
    assert parse_workload(w.workload_id) == w


@pytest.mark.parametrize("bad", ["tiny", "tiny-b0s128", "gpt2-b2s128", "tiny-b2s4096", "qwen05-b2s40000"])
def test_bad_workloads_raise_clear_errors(bad):
    with pytest.raises(WorkloadError):
        parse_workload(bad)


def test_qwen05_is_the_qwen25_05b_architecture():
    from bp_mech.instruments.workload import qwen2_config
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config("qwen05")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert 490e6 < n < 500e6, n
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (14, 2, 4864)


def test_config_commit_is_a_hash_of_the_architecture():
    a, b = model_commit(parse_workload("tiny-b2s64")), model_commit(parse_workload("tiny-b4s32"))
    assert a == b and a.startswith("config-")
    assert a != model_commit(parse_workload("qwen05-b2s64"))


def test_model_and_batches_are_deterministic():
    w = parse_workload("tiny-b2s32")
    m1, m2 = build_model(w), build_model(w)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    b1, b2 = make_batches(w, 3), make_batches(w, 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(b1, b2))
    assert b1[0]["input_ids"].shape == (2, 32)
    assert not torch.equal(b1[0]["input_ids"], b1[1]["input_ids"])
    assert int(b1[0]["input_ids"].max()) < ARCHITECTURES["tiny"]["vocab_size"]
    other = make_batches(w.replace(seed=1), 1)
    assert not torch.equal(b1[0]["input_ids"], other[0]["input_ids"])


def test_shipped_texts_are_distinct():
    d, h = tokenize(load_text("domain")), tokenize(load_text("holdout"))
    assert len(d) > 1000 and len(h) > 500 and not torch.equal(d[:500], h[:500])


def _save_tiny(tmp_path):
    w = parse_workload("tiny-b1s16")
    model = build_model(w)
    path = tmp_path / "tiny-pretrained"
    model.save_pretrained(path)
    return model, path


def test_pretrained_path_loads_a_saved_model_offline(tmp_path):
    model, path = _save_tiny(tmp_path)
    w = Workload(arch="tiny", batch=1, seq=16, source="pretrained", model_id=str(path), local_files_only=True)
    loaded = build_model(w)
    x = make_batches(parse_workload("tiny-b1s16"), 1)[0]
    with torch.no_grad():
        assert torch.equal(model(**x).logits, loaded(**x).logits)
    f = workload_fields(w)
    assert f["model_source"] == "pretrained" and f["model_commit"].startswith("local-")
    assert f["model_commit"] == model_commit(w)  # stable


def test_pretrained_hub_id_resolves_to_the_snapshot_commit_offline(tmp_path, monkeypatch):
    """The hub path proper: a cache laid out as huggingface_hub does, resolved with local_files_only."""
    import huggingface_hub.constants as hc

    _, saved = _save_tiny(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--bp-mech--tiny-qwen2"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in saved.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    path, got = resolve_pretrained("bp-mech/tiny-qwen2", "main", local_files_only=True)
    assert got == commit and path.endswith(commit)
    w = Workload(arch="tiny", batch=1, seq=16, source="pretrained", model_id="bp-mech/tiny-qwen2",
                 local_files_only=True)
    assert model_commit(w) == commit
    assert json.loads((snap / "config.json").read_text())["hidden_size"] == 64
    assert build_model(w).config.hidden_size == 64


def test_param_count_matches_the_model():
    for arch in ("tiny", "qwen05"):
        from transformers import Qwen2ForCausalLM

        from bp_mech.instruments.workload import qwen2_config

        with torch.device("meta"):
            n = sum(p.numel() for p in Qwen2ForCausalLM(qwen2_config(arch)).parameters())
        assert param_count(arch) == n
    assert param_count("qwen05") == 494_032_768  # Qwen2.5-0.5B
