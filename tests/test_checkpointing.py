"""Part 02 · 19: checkpointing leaves loss and every gradient equal; recomputes are measured; the
records validate; and the ex19 checks catch the classic mistakes (mutants)."""

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bp_mech import checkpointing as ck
from bp_mech import registry
from bp_mech.experiments import harness
from bp_mech import counters
from bp_mech.measure import Timing
from bp_mech.results import load_record, save_record
from bp_mech.workload import PLAN_BUILD_S, build_model, make_batches, parse_workload
from checks import ex19


@pytest.fixture(scope="module")
def tiny():
    w = parse_workload("tiny-b2s32")
    return build_model(w), make_batches(w, 2)


@pytest.fixture(scope="module")
def probes(tiny):
    model, batches = tiny
    out = {}
    for name in ck.CANDIDATES:
        with ck.configure(model, name):
            counter = counters.SavedBytesCounter(model.parameters())
            out[name] = harness.probe(model, batches[0], "cpu", counter)
            out[name]["saved"] = counter.bytes
    return out


def test_every_candidate_leaves_loss_and_every_gradient_bitwise_equal(probes):
    for name in ck.CANDIDATES[1:]:
        c = harness.compare(probes["plain"], probes[name])
        assert c["bitwise"], (name, c)
        assert c["loss_error"] == c["grad_error"] == c["grad_norm_error"] == 0.0, (name, c)


def test_compare_sees_a_changed_gradient(probes):
    got = dict(probes["plain"], grads=[g.clone() for g in probes["plain"]["grads"]])
    got["grads"][3][0] += 1e-3
    c = harness.compare(probes["plain"], got)
    assert not c["bitwise"] and c["grad_error"] > 0


def test_recompute_counts_are_measured(probes, tiny):
    L = len(tiny[0].model.layers)
    assert probes["plain"]["calls"] == {"layer": [1] * L, "attn": [1] * L, "mlp": [1] * L}
    assert probes["plain"]["recomputes"] == 0
    assert probes["checkpoint-all"]["calls"] == {"layer": [2] * L, "attn": [2] * L, "mlp": [2] * L}
    assert probes["checkpoint-all"]["recomputes"] == 2 * L
    every2 = [2 if i % 2 == 0 else 1 for i in range(L)]
    assert probes["checkpoint-every2"]["calls"]["layer"] == every2
    assert probes["checkpoint-every2"]["recomputes"] == 2 * math.ceil(L / 2)
    assert probes["checkpoint-mlp"]["calls"] == {"layer": [1] * L, "attn": [1] * L, "mlp": [2] * L}
    assert probes["checkpoint-mlp"]["recomputes"] == L


def test_checkpointing_keeps_less_until_backward(probes):
    saved = {n: p["saved"] for n, p in probes.items()}
    held = {n: p["held_after_forward"] for n, p in probes.items()}
    for d in (saved, held):
        assert d["checkpoint-all"] < d["checkpoint-every2"] < d["plain"], d
        assert d["checkpoint-all"] < d["checkpoint-mlp"] < d["plain"], d


def test_saved_bytes_counter_counts_a_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    w = nn.Parameter(torch.randn(64, 64))
    counter = counters.SavedBytesCounter([w])
    with counter:
        h = (x * 2) @ w  # matmul saves x*2 and the parameter w
        a, b = h.chunk(2, -1)  # two views of h's storage
        (a.sigmoid() * b).sum()  # sigmoid saves its output (64 x 32); mul saves it and b
    n = 64 * 64 * 4
    assert counter.param_saves == 1
    assert counter.bytes == n + n + n // 2, counter.storages  # x*2, h (once for b), sigmoid's output
    assert counter.tensor_bytes > counter.bytes


def test_configure_restores_the_model(tiny):
    model, _ = tiny
    mlp_types = [type(l.mlp) for l in model.model.layers]
    for name in ck.CANDIDATES:
        with ck.configure(model, name):
            pass
        assert not any(l.gradient_checkpointing for l in model.model.layers)
        assert [type(l.mlp) for l in model.model.layers] == mlp_types
        assert not getattr(model, "_require_grads_hooks", [])


