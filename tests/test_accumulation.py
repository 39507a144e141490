"""Part 02 · 11: token-weighted accumulation equals the full batch; the naive one does not;
the measurement, the decision rule, the records and the exercise checks (mutants)."""


import pytest
import torch

from bp_mech import accumulation as A
from bp_mech import registry, report, results
from bp_mech.workload import PAD_ID, build_model, parse_workload
from checks import ex11

W = parse_workload("tiny-b2s16")
CFG = A.AccumConfig(updates=2, timed=3, warmup=1)


@pytest.fixture(scope="module")
def setup():
    model = build_model(W)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    return model, init, A.padded_batches(W, CFG.updates, CFG.micro_max, CFG.max_pad_fraction)


def test_padded_batches_are_uneven(setup):
    _, _, batches = setup
    for b in batches:
        assert b["input_ids"].shape == (W.batch * CFG.micro_max, W.seq)
        assert torch.equal(b["input_ids"] == PAD_ID, b["labels"] == A.IGNORE)
        for k in (2, 4):
            counts = [int(A.count_targets(mb["labels"])) for mb in A.split(b, k)]
            assert len(set(counts)) > 1, f"micro-batches of k={k} must hold different target counts: {counts}"


def test_right_padding_leaves_real_logits_unchanged(setup):
    model, init, batches = setup
    model.load_state_dict(init)
    b = batches[0]
    real = b["labels"] != A.IGNORE
    from bp_mech.workload import make_batches
    plain = make_batches(W.replace(batch=W.batch * CFG.micro_max), 1)[0]["input_ids"]
    assert torch.equal(plain[real], b["input_ids"][real])
    with torch.no_grad():
        a, p = model(input_ids=b["input_ids"]).logits, model(input_ids=plain).logits
    assert (a[real] - p[real]).abs().max().item() < 1e-5


def test_token_weighted_equals_full_batch_naive_does_not(setup):
    model, init, batches = setup
    eq = A.equivalence(model, init, batches, CFG, "cpu")
    for name in ("micro2", "micro4"):
        tok, naive = eq[name]["token"], eq[name]["naive"]
        assert tok["finite"] and naive["finite"]
        assert tok["loss_rel_diff"] <= 1e-6 and tok["grad_rel_diff"] <= 1e-5
        # After AdamW the parameters are compared relative to the update, not asserted equal: Adam moves an
        # element by about lr * sign(g), so where |g| is near eps a float32 reordering of the accumulated
        # gradient (other CPUs sum in another order) can flip that step; m of N elements flipping give a
        # relative difference of about 2 sqrt(m / N). The gradients before the update carry the equality.
        assert tok["param_diff_vs_update"] <= 0.05 < naive["param_diff_vs_update"]
        assert naive["grad_rel_diff"] > 1e-3 > 100 * tok["grad_rel_diff"]  # the naive error is real, not rounding


def test_accumulated_loss_is_the_full_batch_loss(setup):
    model, init, batches = setup
    model.load_state_dict(init)
    b = batches[0]
    want = torch.nn.functional.cross_entropy(
        model(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, 384), b["labels"][:, 1:].reshape(-1))
    model.zero_grad(set_to_none=True)
    got = A.accumulated_backward(model, b, 4, "token")
    naive = A.accumulated_backward(model, b, 4, "naive")
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    assert abs(naive.item() - want.item()) > 1e-7 * want.item()
    with pytest.raises(ValueError):
        A.accumulated_backward(model, b, 4, "mean")


def test_split_refuses_uneven():
    b = {"input_ids": torch.zeros(6, 4, dtype=torch.long)}
    assert len(A.split(b, 3)) == 3
    for k in (0, 4):
        with pytest.raises(ValueError):
            A.split(b, k)


def test_measure_resident_and_incremental_peak(setup):
    model, init, batches = setup
    out = A.measure_candidates(model, init, batches, CFG, "cpu")
    assert all(failure is None for _, failure in out.values())
    full, four = out["full"][0], out["micro4"][0]
    n_params = sum(p.numel() for p in model.parameters())
    # float32 params + exp_avg + exp_avg_sq, plus one float32 `step` per parameter tensor
    assert full["resident"] == 3 * 4 * n_params + 4 * len(list(model.parameters()))
    for m, _ in out.values():
        assert m["incremental"] == m["stats"].peak_allocated - m["resident"] > 4 * n_params  # grads at least
        assert m["stats"].memory_source == "tracked-cpu" and m["stats"].timing.warmup_excluded == CFG.warmup
        t = m["stats"].timing
        assert t.interleaved and t.threads == 1 and len(t.samples) == CFG.timed
        assert m["updates"] == 1 + 1 + CFG.warmup + CFG.timed  # warm + tracked + warm-up + timed
    assert four["stats"].peak_allocated < full["stats"].peak_allocated  # activations of 1/4 of the batch
    # the sequential (CUDA) path, run on the CPU: the same tracked peak, a function of the program
    seq = A.measure_candidates(model, init, batches, CFG, "cpu", interleave=False)
    for name, (m, _) in seq.items():
        assert m["stats"].peak_allocated == out[name][0]["stats"].peak_allocated and m["resident"] == full["resident"]
        assert not m["stats"].timing.interleaved and len(m["stats"].timing.samples) == CFG.timed


