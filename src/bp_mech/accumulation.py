"""Part 02 · 11 — TRAIN-GRADIENT-ACCUMULATION: k micro-batches, one update.

One update over an effective batch of E sequences can run as one forward/backward (the full
batch) or as k forward/backward passes over micro-batches of E/k sequences whose gradients
add up in ``.grad`` before the optimizer steps once. Gradients add; the loss normalisation
decides whether their sum is the full-batch gradient. With S_j the summed token loss of
micro-batch j, n_j its target tokens and N = sum_j n_j:

* token-weighted: micro-batch j contributes S_j / N, and sum_j S_j / N is the full-batch
  mean loss exactly (up to rounding), whatever the padding;
* naive mean of means: (1/k) sum_j S_j / n_j, equal only when every n_j = N / k. With
  padding (labels -100) a short micro-batch's tokens weigh more; Transformers fixed this
  with ``num_items_in_batch`` (its loss divides the sum by the whole batch's count).

The experiment runs the full batch, 2 and 4 micro-batches on the same padded data and the
same initial weights at two sequence lengths, and records per candidate the loss, gradient
and parameter differences to the full batch (both normalisations), the absolute and
incremental peak, and the step median/P95.

Measuring (``measure_candidates``): on the CPU every candidate gets its own model copy and AdamW,
alive together; one tracked update each gives its peak, then the candidates are timed interleaved
on one intra-op thread (``measure.time_interleaved``). On CUDA they run one after another on the
one model, each with only its own optimizer state (the GPU is not shared). A micro-batch candidate
does strictly more work than the full batch (k passes for one update), so measuring it faster is
noise (``measure.timing_noise``). ``updates`` counts the optimizer steps of a candidate's runs that
completed: the token-weighted equivalence run, the naive one (micro-batch candidates) and the
measurement (warm update, tracked update on the CPU, warm-up and timed steps); ``metrics.updates_by_run``
splits them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bp_mech.measure import (CPU_TIMING_THREADS, SMOKE_SCHEDULE, PeakMemory, StepStats, all_finite, free, guarded,
                             measure_steps, time_interleaved, timing_noise)
from bp_mech.results import json_safe
from bp_mech.workload import PAD_ID, PLAN_BASIS, PLAN_BUILD_S, Workload, build_model, make_adamw, make_batches, plan_seconds

IGNORE = -100  # label of a position that is not a target (padding)
CANDIDATES = ("full", "micro2", "micro4")
MICRO = {"full": 1, "micro2": 2, "micro4": 4}  # micro-batches per update

# Decision rule (per micro-batch candidate and sequence length, against the full batch):
#   reject  if the token-weighted first gradient differs from the full batch's by more than
#           TOL_EQUIV (relative, global L2);
#   tune    if the absolute peak falls by less than MIN_PEAK_SAVING (whatever the time);
#   none    if the time ratio is noise (``measure.timing_noise``), or the candidate failed;
#   accept  if the median step rises by at most MAX_TIME_COST;
#   tune    otherwise: correct, but it saves too little memory for its time (use it only when
#           the full batch does not fit).
# The gradient, not the parameters: AdamW's first step is about lr * sign(g) per element, so an
# element whose gradient is within rounding of zero may step 2 lr the other way; the parameter
# difference this makes grows with the model (sqrt of the element count) and is only reported.
TOL_EQUIV = {"cpu": 1e-5, "cuda": 1e-4}  # float32 ||g - g_full|| / ||g_full||, first update
MAX_UPDATE_DIFF = 0.05  # parameters after AdamW, ||a - b|| / ||update||: an eps-level gradient may flip a 2 lr step
MIN_PEAK_SAVING = 0.10
MAX_TIME_COST = 0.50

# The seed's reference (RTX 5070 Ti, Qwen2.5-0.5B; not this book's measurement).
SEED_REFERENCE = dict(device="RTX 5070 Ti", model="Qwen2.5-0.5B", seq_long=256, peak_saving_max=0.173,
                      median_increase=0.335, short_seq_decision="tune")


@dataclass(frozen=True)
class AccumConfig:
    micro_max: int = 4  # finest split; effective batch E = workload.batch * micro_max
    updates: int = 3  # updates of the equivalence run (same E-sequence batches for every candidate)
    lr: float = 1e-3  # AdamW learning rate
    timed: int = 60  # timed steps per candidate, one update each (CPU: interleaved rounds)
    warmup: int = 3  # untimed steps (rounds) before them; the CPU runs one tracked update (the peak) first
    max_pad_fraction: float = 0.75  # each row loses a random share in [0, this) of its tail to padding
    short_divisor: int = 2  # the second sequence length is seq // short_divisor


def config_for(device, smoke: bool = False) -> AccumConfig:
    if smoke:
        return AccumConfig(timed=SMOKE_SCHEDULE[0], warmup=SMOKE_SCHEDULE[1])
    return AccumConfig(timed=20, warmup=2) if torch.device(device).type == "cuda" else AccumConfig()


# --- data ------------------------------------------------------------------------------

def padded_batches(w: Workload, n: int, micro_max: int, max_pad: float) -> list[dict[str, torch.Tensor]]:
    """``n`` effective batches of E = w.batch * micro_max rows, right-padded at random.

    Row r keeps its first T - p_r tokens (p_r < max_pad * T); the rest become PAD_ID inputs
    with label -100, so micro-batches hold different numbers of target tokens. Right padding
    under a causal mask never changes a real token's logits, so no attention mask is needed.
    """
    E, T = w.batch * micro_max, w.seq
    g = torch.Generator().manual_seed(w.seed + 11)
    out = []
    for b in make_batches(w.replace(batch=E), n):
        pads = (torch.rand(E, generator=g) * max_pad * T).long().clamp(max=T - 2)  # (E,)
        pad = torch.arange(T)[None, :] >= (T - pads)[:, None]  # (E, T) True on the padded tail
        out.append({"input_ids": b["input_ids"].masked_fill(pad, PAD_ID),
                    "labels": b["labels"].masked_fill(pad, IGNORE)})
    return out


def split(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """k micro-batches along the batch dimension, in order. Raises ValueError if E % k."""
    E = batch["input_ids"].shape[0]
    if k < 1 or E % k:
        raise ValueError(f"cannot split a batch of {E} sequences into {k} equal micro-batches")
    return [{key: v[j * (E // k):(j + 1) * (E // k)] for key, v in batch.items()} for j in range(k)]


# --- the loss and the accumulated update (from scratch) --------------------------------

def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets that count: labels[:, 1:] != -100 (position t predicts t + 1)."""
    return (labels[..., 1:] != IGNORE).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies (at least float32). logits (B, T, V), labels (B, T).

    Shifts the labels (pad one -100 on the right) instead of slicing the logits, so the
    (B, T, V) logits are never copied — the same trick as Transformers' ForCausalLMLoss.
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]  # (B, T)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # float64 stays
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")


