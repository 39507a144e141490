"""Part 02 · 74, the project: the profiled step (trace, memory by category, operators), the cross-check of
the profiler's categories against the ledger, the remedies' predicted against measured savings, the
records and the plan; the exercise checks against the classic mistakes; the CUDA paths."""

import json

import pytest
import torch

from bp_mech.records import registry, results
from bp_mech import ledger
from bp_mech.bench.step import PHASES, train_step
from bp_mech.ledger_table import CLASSES, STAGES, Ledger
from bp_mech.projects import diagnosis, operators, profiling, step_profile
from bp_mech.instruments.workload import ARCHITECTURES, build_model, make_batches, parse_workload
from bp_mech.instruments.adamw import make_adamw
from bp_mech.checks import ex74
from conftest import CUDA_CALLS, mutant

EX = "ex74_profiling"
W = "tiny-b2s64"  # the chapter's workload: the peak in the log-softmax backward, every remedy saves
ROPE_BUFFERS = 4 * ARCHITECTURES["tiny"]["hidden_size"] // ARCHITECTURES["tiny"]["num_attention_heads"]


@pytest.fixture(scope="module")
def records():
    """One CPU run (smoke: one profiled step, no full-size estimate) under the cpu_only rules: no
    torch.cuda call, records valid without jsonschema."""
    import sys

    with pytest.MonkeyPatch.context() as mp:
        for name in CUDA_CALLS:
            mp.setattr(torch.cuda, name, lambda *a, _n=name, **k: pytest.fail(f"torch.cuda.{_n} on the CPU"))
        mp.setitem(sys.modules, "jsonschema", None)
        recs = registry.run(registry.make_context("TRAIN-PROFILING-DIAGNOSIS", "cpu", W, smoke=True))
        for r in recs:
            results.validate(r.to_dict(), r.filename)
    return {r.candidate: r for r in recs}