@pytest.mark.parametrize("diff,peak,time,noise,want", [
    (1e-3, 0.5, 1.0, None, "reject"), (None, 0.5, 1.0, None, "reject"), (1e-7, 0.85, 1.3, None, "accept"),
    (1e-7, 0.95, 1.1, None, "tune"), (1e-7, 0.5, 1.6, None, "tune"), (1e-7, None, None, None, None),
    (1e-3, 0.5, 1.0, "noise", "reject"),  # the gradient decides without the time
    (1e-7, 0.95, 0.8, "noise", "tune"),  # so does a peak that barely falls
    (1e-7, 0.5, 0.8, "noise", None), (1e-7, 0.5, 1.6, "noise", None)])  # the rest would need the time
def test_decision_rule(diff, peak, time, noise, want):
    decision, nxt = A.decide(diff, 1e-5, peak, time, noise)
    assert decision == want and nxt  # every outcome says what to do next
    if want is None and noise:
        assert "time ratio is noise (noise)" in nxt and "GPU" in nxt


def test_run_records_one_label_per_sequence_length(tmp_path, monkeypatch):
    monkeypatch.setattr(A, "config_for", lambda device, smoke=False: CFG)
    ctx = registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "cpu", "tiny-b2s16")
    recs = A.run(ctx)
    assert [(r.workload_id, r.run_label, r.candidate) for r in recs] == [
        (f"tiny-b2s{s}", f"cpu-default-s{s}", c) for s in (8, 16) for c in A.CANDIDATES]
    for r in recs:
        results.save_record(r, tmp_path)
        assert r.failure is None and r.all_finite and r.peak_allocated > 0 and r.effective_batch == 8
        assert r.threads == 1 and r.metrics["interleaved"] and r.warmup_excluded == CFG.warmup
        by_run = r.metrics["updates_by_run"]
        assert by_run["measurement"] == 2 + CFG.warmup + CFG.timed and r.updates == sum(by_run.values())
        assert by_run["equivalence_token"] == CFG.updates == r.update_count
        assert by_run["equivalence_naive"] == (0 if r.candidate == "full" else CFG.updates)
        if r.candidate == "full":
            assert r.timing_noise is None and r.decision is None
            continue
        assert r.grad_error <= 1e-5 and r.metrics["naive"]["grad_rel_diff"] > 1e-3
        m = r.metrics
        if m["time_ratio"] < 1.0:  # more passes, measured faster: noise, whatever the spread
            assert r.timing_noise and "strictly more work" in r.timing_noise
        want = A.decide(r.grad_error, 1e-5, m["peak_ratio"], m["time_ratio"], r.timing_noise)
        assert (r.decision, r.next_step) == want
    c = report.cached("TRAIN-GRADIENT-ACCUMULATION", tmp_path)
    assert sorted(c.groups) == ["cpu-default-s16", "cpu-default-s8"]
    monkeypatch.undo()  # the plan of the real configs
    plan = registry.plan(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "dry_run", "qwen05-b2s256"))
    gpu = plan["modes"]["real_gpu"]
    assert plan["workloads"] == ["qwen05-b2s128", "qwen05-b2s256"] and gpu["estimated_seconds"] < 75
    assert gpu["timed_steps"] == A.config_for("cuda").timed >= 20 and "H200" in plan["estimate_basis"]
    assert plan["modes"]["cpu"]["interleaved"] and plan["modes"]["cpu"]["threads"] == 1


def test_accelerate_divides_by_k_so_the_loss_is_scaled(setup):
    """accelerator.backward(loss) divides by gradient_accumulation_steps: without * k the
    gradient is 1/k of the full batch's (the conformance row passes only with the scaling)."""
    from accelerate import Accelerator

    model, init, batches = setup
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    A.accumulated_backward(model, batches[0], 2)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    n = A.count_targets(batches[0]["labels"])
    for mb in A.split(batches[0], 2):
        with acc.accumulate(model):
            acc.backward(model(input_ids=mb["input_ids"], labels=mb["labels"], num_items_in_batch=n).loss)
    assert abs(A.rel_diff([p.grad for p in model.parameters()], want) - 0.5) < 1e-5
    row = A.conformance()
    assert row.passed, row.detail


# --- mutants: the checks catch the classic mistakes --------------------------------------

def _solution(**over):
    from conftest import mutant

    return mutant("ex11_gradient_accumulation", **over)


def _naive_backward(model, batch, k):  # mean of micro-batch means
    total = 0.0
    for mb in A.split(batch, k):
        loss = A.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / A.count_targets(mb["labels"]) / k
        loss.backward()
        total = total + loss.detach()
    return total