def accumulated_backward(model, batch: dict[str, torch.Tensor], k: int, norm: str = "token") -> torch.Tensor:
    """Forward/backward over k micro-batches; ``.grad`` then holds the update's gradient.

    norm="token": loss_j = S_j / N (N = targets of the whole batch); sum_j loss_j is the
    full-batch mean. norm="naive": loss_j = (S_j / n_j) / k, the mean of micro-batch means.
    Returns the accumulated loss (detached), the value a training log would show.
    """
    if norm not in ("token", "naive"):
        raise ValueError(f"unknown normalisation {norm!r}")
    n_total = count_targets(batch["labels"])
    total = 0.0
    for mb in split(batch, k):
        s = token_loss_sum(model(input_ids=mb["input_ids"]).logits, mb["labels"])
        loss = s / n_total if norm == "token" else s / count_targets(mb["labels"]) / k
        loss.backward()
        total = total + loss.detach()
    return total


# --- helpers: snapshots and differences ------------------------------------------------

def _copy(tensors) -> list[torch.Tensor]:
    """Snapshots on the tensors' own device (a GPU run never round-trips 2 GB through the host)."""
    return [t.detach().clone() for t in tensors]


def rel_diff(tensors, ref: list[torch.Tensor], base: list[torch.Tensor] | None = None) -> float:
    """||a - r|| / ||r - base|| over all tensors (global L2, float64); base None -> ||r||."""
    num = den = 0.0
    for i, (a, r) in enumerate(zip(tensors, ref)):
        r = r.to(a.device, torch.float64)
        num += (a.detach().double() - r).pow(2).sum().item()
        den += (r - (base[i].to(a.device, torch.float64) if base is not None else 0)).pow(2).sum().item()
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