def test_from_scratch_checkpoint_equals_torch_checkpoint():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    block = ck.CheckpointedBlock(mlp)
    ours = torch.autograd.grad(block(x).sum(), [x, *mlp.parameters()])
    ref = torch.autograd.grad(checkpoint(mlp, x, use_reentrant=False).sum(), [x, *mlp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert block.calls == 2


def test_decide_rule_and_the_seed_reference():
    s = ck.SEED_REFERENCE
    assert harness.decide(True, s["peak_saving"], s["median_ratio"])[0] == s["decision"] == "accept"
    assert harness.decide(False, 0.5, 1.0)[0] == "reject"
    assert harness.decide(True, 0.01, 1.0)[0] == "reject"
    assert harness.decide(True, 0.10, 1.1)[0] == "tune"
    assert harness.decide(True, 0.40, 3.0)[0] == "tune"


def test_run_writes_valid_records(tmp_path, cpu_only):
    ctx = registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32")
    recs = ck.run(ctx)
    assert [r.candidate for r in recs] == list(ck.CANDIDATES)
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    assert by["plain"].decision is None and by["plain"].recompute_count == 0
    L = len(by["plain"].metrics["forward_calls"]["layer"])
    assert by["checkpoint-all"].recompute_count == 2 * L
    for name in ck.CANDIDATES[1:]:
        r = by[name]
        assert r.output_error == 0.0 and r.grad_error == 0.0 and r.metrics["bitwise_equal"] and r.metrics["equal"]
        assert r.memory_source == "tracked-cpu" and r.evidence_level == "cpu-mechanism" and r.all_finite
        assert r.peak_allocated < by["plain"].peak_allocated  # tracked storages: deterministic
        assert r.metrics["saved_activation_bytes"] < by["plain"].metrics["saved_activation_bytes"]
        assert r.decision in ("accept", "tune", "reject")
        assert r.warmup_excluded == harness.schedule("cpu")[1] and r.threads == 1
        assert r.updates == sum(harness.schedule("cpu")) + 1 and r.skipped_updates == 0  # warm-up + timed + peak step
        assert r.metrics["more_work"] == (name != "plain")  # every candidate recomputes


def test_an_out_of_memory_candidate_is_its_failure_and_the_run_goes_on(tmp_path, cpu_only, monkeypatch):
    real, seen = harness.train_step, []

    def oom_under_checkpoint_all(model, *a, **k):  # fails inside the candidate's configuration
        seen.append(model)
        if all(layer.gradient_checkpointing for layer in model.model.layers):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, *a, **k)

    monkeypatch.setattr(harness, "train_step", oom_under_checkpoint_all)
    recs = ck.run(registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32"))
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in recs}
    failed = by["checkpoint-all"]
    assert failed.failure.startswith("out of memory") and failed.peak_allocated is None and failed.decision is None
    assert all(by[n].failure is None and by[n].metrics["bitwise_equal"] for n in ("checkpoint-every2", "checkpoint-mlp"))
    assert not any(layer.gradient_checkpointing for layer in seen[0].model.layers)  # the configuration was undone


def _fake(loss, grads, finite=True, peak=100, median=1.0):
    return dict(loss=loss, grads=grads, grad_norm=math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)),
                calls={}, recomputes=0, held_after_forward=0, finite=finite,
                timing=Timing(median, median, 2, [median] * 4, threads=1, interleaved=True), peak_allocated=peak,
                peak_reserved=None, memory_source="tracked-cpu", updates=5)


def test_a_nan_gradient_is_never_equal_and_the_record_still_saves(tmp_path, cpu_only):
    """A race that leaves a gradient NaN must be rejected (``max(0.0, nan)`` is 0.0 in Python, so a
    naive running max passes it), and NaN must not make the record unsavable (strict JSON)."""
    g = [torch.ones(3), torch.ones(2)]
    bad = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    c = harness.compare(_fake(1.0, g), _fake(1.0, bad, finite=False))
    assert c["grad_error"] == math.inf and not c["bitwise"] and c["loss_error"] == 0.0
    assert harness.compare(_fake(1.0, g), _fake(float("nan"), g, finite=False))["loss_error"] == math.inf
    ctx = registry.make_context("TRAIN-CHECKPOINT", "cpu", "tiny-b2s32")
    results = {"plain": (_fake(1.0, g), None), "checkpoint-all": (_fake(1.0, bad, finite=False, peak=50), None),
               "checkpoint-every2": (_fake(1.0, [x * (1 + 1e-3) for x in g], peak=50), None),
               "checkpoint-mlp": (None, "out of memory: CUDA out of memory")}
    by = {r.candidate: load_record(save_record(r, tmp_path)) for r in harness.make_records(ctx, results, "plain")}
    nan = by["checkpoint-all"]
    assert nan.decision == "reject" and not nan.all_finite and nan.grad_error is None and not nan.metrics["equal"]
    assert nan.metrics["grad_norm"] is None  # stored as null, not NaN
    assert by["checkpoint-every2"].decision == "reject" and by["checkpoint-every2"].grad_error > harness.EQUAL_TOL["cpu"][1]
    assert by["checkpoint-mlp"].failure and by["plain"].decision is None