def _zeroing_backward(model, batch, k):  # zero_grad inside the loop: only the last micro-batch survives
    n = A.count_targets(batch["labels"])
    total = 0.0
    for mb in A.split(batch, k):
        model.zero_grad()
        loss = A.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / n
        loss.backward()
        total = total + loss.detach()
    return total


def _unscaled_backward(model, batch, k):  # plain micro-batch means, no 1/k at all
    total = 0.0
    for mb in A.split(batch, k):
        loss = A.token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"]) / A.count_targets(mb["labels"])
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("check,over", [
    (ex11.check_accumulated_backward, dict(accumulated_backward=_naive_backward)),
    (ex11.check_accumulated_backward, dict(accumulated_backward=_zeroing_backward)),
    (ex11.check_accumulated_backward, dict(accumulated_backward=_unscaled_backward)),
    (ex11.check_micro_batch_loss,
     dict(micro_batch_loss=lambda z, y, n: A.token_loss_sum(z, y) / A.count_targets(y) / 2)),  # mean of means (k=2)
    (ex11.check_count_targets, dict(count_targets=lambda y: (y != -100).sum())),  # forgot the shift
    (ex11.check_split, dict(split=lambda b, k: [{key: v for key, v in b.items()}] * k)),
    (ex11.check_split, dict(split=lambda b, k: [dict(zip(b, vs)) for vs in zip(*(v.chunk(k) for v in b.values()))])),
], ids=["naive-mean-of-means", "zero-grad-per-micro", "no-scaling", "loss-mean-of-means", "count-no-shift",
        "split-copies", "split-no-valueerror"])
def test_checks_catch_mistakes(check, over):
    with pytest.raises(AssertionError):
        check(_solution(**over))


def test_stale_gradients_do_not_leak_into_the_next_candidate(setup):
    """A candidate that fails mid-backward (CUDA OOM) leaves .grad behind on the shared model;
    the next one must start from zero, not accumulate into it."""
    model, init, batches = setup
    clean = A.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    again = A.train_updates(model, init, batches[:1], 2, "token", CFG, "cpu")
    assert A.rel_diff(again["grad"], clean["grad"]) == 0.0 and again["losses"] == clean["losses"]


@pytest.mark.parametrize("interleave", [True, False])
def test_oom_in_one_candidate_is_its_failure(monkeypatch, interleave):
    real = A.prepare_candidate

    def flaky(model, init, batches, k, cfg, device):
        if k == 2:
            A.accumulated_backward(model, batches[0], k)  # leaves gradients behind, as a real OOM would
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, init, batches, k, cfg, device)

    real_measure = A.measure_candidates
    monkeypatch.setattr(A, "config_for", lambda device, smoke=False: CFG)
    monkeypatch.setattr(A, "prepare_candidate", flaky)
    monkeypatch.setattr(A, "measure_candidates", lambda *a, **kw: real_measure(*a, **kw, interleave=interleave))
    recs = {(r.metrics["seq"], r.candidate): r
            for r in A.run(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "cpu", "tiny-b2s16"))}
    for s in (8, 16):
        bad, ok = recs[s, "micro2"], recs[s, "micro4"]
        assert bad.failure.startswith("out of memory") and bad.decision is None and bad.peak_allocated is None
        assert bad.next_step.startswith("failed: out of memory") and bad.timing_noise is None
        assert bad.grad_error <= A.TOL_EQUIV["cpu"]  # its equivalence run still counts
        assert bad.updates == 2 * CFG.updates and bad.metrics["updates_by_run"]["measurement"] is None
        assert ok.failure is None and ok.peak_allocated > 0 and ok.metrics["time_ratio"] > 0
        assert ok.decision in ("accept", "tune") or ok.timing_noise


def test_the_decision_gates_on_the_gradient():
    assert A.decide(5e-5, A.TOL_EQUIV["cuda"], 0.5, 1.0)[0] == "accept"
    assert A.decide(5e-4, A.TOL_EQUIV["cuda"], 0.5, 1.0)[0] == "reject"
    assert A.config_for("cuda").timed >= 20 and A.config_for("cpu").timed >= 20  # enough for a P95


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_tiny(tmp_path):
    recs = registry.run(registry.make_context("TRAIN-GRADIENT-ACCUMULATION", "real_gpu", "tiny-b2s64"))
    assert len(recs) == 2 * len(A.CANDIDATES)
    for r in recs:
        results.load_record(results.save_record(r, tmp_path))
        assert r.evidence_level == "gpu-measured" and r.memory_source == "cuda-allocator" and r.failure is None
        assert r.peak_reserved >= r.peak_allocated > r.metrics["resident_bytes"] > 0
        if r.candidate != "full":
            assert r.grad_error <= A.TOL_EQUIV["cuda"] and r.decision in ("accept", "tune")