def train_updates(model, init: dict, batches, k: int, norm: str, cfg: AccumConfig, device) -> dict:
    """``len(batches)`` updates from ``init``; the losses, the first update's gradient and the
    parameters after update 1 (snapshots); the model holds the parameters after the last."""
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)  # after a failed candidate, stale gradients may remain
    opt = make_adamw(model.parameters(), cfg.lr, device)
    losses, finite, out = [], True, {}
    for i, b in enumerate(batches):
        losses.append(accumulated_backward(model, b, k, norm).item())
        finite &= all_finite(p.grad for p in model.parameters())
        if i == 0:
            out["grad"] = _copy(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            out["params_1"] = _copy(model.parameters())
    out.update(losses=losses, finite=finite and all(math.isfinite(x) for x in losses))
    return out


def equivalence(model, init: dict, batches, cfg: AccumConfig, device) -> dict:
    """Each candidate and normalisation against the full batch: {candidate: {norm: diffs}}."""
    ref = train_updates(model, init, batches, 1, "token", cfg, device)
    p0 = [init[n] for n, _ in model.named_parameters()]  # tied weights appear once
    ref_last = _copy(model.parameters())
    zero = dict.fromkeys(("loss_rel_diff", "grad_rel_diff", "param_rel_diff_1", "param_rel_diff",
                          "param_diff_vs_update"), 0.0)
    out = {"full": {"token": dict(zero, finite=ref["finite"], losses=ref["losses"]), "naive": None}}
    for name in CANDIDATES[1:]:
        out[name] = {}
        for norm in ("token", "naive"):
            r = train_updates(model, init, batches, MICRO[name], norm, cfg, device)
            out[name][norm] = dict(
                finite=r["finite"], losses=r["losses"],
                loss_rel_diff=abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0]),
                grad_rel_diff=rel_diff(r["grad"], ref["grad"]),
                param_rel_diff_1=rel_diff(r["params_1"], ref["params_1"]),
                param_rel_diff=rel_diff(model.parameters(), ref_last),
                param_diff_vs_update=rel_diff(model.parameters(), ref_last, p0),
            )
    return out


# --- the measured step ---------------------------------------------------------------

def prepare_candidate(model, init: dict, batches, k: int, cfg: AccumConfig, device):
    """Load ``init`` into ``model``, make its AdamW and run one warm update (k micro-batches,
    token-weighted), which creates the optimizer state. Returns ``(step, resident, resident_bytes)``.

    resident = the parameters and the AdamW state (exp_avg, exp_avg_sq, step) that exist before a
    step; the warm update's gradients are freed (set_to_none). incremental peak = absolute peak -
    resident bytes: what the step itself adds (gradients, activations, logits, temporaries, the
    batch, library workspaces).
    """
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    opt = make_adamw(model.parameters(), cfg.lr, device)

    def step(i: int) -> None:
        accumulated_backward(model, batches[i % len(batches)], k, "token")
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # creates the optimizer state (lazy) before anything is measured
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    nbytes = sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + state)
    return step, [list(model.parameters()), state], nbytes