def test_records_one_per_candidate_with_the_diagnosis(records):
    assert list(records)[0] == "plain" and set(records) == set(profiling.CANDIDATES)
    plain = records["plain"]
    assert plain.memory_source == "tracked-cpu" and plain.evidence_level == "cpu-mechanism" and plain.all_finite
    m = plain.metrics
    assert m["dominant"]["peak"] == plain.peak_allocated  # the ledger's peak is the measured peak
    ranked = [a["predicted_saving"] for a in m["ranked"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == len(diagnosis.REMEDIES)
    assert plain.next_step == f"apply {m['ranked'][0]['remedy']} (largest predicted saving)"


def test_two_views_of_memory_agree_up_to_the_known_lines(records):
    """The profiler and the tracker count the same storages: totals equal at every point but for the RoPE
    buffer no operator reads (the profiler never sees it), and once the known lines are moved where the
    profiler books them, no class differs by more than that buffer and the loss's scalars."""
    m = records["plain"].metrics
    assert set(m["cross_check"]) == set(step_profile.STAGE_POINTS)
    for point, c in m["cross_check"].items():
        assert 0 <= c["difference"] <= ROPE_BUFFERS, (point, c["difference"])
        assert sum(v["difference"] for v in c["by_class"].values()) == c["difference"]
        assert max(abs(v) for v in m["residual"][point].values()) <= ROPE_BUFFERS, (point, m["residual"][point])
    # the two (n, V) buffers of the log-softmax backward are the profiler's autograd detail at the backward's peak
    assert m["backward_moment"] == "the log-softmax backward"
    assert m["profiler_stages"]["backward_peak"]["autograd_detail"] == m["known_lines"]["log_softmax_backward_buffers"]
    assert m["profiler_stages"]["optimizer_peak"]["unknown"] == m["ledger"]["backward"]["gradients"]  # foreach temps


def test_each_remedy_predicted_within_tolerance(records):
    """Tracked bytes are a function of the program: the formula-backed remedies are predicted to a few
    bytes at tiny size (Part 02 · 43's formula is exact there), the chunked loss's rule within the
    per-token and (chunk, hidden) bytes it leaves out."""
    plain_peak = records["plain"].peak_allocated
    for r in diagnosis.REMEDIES:
        rec = records[r.name]
        o = rec.metrics
        assert o["measured_saving"] == plain_peak - rec.peak_allocated > 0
        assert abs(o["error"]) <= (1e-2 if ledger.unmodelled(r.strategy) else 1e-4), (r.name, o["error"])
        assert rec.decision == "accept" and rec.next_step is None and rec.failure is None


def test_profile_step_writes_a_trace_and_the_timeline(tmp_path):
    w = parse_workload(W)
    p = step_profile.profile_step(w, "cpu", step_profile.ProfileConfig(timed=2, top_n=5), tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {operators.MARK + ph for ph in PHASES} <= names
    assert [ph for ph, _, _ in p.phases] == list(PHASES)
    assert all(len(v) == len(p.times_us) for v in p.bytes_by_category.values())
    assert p.times_us == sorted(p.times_us)
    ops = [o["self_us"] for o in p.operators]
    assert len(ops) == 5 and ops == sorted(ops, reverse=True)
    assert all(o["name"].startswith("aten::") for o in p.operators)
    assert 0 < sum(o["share"] for o in p.operators) <= 1
    # the stage snapshots are states of the timeline; the step's largest is the backward's peak
    states = [dict(zip(step_profile.CATEGORIES, s)) for s in zip(*p.bytes_by_category.values())]
    assert all(p.stages[point] in states for point in step_profile.STAGE_POINTS)
    assert sum(p.stages["backward_peak"].values()) == max(sum(s.values()) for s in states)
    out = json.loads(step_profile.write_timeline(p, tmp_path / "tl.json").read_text())
    assert out["categories"] == list(step_profile.CATEGORIES) and len(out["bytes"][0]) == len(p.times_us)


def _ledger(**totals) -> Ledger:
    stages = {s: dict.fromkeys(CLASSES, 0) for s in STAGES}
    for s, (cls, n) in totals.items():
        stages[s][cls] = n
    return Ledger("tracked-cpu", "plain", stages, forward_peak=900)


def test_ledger_rows_dominant_state_and_saving():
    led = _ledger(forward=("saved_activations", 600), backward_peak=("logits_loss", 800), zero_grad=("other", 10))
    rows = diagnosis.ledger_rows(led)
    assert list(rows) == list(diagnosis.POINTS)
    assert rows["forward_peak"]["logits_loss"] == 300 and sum(rows["forward_peak"].values()) == 900
    assert diagnosis.dominant_state(rows) == diagnosis.Dominant(point="forward_peak", peak=900,
                                                                line="saved_activations", bytes=600, share=600 / 900)
    # removing the logits everywhere: the peak moves to the forward (600 left)
    change = {p: {"logits_loss": -r["logits_loss"]} for p, r in rows.items()}
    assert diagnosis.predicted_saving(rows, change) == 300


def test_backward_moment_from_the_lines_it_holds():
    known = diagnosis.known_lines(parse_workload("tiny-b2s16"))
    row = dict.fromkeys(CLASSES, 0)
    assert diagnosis.backward_moment(dict(row, logits_loss=3 * known["logits"]), known) == "the log-softmax backward"
    tied_end = dict(row, gradients=known["weights"] + known["tied_embedding_gradients"])
    assert diagnosis.backward_moment(tied_end, known) == "the end of the backward (tied embedding)"
    assert diagnosis.backward_moment(dict(row, gradients=known["weights"]), known) == "another moment"


def test_chunked_loss_rule_keeps_one_chunk_and_never_grows():
    rows = {p: dict.fromkeys(CLASSES, 0) for p in diagnosis.POINTS}
    n, V, C = 64, 100, 8
    rows["forward"]["logits_loss"] = 4 * n * V + 8 * n
    rows["forward_peak"]["logits_loss"] = 8 * n * V + 8 * n
    rows["backward_peak"]["logits_loss"] = 12 * n * V
    ch = diagnosis.chunked_loss_changes(rows, n, V, C, chunk=16)
    assert ch["forward"]["logits_loss"] == 12 * n - rows["forward"]["logits_loss"]
    assert ch["forward_peak"]["logits_loss"] == 12 * n + 2 * 4 * 16 * V - rows["forward_peak"]["logits_loss"]
    assert ch["backward_peak"] == {"logits_loss": 12 * n + max(8 * 16 * V, 4 * 16 * V + 4 * V * C) + 4 * n * C
                                   - 12 * n * V, "gradients": 4 * V * C}
    assert ch["zero_grad"] == {"logits_loss": 0}  # 0 bytes there: nothing to remove, nothing added
    one = diagnosis.chunked_loss_changes(rows, n, V, C, chunk=1000)  # one chunk of all n tokens: k = 1
    assert one["forward_peak"]["logits_loss"] == 12 * n + 4 * n * V - rows["forward_peak"]["logits_loss"]


def test_estimate_at_full_size_machinery_on_tiny():
    """``estimate_at`` (fake tensors) on a tiny workload: the same predictions as the measured run."""
    est = profiling.estimate_at(parse_workload(W), like="cpu")
    assert est["evidence_level"] == "estimated" and est["memory_source"] == "fake-tensor"
    assert {r["remedy"] for r in est["remedies"]} == {r.name for r in diagnosis.REMEDIES}
    assert all(abs(r["error"]) <= 1e-2 for r in est["remedies"]), est["remedies"]


def test_dry_run():
    dr = registry.dry_run(registry.make_context("TRAIN-PROFILING-DIAGNOSIS", "dry_run", "qwen05-b2s512"))
    assert dr["candidates"] == list(profiling.CANDIDATES)
    modes = dr["modes"]  # the key the suite's totals read (experiments.runner.dry_run_suite)
    assert modes["real_gpu"]["profiler_schedule"] == dict(wait=1, warmup=1, active=1)
    assert modes["cpu"]["profiler_schedule"] == modes["real_gpu"]["profiler_schedule"]
    assert 0 < modes["real_gpu"]["estimated_seconds"] < modes["cpu"]["estimated_seconds"]
    assert set(dr["remedies"]) == {r.name for r in diagnosis.REMEDIES}


# --- the CUDA paths, exercised on the CPU -----------------------------------------------------------

def test_profiled_step_synchronizes_each_phase_on_cuda(fake_cuda):
    w = parse_workload("tiny-b1s8")
    model = build_model(w)
    opt = make_adamw(model.parameters(), 1e-4, "cpu")
    train_step(model, opt, make_batches(w, 1)[0], observers=[step_profile.record_phases("cuda")])  # model on the CPU
    assert fake_cuda == ["synchronize"] * len(PHASES)


def test_peak_of_reads_the_allocator_on_cuda():
    led = _ledger(backward_peak=("logits_loss", 800))
    led.allocator = {"forward_peak": 1000, "backward_peak": 1500, "backward_reserved": 4096, "forward": 700}
    assert profiling.peak_of(led, "cuda") == 1500 and profiling.peak_of(led, "cpu") == led.peak == 900


def test_operator_table_medians_per_step_and_device_time_on_cuda():
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(4):
            with record_function(operators.MARK + "forward"):
                (x @ x).relu()
            prof.step()
    rows, med = operators.operator_table(prof.events(), "cpu", 3)
    names = [r["name"] for r in rows]
    assert "aten::mm" in names and all(r["calls"] == 1 for r in rows if r["name"] in ("aten::mm", "aten::relu"))
    per_step = sorted(e.self_cpu_time_total for e in prof.events() if e.name == "aten::mm")
    assert len(per_step) == 3 and rows[names.index("aten::mm")]["self_us"] == per_step[1]  # the median step
    assert med["step_us"] > 0 and med["phase_us"]["forward"] > 0 and med["self_total_us"] > 0
    dev, dmed = operators.operator_table(prof.events(), "cuda", 3)  # no kernels: device time 0, still a table
    assert dmed["self_total_us"] == 0 and all(o["self_us"] == 0 for o in dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_on_cuda():
    recs = {r.candidate: r for r in registry.run(registry.make_context("TRAIN-PROFILING-DIAGNOSIS", "real_gpu",
                                                                     "tiny-b2s64", smoke=True))}
    plain = recs["plain"]
    assert plain.memory_source == "cuda-allocator" and plain.evidence_level == "gpu-measured"
    for c in plain.metrics["cross_check"].values():  # tracked vs profiled CUDA storages; the profiler also sees
        assert abs(c["difference"]) <= 0.05 * plain.peak_allocated  # workspaces allocated inside the window
    assert all(recs[r.name].metrics["measured_saving"] is not None for r in diagnosis.REMEDIES)


# --- the exercise checks against the classic mistakes -----------------------------------------------

def _naive_saving(stages, change):  # the peak assumed to stay where it was
    peak = max(stages, key=lambda s: sum(stages[s].values()))
    return -sum(change.get(peak, {}).values())


def _removals_only(stages, change):  # additions (a recompute) forgotten
    return diagnosis.predicted_saving(stages, {s: {c: min(v, 0) for c, v in ch.items()} for s, ch in change.items()})


def _all_removed(stages, change):  # every removed byte counted as saved
    return -sum(min(v, 0) for ch in change.values() for v in ch.values())


def _scaled(rows, n, V, C, chunk):  # the logits line scaled by chunk / n
    return {p: {"logits_loss": int(r["logits_loss"] * (min(chunk, n) / n - 1))} for p, r in rows.items()}


def _rule(**kw):
    """The chunked-loss rule with one mistake: no_dw, no_extra (neither dh nor dz^T h), k1 (one chunk's
    logits at a time), no_min (chunk instead of min(chunk, n))."""
    def f(rows, n, V, C, chunk):
        c = chunk if kw.get("no_min") else min(chunk, n)
        k = 1 if kw.get("k1") or n <= c else 2
        bwd = k * 4 * c * V if kw.get("no_extra") else max(k * 4 * c * V, 4 * c * V + 4 * V * C) + 4 * n * C
        live = {"forward_peak": k * 4 * c * V, "backward_peak": bwd}
        out = {}
        for p, r in rows.items():
            cut = min(0, 12 * n + live.get(p, 0) - r["logits_loss"])
            out[p] = {"logits_loss": cut}
            if p == "backward_peak" and cut < 0 and not kw.get("no_dw"):
                out[p]["gradients"] = 4 * V * C
        return out
    return f


def _no_version_move(events, categories):  # an in-place write adds the new version, keeps the old
    return step_profile.live_by_category([e if e[1] != "increment_version" else (e[0], "create", e[2], e[3] + 1, e[4])
                                          for e in events], categories)


def _per_event(events, categories):  # one state per event, not per time
    times, states = [], []
    for i, e in enumerate(events):
        t, s = step_profile.live_by_category(events[:i + 1], categories)
        times.append(t[-1])
        states.append(s[-1])
    return times, states


def _destroy_version0(events, categories):  # a destroyed storage booked by its first version's category
    return step_profile.live_by_category([e if e[1] != "destroy" else (e[0], e[1], e[2], 0, e[4]) for e in events],
                                         categories)


@pytest.mark.parametrize("check, overrides", [
    (ex74.check_predicted_saving, {"predicted_saving": _naive_saving}),
    (ex74.check_predicted_saving, {"predicted_saving": _removals_only}),
    (ex74.check_predicted_saving__random, {"predicted_saving": _all_removed}),
    (ex74.check_chunked_loss_changes__measured, {"chunked_loss_changes": _scaled}),
    (ex74.check_chunked_loss_changes__measured, {"chunked_loss_changes": _rule(no_dw=True)}),
    (ex74.check_chunked_loss_changes__measured, {"chunked_loss_changes": _rule(no_extra=True)}),
    (ex74.check_chunked_loss_changes__measured, {"chunked_loss_changes": _rule(k1=True)}),
    (ex74.check_chunked_loss_changes__measured, {"chunked_loss_changes": _rule(no_min=True)}),
    (ex74.check_live_by_category, {"live_by_category": _no_version_move}),
    (ex74.check_live_by_category__profiled_step, {"live_by_category": _no_version_move}),
    (ex74.check_live_by_category, {"live_by_category": _per_event}),
    (ex74.check_live_by_category, {"live_by_category": _destroy_version0}),
], ids=["peak-stays", "additions-forgotten", "all-removed-saved", "chunk-over-n-scaling", "no-dW", "no-dh-or-product",
        "one-chunk-alive", "chunk-not-capped-at-n", "increment-keeps-old-version", "increment-on-a-real-step",
        "state-per-event", "destroy-by-version-0"])
def test_checks_catch_the_classic_mistakes(check, overrides):
    with pytest.raises(AssertionError):
        check(mutant(EX, **overrides))


def test_checks_pass_on_the_answers():
    for check in ex74.CHECKS:
        check(mutant(EX))


def test_the_operator_ranking_is_called_a_hot_spot_list():
    """A ranking by self time is a hot-spot list, not a critical path (no dependencies read)."""
    metrics = registry.get("TRAIN-PROFILING-DIAGNOSIS").metrics
    assert "hot-spot list" in metrics and "critical path" not in metrics
