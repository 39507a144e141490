"""Part 02 · 56, the mechanism (``continual_pretrain``, ``training_state``) on ``bench.trainer.phase_trainer``: the
per-token loss against Transformers' own, the data stream, the clock under skipped updates (fp16), bit-for-bit resume
from disk, the atomic save, every kind of bad saved state (one TrainingStateError line, nothing loaded), and the
exercise checks against the classic mistakes (mutants). The experiment: tests/experiments/test_continual_pretrain.py."""

import copy
import json
import shutil

import pytest
import torch

from bp_mech import continual_data, continual_eval, continual_pretrain as cpt, training_state as ts
from bp_mech import state_format
from bp_mech.accumulation import count_targets
from bp_mech.bench.strategy import parse
from bp_mech.bench.trainer import loss_times, phase_trainer
from bp_mech.instruments.workload import build_model, load_text, parse_workload, tokenize, workload_fields
from bp_mech.checks import ex56

W = parse_workload("tiny-b1s16")
IDS = tokenize(load_text("domain"))
CFG = cpt.TrainConfig(updates=6, lr=3e-3, warmup=2, decay=2, growth_interval=2)
WL = workload_fields(W)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread, as the experiment trains


def trainer(seed=0, w=W, cfg=CFG, strategy=parse("plain"), **config):
    data = continual_data.TextStream(IDS, w.batch, w.seq, cfg.seed)
    return phase_trainer(build_model(w.replace(seed=seed), **config), cfg, data, strategy=strategy)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 6 updates that saved its state at update 3 (``root``), and its losses after it."""
    root = tmp_path_factory.mktemp("state")
    t = trainer()
    run = cpt.domain_run(t, {}, (), 6, {3}, lambda tr: ts.save_training_state(tr, root, WL, dict(semantic_id="X")))
    return root, [r["loss"] for r in run["steps"][3:]], [p.detach().clone() for p in t.model.parameters()]


# --- the loss, the data, the loop -------------------------------------------------------------

def test_eval_batches_count_every_token_once():
    ids = IDS[:100]
    batches = continual_eval.eval_batches(ids, 16, 3)
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 1]  # 7 windows of 16 (112 >= 100)
    labels = torch.cat([b["labels"] for b in batches]).reshape(-1)
    assert torch.equal(labels[:100], ids) and (labels[100:] == -100).all()
    assert sum(int(count_targets(b["labels"])) for b in batches) == 100 - 7  # a window's first token is no target


def test_token_loss_is_transformers_token_weighted_loss():
    model = build_model(W)
    batches = continual_eval.eval_batches(IDS[:150], 32, 2)  # the last window is padded: batches hold different targets
    n = sum(count_targets(b["labels"]) for b in batches)
    with torch.no_grad():  # Transformers' loss with num_items_in_batch = the targets of all batches
        want = sum(model(**b, num_items_in_batch=n).loss.double() for b in batches).item()
    assert continual_eval.token_loss(model, batches) == pytest.approx(want, rel=1e-6)
    assert model.training


def test_text_stream_state_round_trips_and_short_texts_wrap():
    a, b = continual_data.TextStream(IDS, 2, 16, 0), continual_data.TextStream(IDS, 2, 16, 5)
    a.next()
    b.load_state_dict(a.state_dict())
    assert b.position == 1 and torch.equal(a.next()["input_ids"], b.next()["input_ids"])
    short = continual_data.TextStream(IDS[:5], 2, 16, 0).next()["input_ids"]  # (2, 16) from a 5-token text
    assert short.shape == (2, 16) and set(short.reshape(-1).tolist()) <= set(IDS[:5].tolist())


def test_the_clock_counts_applied_updates_only():  # fp16: an overflowing loss (calls 0, 1) is skipped, clock at 0
    t = trainer(cfg=cpt.TrainConfig(updates=3, warmup=1, decay=1), strategy=parse("fp16"))
    with loss_times(t.model, float("inf")):
        rows = [t.step(), t.step()]
    rows += cpt.train(t, 3)
    assert [(r.applied, r.update) for r in rows] == [(False, 0), (False, 0), (True, 1), (True, 2), (True, 3)]
    assert (t.clock.updates, t.clock.skipped) == (3, 2)
    assert [r.lr for r in rows[:3]] == [t.clock.cfg.base_lr * t.clock.cfg.min_lr_ratio] * 3
    assert [r.scale for r in rows[:3]] == [CFG.init_scale, CFG.init_scale / 2, CFG.init_scale / 4]  # backed off


def test_a_float32_run_has_a_disabled_scaler():  # the chapter's runs: it skips nothing, its saved state is empty
    rows = cpt.train(t := trainer(), 2)
    assert not t.scaler.is_enabled() and t.scaler.state_dict() == {} and [r.scale for r in rows] == [None, None]


# --- save and resume -------------------------------------------------------------------------------

def test_resume_from_disk_is_bit_for_bit(saved):
    root, want, final = saved
    assert (root / "latest").read_text().strip() == "step-000003"
    fresh = trainer(seed=1)
    m = ts.load_training_state(fresh, root, WL, "X")  # the root: 'latest' names the saved state
    assert m["clock"] == dict(updates=3, skipped=0) and m["data_position"]["position"] == 3
    assert set(m) == set(state_format.FIELDS) and set(m["files"]) == set(state_format.FILES)
    got = [r.loss for r in cpt.train(fresh, 6)]
    assert got == want and all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), final))


def test_in_memory_state_is_a_copy():
    t = trainer()
    cpt.train(t, 2)
    state = ts.capture_state(t)
    weights = {k: v.clone() for k, v in t.model.state_dict().items()}
    cpt.train(t, 4)
    assert all(torch.equal(state["model"][k], v) for k, v in weights.items())


def _snapshot(t):
    return [p.detach().clone() for p in t.model.parameters()], copy.deepcopy(t.optimizer.state_dict()), t.clock.updates


def test_a_killed_save_leaves_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    t = trainer()
    cpt.train(t, 5)
    monkeypatch.setattr(ts.shutil, "rmtree", lambda *a, **k: None)  # a kill runs no cleanup
    monkeypatch.setattr(ts.torch, "save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ts.save_training_state(t, root, WL, dict(semantic_id="X"))
    monkeypatch.undo()
    assert any(p.name.startswith(".tmp-step-000005") for p in root.iterdir())  # the half-written save
    assert (root / "latest").read_text().strip() == "step-000003"
    fresh = trainer(seed=1)
    assert ts.load_training_state(fresh, root, WL)["clock"]["updates"] == 3
    second = ts.save_training_state(t, root, WL, dict(semantic_id="X"))  # a new save of the same update: a new name
    again = ts.save_training_state(t, root, WL, dict(semantic_id="X"))
    assert (second.name, again.name) == ("step-000005", "step-000005-1")
    assert (root / "latest").read_text().strip() == "step-000005-1"


def _corrupt(directory, how):
    """Break a copy of a saved state; keep the manifest's sizes and hashes right where the break is elsewhere."""
    state = json.loads((directory / "state.json").read_text())

    def refresh(name):
        state["files"][name] = dict(bytes=(directory / name).stat().st_size, sha256=state_format.file_sha256(directory / name))

    if how == "truncated weights":
        data = (directory / "model.safetensors").read_bytes()
        (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "flipped byte":
        data = bytearray((directory / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (directory / "model.safetensors").write_bytes(bytes(data))
    elif how == "missing field":
        del state["clock"]
    elif how == "optimizer of another layout":
        opt = torch.load(directory / "optimizer.pt", weights_only=True)
        opt["state"][0], opt["state"][1] = opt["state"][1], opt["state"][0]  # (384, 64) and (64,) moments swapped
        torch.save(opt, directory / "optimizer.pt")
        refresh("optimizer.pt")
    elif how == "optimizer with fewer parameters":
        opt = torch.load(directory / "optimizer.pt", weights_only=True)
        opt["param_groups"][0]["params"] = opt["param_groups"][0]["params"][:-1]
        torch.save(opt, directory / "optimizer.pt")
        refresh("optimizer.pt")
    elif how == "weights missing a tensor":
        from safetensors.torch import load_file, save_file

        w = load_file(directory / "model.safetensors")
        w.pop("model.norm.weight")
        save_file(w, directory / "model.safetensors", metadata={"format": "pt"})
        refresh("model.safetensors")
    elif how == "bad json":
        (directory / "state.json").write_text("{\"format\": ")
        return
    (directory / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("how, needle", [
    ("truncated weights", "model.safetensors is"),
    ("flipped byte", "does not match its sha256"),
    ("missing field", "field 'clock' is missing"),
    ("optimizer of another layout", "optimizer state of another parameter layout: parameter 0"),
    ("optimizer with fewer parameters", "optimizer state of another parameter layout: parameters per group"),
    ("weights missing a tensor", "weight 'model.norm.weight' is missing"),
    ("bad json", "not valid JSON"),
])
def test_a_bad_checkpoint_is_one_line_and_loads_nothing(saved, tmp_path, how, needle):
    state = tmp_path / "state"
    shutil.copytree(saved[0] / "step-000003", state)
    _corrupt(state, how)
    fresh = trainer(seed=1)
    before = _snapshot(fresh)
    with pytest.raises(state_format.TrainingStateError) as e:
        ts.load_training_state(fresh, state, WL)
    assert needle in str(e.value) and str(state) in str(e.value) and "\n" not in str(e.value)
    after = _snapshot(fresh)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]


@pytest.mark.parametrize("other, workload, needle", [
    (lambda: trainer(w=parse_workload("tiny-b1s32")), "tiny-b1s32",
     "field 'workload.workload_id' is 'tiny-b1s16' in the saved state but 'tiny-b1s32' in this run"),
    (lambda: trainer(num_hidden_layers=1), "tiny-b1s16", "field 'model_config.num_hidden_layers' is 2 in the saved state but 1"),
    (lambda: trainer(cfg=cpt.TrainConfig(updates=6, lr=1e-3, warmup=2, decay=2)), "tiny-b1s16", "field 'train_config.lr'"),
], ids=["another-workload", "another-model-config", "another-train-config"])
def test_a_checkpoint_of_another_run_is_refused(saved, other, workload, needle):
    with pytest.raises(state_format.TrainingStateError, match=needle):
        ts.load_training_state(other(), saved[0], workload_fields(parse_workload(workload)), "X")


def test_a_checkpoint_of_another_experiment_is_refused(saved):
    with pytest.raises(state_format.TrainingStateError, match="record.semantic_id"):
        ts.load_training_state(trainer(seed=1), saved[0], WL, "TRAIN-BASELINE")


def test_the_state_directory_is_a_transformers_model(saved):
    from transformers import Qwen2ForCausalLM

    t = trainer(seed=1)
    ts.load_training_state(t, saved[0], WL)
    hf = Qwen2ForCausalLM.from_pretrained(saved[0] / "step-000003", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(hf.parameters(), t.model.parameters()))


# --- mutants: the exercise checks catch the classic mistakes --------------------------------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex56_continual_pretrain", **over)


def _mean_of_batch_means(model, batches):
    return sum(continual_eval.token_loss(model, [b]) for b in batches) / len(batches)


def _count_ignored_too(model, batches):
    n = sum(int(count_targets(b["labels"])) for b in batches)
    total = sum(b["labels"][..., 1:].numel() for b in batches)
    return continual_eval.token_loss(model, batches) * n / total


def _no_shift(model, batches):
    import torch.nn.functional as F

    with torch.no_grad():
        s = sum(F.cross_entropy(model(input_ids=b["input_ids"]).logits.flatten(0, 1).double(), b["labels"].flatten(),
                                ignore_index=-100, reduction="sum") for b in batches)
    return (s / sum(int((b["labels"] != -100).sum()) for b in batches)).item()


def _padding_as_targets(model, batches):
    return continual_eval.token_loss(model, [dict(b, labels=b["input_ids"]) for b in batches])


def _capture_without(*keys):
    def capture(t):
        s = ts.capture_state(t)
        for k in keys:
            s.pop(k)
        return s
    return capture


def _restore_without(*keys):
    def restore(t, s):
        s = copy.deepcopy(s)
        full = ts.capture_state(t)  # what the fresh trainer already holds stays as it is
        full.update({k: v for k, v in s.items() if k not in keys})
        ts.restore_state(t, full)
    return restore


def _restore_without_generator(t, s):
    s = copy.deepcopy(s)
    s["data"]["generator"] = t.data.generator.get_state()
    ts.restore_state(t, s)


def _capture_references(t):  # the live tensors, not copies
    return dict(ts.capture_state(t), model=t.model.state_dict(), optimizer=t.optimizer.state_dict())


@pytest.mark.parametrize("checks, over", [
    ([ex56.check_token_loss], dict(token_loss=_mean_of_batch_means)),
    ([ex56.check_token_loss], dict(token_loss=_count_ignored_too)),
    ([ex56.check_token_loss], dict(token_loss=_no_shift)),
    ([ex56.check_token_loss], dict(token_loss=_padding_as_targets)),
    ([ex56.check_capture_state, ex56.check_restore_state],
     dict(capture_state=_capture_without("optimizer"), restore_state=_restore_without("optimizer"))),
    ([ex56.check_capture_state, ex56.check_restore_state],
     dict(capture_state=_capture_without("rng"), restore_state=_restore_without("rng"))),
    ([ex56.check_capture_state], dict(capture_state=_capture_references)),
    ([ex56.check_restore_state], dict(restore_state=_restore_without("clock"))),
    ([ex56.check_restore_state], dict(restore_state=_restore_without("scaler"))),
    ([ex56.check_restore_state], dict(restore_state=_restore_without("data"))),
    ([ex56.check_restore_state], dict(restore_state=_restore_without_generator)),
], ids=["mean-of-batch-means", "ignored-in-count", "no-shift", "padding-as-targets", "no-optimizer-state",
        "no-rng-state", "references-not-copies", "no-clock", "no-scaler", "no-data-position", "no-data-generator"])
def test_checks_catch_mistakes(checks, over):
    for check in checks:
        with pytest.raises(AssertionError):
            check(_solution(**over))