def measure_candidates(model, init: dict, batches, cfg: AccumConfig, device, progress=None,
                       interleave: bool | None = None) -> dict:
    """``{name: ({stats, resident, incremental, updates}, None) | (None, failure)}`` for every candidate.

    CPU (``interleave``, the default there): every candidate its own copy of ``model`` and AdamW,
    alive together; one tracked update each gives its peak, then ``time_interleaved``: cfg.warmup
    untimed and cfg.timed timed rounds, one update of every candidate per round, one intra-op thread.
    CUDA: one candidate after another on ``model``, with only its own optimizer state:
    ``measure_steps`` over cfg.warmup + cfg.timed updates, the allocator's peak covering them.
    """
    out, started = {}, {}
    sequential = not (torch.device(device).type == "cpu" if interleave is None else interleave)

    def result(st, nbytes, tracked):
        return dict(stats=st, resident=nbytes, incremental=st.peak_allocated - nbytes,
                    updates=1 + tracked + cfg.warmup + cfg.timed)

    for name in CANDIDATES:
        if sequential:
            def alone(name=name):
                step, resident, nbytes = prepare_candidate(model, init, batches, MICRO[name], cfg, device)
                free(device)  # the reserved peak is this candidate's own
                st = measure_steps(step, cfg.warmup + cfg.timed, cfg.warmup, device, resident=resident)
                return result(st, nbytes, torch.device(device).type == "cpu")  # measure_steps tracks on the CPU

            out[name] = guarded(alone)
            continue

        def start(name=name):  # its own model copy; the peak of one tracked update
            step, resident, nbytes = prepare_candidate(copy.deepcopy(model), init, batches, MICRO[name], cfg, device)
            with PeakMemory(device, resident=resident) as pm:
                step(-1)
            return step, pm, nbytes

        r, failure = guarded(start)
        if failure:
            out[name] = (None, failure)
        else:
            started[name] = r
    if started:
        timings, failure = guarded(time_interleaved, {n: s for n, (s, _, _) in started.items()}, cfg.timed,
                                   cfg.warmup, device, progress=progress)
        for n, (_, pm, nbytes) in started.items():
            out[n] = (None, failure) if failure else (result(
                StepStats(timings[n], pm.peak_allocated, pm.peak_reserved, pm.memory_source), nbytes, True), None)
    return {n: out[n] for n in CANDIDATES}


def decide(equiv_diff: float | None, tol: float, peak_ratio: float | None, time_ratio: float | None,
           noise: str | None = None):
    """The documented rule; returns (decision, next_step)."""
    if equiv_diff is None or equiv_diff > tol:
        return "reject", "the token-weighted gradient does not match the full batch's: fix the loss normalisation"
    if peak_ratio is None or time_ratio is None:
        return None, "no full-batch measurement to compare with (it failed); see the failure field"
    if 1 - peak_ratio < MIN_PEAK_SAVING:
        return "tune", "correct, but the peak barely falls: prefer the full batch while it fits"
    if noise is not None:
        return None, (f"correct and saves memory, but the time ratio is noise ({noise}): "
                      "time it on the target GPU or a quiet machine")
    if time_ratio - 1 <= MAX_TIME_COST:
        return "accept", "use it when the full batch does not fit; it saves memory at a bounded time cost"
    return "tune", "correct, but the saving does not pay for the time: prefer the full batch while it fits"