def test_dry_run_plans_the_gpu_run_within_three_minutes_with_offload():
    total = 0
    for sid in ("TRAIN-CHECKPOINT", "TRAIN-OFFLOAD"):
        plan = registry.plan(registry.make_context(sid, "dry_run", "qwen05-b2s512"))
        gpu = plan["modes"]["real_gpu"]
        assert gpu["timed_rounds"] >= 20 and gpu["warmup_rounds"] >= 1 and gpu["interleaved"]
        total += gpu["estimated_seconds"]
    assert 60 <= total <= 180


def test_the_estimate_scales_with_the_workload():
    w = parse_workload("qwen05-b2s512")
    one = harness.estimate_seconds(w, [1.0], "cuda")
    assert harness.estimate_seconds(parse_workload("qwen05-b2s1024"), [1.0], "cuda") > one + 1
    assert harness.estimate_seconds(w, [1.0, 2.0], "cuda") > 2 * one - PLAN_BUILD_S["cuda"]
    assert harness.estimate_seconds(w, [1.0], "cpu") > 10 * one  # qwen05 on 2 CPU cores: planned, and slow


def test_conformance_passes():
    row = ck.conformance()
    assert row.passed, row.detail


# --- the ex19 checks catch the classic mistakes ----------------------------------------


class _NotCheckpointing(nn.Module):  # counts, but keeps every activation (a plain forward)
    def __init__(self, block):
        super().__init__()
        self.block, self.calls = block, 0

    def forward(self, x):
        self.calls += 1
        return self.block(x)


class _AssumedCount(_NotCheckpointing):  # "checkpointing costs one extra forward": typed, not measured
    def forward(self, x):
        self.calls += 2
        return self.block(x)


class _CountsOnlyForward(_NotCheckpointing):  # really checkpoints, but misses the recompute
    def forward(self, x):
        self.calls += 1
        return checkpoint(self.block, x, use_reentrant=False)


class _ReentrantInputOnly(_NotCheckpointing):  # reentrant design with params hidden: no param grads
    def forward(self, x):
        return checkpoint(self._run, x, use_reentrant=True)

    def _run(self, x):
        self.calls += 1
        return self.block(x)


def _answers():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "answers" / "ex19_checkpointing.py"
    spec = importlib.util.spec_from_file_location("_ans19", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _with(block_cls=None, counter=None):
    ans = _answers()
    return type("Sol", (), {"CheckpointedBlock": block_cls or ans.CheckpointedBlock,
                            "count_forward_calls": staticmethod(counter or ans.count_forward_calls)})


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the reentrant mutant's own warning
@pytest.mark.parametrize("cls,check", [
    (_NotCheckpointing, ex19.check_keeps_only_input),
    (_NotCheckpointing, ex19.check_counts_real_executions),
    (_AssumedCount, ex19.check_counts_real_executions),
    (_CountsOnlyForward, ex19.check_counts_real_executions),
    (_ReentrantInputOnly, ex19.check_gradients),
])
def test_ex19_checks_catch_checkpoint_mistakes(cls, check):
    with pytest.raises(AssertionError):
        check(_with(block_cls=cls))


def _hooks_left_behind(modules, step):
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda mod, args, i=i: counts.__setitem__(i, counts[i] + 1))
    step()
    return counts


def _assumed_counts(modules, step):
    step()
    return [1] * len(modules)


@pytest.mark.parametrize("counter", [_hooks_left_behind, _assumed_counts])
def test_ex19_checks_catch_counting_mistakes(counter):
    with pytest.raises(AssertionError):
        ex19.check_count_forward_calls(_with(counter=counter))