def seq_lengths(w: Workload, cfg: AccumConfig) -> list[int]:
    return sorted({max(2, w.seq // cfg.short_divisor), w.seq})


def run(ctx) -> list:
    cfg, dev = config_for(ctx.device, ctx.smoke), ctx.device
    model = build_model(ctx.workload, dev)
    init = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
    recs = []
    for seq in ctx.progress(seq_lengths(ctx.workload, cfg), desc="sequence lengths"):
        w = ctx.workload.replace(seq=seq)  # its own workload_id and run label: never merged
        sub = dataclasses.replace(ctx, workload=w, run_label=f"{ctx.run_label}-s{seq}", _base=None)
        batches = [{k: v.to(dev) for k, v in b.items()}
                   for b in padded_batches(w, max(cfg.updates, 2), cfg.micro_max, cfg.max_pad_fraction)]
        eq, eq_fail = guarded(equivalence, model, init, batches[:cfg.updates], cfg, dev)
        meas = measure_candidates(model, init, batches, cfg, dev, progress=ctx.progress)
        recs += [_record(sub, name, cfg, batches, (eq or {}).get(name), meas[name][0], meas["full"][0],
                         meas[name][1] or eq_fail) for name in CANDIDATES]
    return recs


def _record(ctx, name: str, cfg: AccumConfig, batches, eq: dict | None, m: dict | None, base: dict | None,
            fail: str | None):
    """One candidate's record: equivalence (token + naive), measurement, ratios, decision."""
    eq = json_safe(eq)
    tok, st = (eq or {}).get("token") or {}, m["stats"] if m else None
    bt = base["stats"].timing if base else None
    ratios = (st.peak_allocated / base["stats"].peak_allocated, st.timing.median_s / bt.median_s) \
        if st and base else (None, None)
    noise = timing_noise(st.timing, bt, more_work=True) if st and base and name != "full" else None
    if name == "full":
        decision, nxt = None, "the baseline: every other candidate is compared with it"
    else:
        decision, nxt = decide(tok.get("grad_rel_diff"), TOL_EQUIV[torch.device(ctx.device).type], *ratios, noise)
    if fail:
        decision, nxt = None, f"failed: {fail}"
    k, E = MICRO[name], ctx.workload.batch * cfg.micro_max
    by_run = dict(equivalence_token=cfg.updates if eq else None,
                  equivalence_naive=(cfg.updates if eq else None) if name != "full" else 0,
                  measurement=m and m["updates"])
    ran = [n for n in by_run.values() if n is not None]
    return ctx.record(
        name, input_shape=[E // k, ctx.workload.seq], effective_batch=E, updates=sum(ran) if ran else None,
        update_count=cfg.updates if eq else None, output_error=tok.get("loss_rel_diff"),
        grad_error=tok.get("grad_rel_diff"), all_finite=tok.get("finite"),
        peak_allocated=st and st.peak_allocated, peak_reserved=st and st.peak_reserved,
        step_median_s=st and st.timing.median_s, step_p95_s=st and st.timing.p95_s,
        warmup_excluded=st and st.timing.warmup_excluded, threads=st and st.timing.threads, timing_noise=noise,
        memory_source=ctx.memory_source if st else None, failure=fail, decision=decision, next_step=nxt,
        metrics=dict(
            micro_batches=k, micro_batch_size=E // k, seq=ctx.workload.seq, lr=cfg.lr, timed_steps=cfg.timed,
            target_tokens=[[int(count_targets(mb["labels"])) for mb in split(b, k)] for b in batches],
            resident_bytes=m and m["resident"], incremental_peak=m and m["incremental"], updates_by_run=by_run,
            peak_ratio=ratios[0], time_ratio=ratios[1], p95_ratio=st.timing.p95_s / bt.p95_s if st and base else None,
            step_samples_s=st and st.timing.samples, interleaved=st and st.timing.interleaved,
            token=tok or None, naive=(eq or {}).get("naive"),
            rule=dict(tol_equiv=TOL_EQUIV[torch.device(ctx.device).type], min_peak_saving=MIN_PEAK_SAVING,
                      max_time_cost=MAX_TIME_COST)))


def plan(ctx) -> dict:
    """Workloads, steps and, per mode, a planning estimate: ``modes.real_gpu.estimated_seconds`` is one GPU's."""
    w, seqs, modes = ctx.workload, seq_lengths(ctx.workload, AccumConfig()), {}
    for mode, dev in (("real_gpu", "cuda"), ("cpu", "cpu")):
        cfg = config_for(dev, ctx.smoke)
        E, updates = w.batch * cfg.micro_max, 1 + cfg.warmup + cfg.timed + (dev == "cpu")  # warm + timed (+ tracked)
        # equivalence: full once, each micro candidate twice (token, naive); k micro-batch passes per update
        passes = {c: MICRO[c] * (cfg.updates * (1 if c == "full" else 2) + updates) for c in CANDIDATES}
        est = sum(plan_seconds(w.arch, E * s // MICRO[c], n, dev) for s in seqs for c, n in passes.items())
        loads = 8 * len(seqs) * (0.5 if dev == "cuda" else 0.0)  # load_state_dict from the host copy
        modes[mode] = dict(timed_steps=cfg.timed, warmup_excluded=cfg.warmup, equivalence_updates=cfg.updates,
                           interleaved=dev == "cpu", threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                           estimated_seconds=round(PLAN_BUILD_S[dev] + est + loads, 1))
    return dict(workloads=[w.replace(seq=s).workload_id for s in seqs], run_labels=[f"{ctx.run_label}-s{s}" for s in seqs],
                effective_batch=w.batch * AccumConfig.micro_max, micro_batches=dict(MICRO), optimizer="AdamW",
                normalisations=["token-weighted", "naive mean of means"], lr=AccumConfig.lr, modes=modes,
                estimate_basis=PLAN_BASIS + "; + 0.5 s per state load from the host (cuda)",
                rule=dict(tol_equiv=TOL_EQUIV, min_peak_saving=MIN_PEAK_SAVING, max_time_cost=MAX_TIME_COST))


def accelerate_updates(model, init: dict, batches, k: int, lr: float) -> list[torch.Tensor]:
    """The same updates through Accelerate's ``accumulate`` and Transformers' own loss.

    ``model(..., labels=, num_items_in_batch=N)`` returns S_j / N (Transformers' token-weighted
    loss); ``accelerator.backward`` divides by gradient_accumulation_steps, so it gets k S_j / N.
    The prepared optimizer steps (and zeroes) only on every k-th micro-batch. Returns the first
    update's gradient; the model holds the parameters after the last update.
    """
    from accelerate import Accelerator

    model.load_state_dict(init)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    m, opt = acc.prepare(model, make_adamw(model.parameters(), lr, "cpu"))
    first_grad = None
    for b in batches:
        n = count_targets(b["labels"])  # targets of the whole effective batch
        for mb in split(b, k):
            with acc.accumulate(m):
                out = m(input_ids=mb["input_ids"], labels=mb["labels"], num_items_in_batch=n)
                acc.backward(out.loss * k)
                if acc.sync_gradients and first_grad is None:
                    first_grad = _copy(p.grad for p in model.parameters())
                opt.step()
                opt.zero_grad()
    return first_grad


def conformance():
    """The hand-written loop vs ``accelerate_updates``: first gradient and final parameters."""
    from bp_mech.registry import ConformanceRow
    from bp_mech.workload import parse_workload

    w = parse_workload("tiny-b2s32")
    cfg = AccumConfig(updates=2)
    batches = padded_batches(w, cfg.updates, cfg.micro_max, cfg.max_pad_fraction)
    model = build_model(w)
    init = {n: t.clone() for n, t in model.state_dict().items()}
    worst, update_worst, finite = 0.0, 0.0, True
    p0 = [init[n] for n, _ in model.named_parameters()]
    for k in (2, 4):
        ours = train_updates(model, init, batches, k, "token", cfg, "cpu")
        ours_p, finite = _copy(model.parameters()), finite and ours["finite"]
        first_grad = accelerate_updates(model, init, batches, k, cfg.lr)
        worst = max(worst, rel_diff(first_grad, ours["grad"]))
        # parameters relative to the update: our loss and Accelerate's are different float32 operations, and
        # AdamW turns a reordering at an element with |g| ~ eps into a step of up to 2 lr (see test_accumulation)
        update_worst = max(update_worst, rel_diff(model.parameters(), ours_p, p0))
    return ConformanceRow("Part 02 · 11", "TRAIN-GRADIENT-ACCUMULATION",
                          "Accelerate Accelerator(gradient_accumulation_steps=k).accumulate + num_items_in_batch",
                          worst <= TOL_EQUIV["cpu"] and update_worst <= MAX_UPDATE_DIFF and finite,
                          f"first gradient, k = 2 and 4, padded uneven micro-batches: max rel. difference {worst:.2e} "
                          f"(tol {TOL_EQUIV['cpu']:g}, float32); parameters after {cfg.updates} AdamW updates, relative "
                          f"to the update: {update_worst:.2e} (tol {MAX_UPDATE_DIFF:g})")
