"""Project 73 — the training loop on Accelerate, the program ``accelerate launch`` runs.

    accelerate launch --num_processes 1 -m bp_mech.projects.baseline_loop --config cfg.json --out DIR
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 \\
        -m bp_mech.projects.baseline_loop --config cfg.json --out DIR

(``bp_mech.projects.baseline.launch_command`` builds these.) The same file runs as one process or as
P processes: ``Accelerator`` reads the launcher's environment and wraps the model in DDP over gloo
(CPU) or NCCL (GPUs). Every update of ``run_updates``:

1. fetch the update's k micro-batches, this rank's rows of each (``baseline_loss.shard_rows``, what
   Accelerate's ``split_batches=True`` gives), count their target tokens and all-reduce the count:
   the divisor N / P (``baseline_loss.loss_divisor``);
2. per micro-batch, inside ``accelerator.accumulate(model)`` (no gradient all-reduce until the k-th):
   forward, summed token loss S, ``accelerator.backward(S / divisor * k)`` (``backward`` divides by k);
3. on the k-th: ``accelerator.clip_grad_norm_`` (it unscales an fp16 loss scale first, then clips),
   the prepared optimizer's step (skipped by the GradScaler on inf/NaN), ``zero_grad``;
4. the WSD clock of Part 02 · 12 advances only when ``accelerator.optimizer_step_was_skipped`` is
   False; the logged loss is the global token mean, all-reduced.

Rank 0 writes ``result.json`` (and, with ``save_tensors``, ``tensors.pt``: the first update's
gradient and parameter snapshots) into ``--out``.

This loop is not the book's one training step (``bench.step.train_step``), on purpose: it is
Accelerate's own idiom, ``accelerator.backward`` inside ``accelerator.accumulate`` and the prepared
optimizer's step, as the project shows it, and its divisor counts target tokens across processes
(``train_step``'s micro-batches count them on one). ``bench.step`` lists it among the loops outside
the one step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bp_mech import accumulation
from bp_mech.bench.timing import CPU_TIMING_THREADS, sync, timing_threads
from bp_mech.bench.oom import is_allocation_failure
from bp_mech.projects import baseline_loss
from bp_mech.scheduler import UpdateClock, WSDConfig
from bp_mech.bench.step import optimizer_state
from bp_mech.instruments.peak import PeakMemory
from bp_mech.update_dynamics import clip_coefficient
from bp_mech.instruments.workload import Workload, build_model, make_batches
from bp_mech.instruments.adamw import make_adamw


@dataclass(frozen=True)
class LoopConfig:
    workload: dict  # the Workload's fields (model, seq, seed); its batch is not used: see global_batch
    global_batch: int  # G: rows of one micro-batch over all processes (P processes x G / P rows each)
    accumulation: int = 2  # k: micro-batches per update (effective batch k * G sequences)
    updates: int = 60  # optimizer updates of the baseline run
    warmup_excluded: int = 2  # leading updates left out of the timing (0: lazy init and AdamW's state; 1: the peak)
    peak_update: int = 1  # the update whose peak is tracked (its storages on the CPU, the allocator on CUDA)
    lr: float = 1e-3  # AdamW's peak learning rate (the WSD schedule's stable value)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    warmup: int = 6  # WSD: linear warmup updates
    decay: int = 20  # WSD: decay updates at the end (cosine); stable = updates - warmup - decay
    max_norm: float = 1.0  # global-norm clipping threshold (after unscaling)
    max_pad: float = 0.5  # each row loses a random share in [0, this) of its tail to padding (labels -100)
    holdout_batches: int = 4  # G-row batches of the holdout text, evaluated before and after
    mixed_precision: str = "no"  # Accelerate's: "no" | "fp16" | "bf16"
    device: str = "cpu"  # "cpu" (gloo between processes) or "cuda" (NCCL)
    naive_updates: int = 0  # > 0: parameters snapshotted after this many updates; P > 1: the naive rerun's updates
    save_tensors: bool = False  # write the gradient and parameter snapshots (tiny models only)
    progress: bool = False  # a progress bar over the updates on rank 0 (stderr)

    def wsd(self) -> WSDConfig:
        stable = max(0, self.updates - self.warmup - self.decay)
        return WSDConfig(base_lr=self.lr, warmup=self.warmup, stable=stable, decay=self.decay)


def train_batches(w: Workload, cfg: LoopConfig) -> list[dict[str, torch.Tensor]]:
    """updates * k micro-batches of G rows, right-padded unevenly (``accumulation.padded_batches``),
    so ranks and micro-batches hold different numbers of target tokens."""
    return accumulation.padded_batches(w.replace(batch=cfg.global_batch), cfg.updates * cfg.accumulation, 1,
                                       cfg.max_pad)


def holdout_loss(acc, model, batches) -> float:
    """Token mean over the holdout batches (this rank's rows of each), summed in float64 over ranks."""
    s = torch.zeros((), dtype=torch.float64, device=acc.device)
    n = torch.zeros((), dtype=torch.long, device=acc.device)
    with torch.no_grad():
        for b in batches:
            mine = baseline_loss.shard_rows(b, acc.process_index, acc.num_processes)
            s += accumulation.token_loss_sum(model(input_ids=mine["input_ids"].to(acc.device)).logits,
                                             mine["labels"].to(acc.device)).double()
            n += accumulation.count_targets(mine["labels"]).to(acc.device)
    return (acc.reduce(s, "sum") / acc.reduce(n, "sum")).item()


def run_updates(acc, model, opt, cfg: LoopConfig, batches, n_updates: int, divisor_fn,
                snapshot=None) -> dict:
    """``n_updates`` updates (the module docstring's steps 1-4); per update: the global
    loss, N, the time on this rank, the gradient norm before clipping, the clip
    coefficient, the LR, applied. Accelerate's idiom, kept as such (module
    docstring)."""
    from tqdm.auto import tqdm

    clock = UpdateClock(cfg.wsd(), opt)
    k, P, rank = cfg.accumulation, acc.num_processes, acc.process_index
    all_reduce = lambda t: acc.reduce(t.to(acc.device), "sum")  # noqa: E731
    rows = {key: [] for key in ("loss", "target_tokens", "seconds", "cpu_seconds",
                                "grad_norm", "clip_coef", "lr", "applied")}
    peak = None
    bar = tqdm(range(n_updates), desc=f"updates ({P} process{'es' * (P > 1)})",
               disable=not (cfg.progress and rank == 0))
    for u in bar:
        micro = [{key: v.to(acc.device) for key, v
                  in baseline_loss.shard_rows(batches[u * k + j], rank, P).items()}
                 for j in range(k)]
        tracked = u == cfg.peak_update
        pm = PeakMemory(
            acc.device, resident=[model.parameters(), optimizer_state(opt)]
        ) if tracked else contextlib.nullcontext()
        lr = clock.lr
        sync(acc.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        with pm:
            # this rank's target tokens, per micro-batch
            counts = [accumulation.count_targets(mb["labels"]) for mb in micro]
            divisor = divisor_fn(counts, P, all_reduce)
            loss_sum = torch.zeros((), device=acc.device)
            for mb in micro:
                with acc.accumulate(model):
                    s = accumulation.token_loss_sum(
                        model(input_ids=mb["input_ids"]).logits, mb["labels"])
                    # accelerate's backward divides by k: S / divisor reaches .grad
                    acc.backward(s / divisor * k)
                    loss_sum += s.detach()
                    if acc.sync_gradients:
                        if snapshot is not None and u == 0:
                            snapshot["grad"] = [p.grad.detach().clone()
                                                for p in model.parameters()]
                        # unscaled (fp16), then clipped
                        norm = acc.clip_grad_norm_(model.parameters(), cfg.max_norm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            applied = not acc.optimizer_step_was_skipped
            clock.step(applied)  # the LR clock counts applied updates only
            n_local = sum(counts)
            # one all-reduce for the log
            loss_sum, n_total = all_reduce(
                torch.stack([loss_sum, n_local.to(loss_sum)]))
            # the global token mean (n_total < 2^24: exact in float32)
            loss = (loss_sum / n_total).item()
        sync(acc.device)
        rows["seconds"].append(time.perf_counter() - t0)
        # this rank's thread: no wait for a core or the peer
        rows["cpu_seconds"].append(time.thread_time() - c0)
        if tracked:
            peak = pm.peak.allocated
        for key, v in (("loss", loss), ("target_tokens", round(n_total.item())),
                       ("grad_norm", norm.item()),
                       ("clip_coef", clip_coefficient(norm, cfg.max_norm).item()),
                       ("lr", lr), ("applied", applied)):
            rows[key].append(v)
        if snapshot is not None and u + 1 == cfg.naive_updates:
            snapshot["params_early"] = [p.detach().clone() for p in model.parameters()]
    bar.close()
    return dict(rows, peak=peak, updates=clock.updates, skipped=clock.skipped)


def train(cfg: LoopConfig, out: Path | None = None) -> dict:
    """The baseline run (and the naive rerun) in this process, one rank of ``accelerate launch``."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    no_broadcast = DistributedDataParallelKwargs(broadcast_buffers=False)  # the only buffers: rotary constants
    acc = Accelerator(cpu=cfg.device == "cpu", gradient_accumulation_steps=cfg.accumulation,
                      mixed_precision=cfg.mixed_precision, kwargs_handlers=[no_broadcast])
    w = Workload(**cfg.workload)
    if cfg.global_batch % acc.num_processes:
        raise ValueError(f"global micro-batch {cfg.global_batch} does not split over {acc.num_processes} processes")
    with timing_threads(acc.device, CPU_TIMING_THREADS) as threads:  # one intra-op thread per process on the CPU
        model = build_model(w, acc.device)
        init = {n: t.detach().clone() for n, t in model.state_dict().items()}
        opt = make_adamw(model.parameters(), cfg.lr, acc.device, weight_decay=cfg.weight_decay)
        model, opt = acc.prepare(model, opt)
        batches = train_batches(w, cfg)
        holdout = make_batches(w.replace(batch=cfg.global_batch), cfg.holdout_batches, text="holdout")
        plain = acc.unwrap_model(model)
        before = holdout_loss(acc, plain, holdout)
        snap = {} if cfg.save_tensors else None
        if snap is not None:
            snap["init"] = [p.detach().clone() for p in model.parameters()]
        run = run_updates(acc, model, opt, cfg, batches, cfg.updates, baseline_loss.loss_divisor, snap)
        after = holdout_loss(acc, plain, holdout)
        if snap is not None:
            snap["params"] = [p.detach().clone() for p in model.parameters()]
        naive = None
        if cfg.naive_updates and acc.num_processes > 1:  # same weights, same rows, per-rank token means
            plain.load_state_dict(init)
            naive_snap = {} if snap is not None else None
            opt2 = acc.prepare(make_adamw(model.parameters(), cfg.lr, acc.device, weight_decay=cfg.weight_decay))
            naive = run_updates(acc, model, opt2, dataclasses.replace(cfg, peak_update=-1), batches,
                                cfg.naive_updates, baseline_loss.per_rank_divisor, naive_snap)
            if snap is not None:
                snap.update(naive_grad=naive_snap["grad"], naive_params_early=naive_snap["params_early"])
        seconds = torch.tensor([run["seconds"], run["cpu_seconds"]], dtype=torch.float64, device=acc.device)
        times, cpu_times = acc.gather(seconds[None]).reshape(acc.num_processes, 2, -1).unbind(1)  # (P, updates) each
        peaks = acc.gather(torch.tensor([run["peak"] or 0], device=acc.device)).tolist()
    result = dict(processes=acc.num_processes, distributed_type=str(acc.distributed_type),
                  backend=acc.state.backend, device=str(acc.device), mixed_precision=cfg.mixed_precision,
                  threads=threads, holdout_before=before, holdout_after=after,
                  per_process_rows=cfg.global_batch // acc.num_processes,
                  seconds=times.max(0).values.tolist(), seconds_by_rank=times.tolist(),
                  cpu_seconds=cpu_times.max(0).values.tolist(), peak_by_rank=peaks,
                  run={k: v for k, v in run.items() if k not in ("seconds", "cpu_seconds")},
                  naive=naive and {k: v for k, v in naive.items() if k not in ("seconds", "cpu_seconds")})
    if out is not None and acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))
        if snap is not None:
            torch.save({k: [t.cpu() for t in v] for k, v in snap.items()}, out / "tensors.pt")
    acc.wait_for_everyone()
    return dict(result, tensors=snap)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Project 73's training loop (run it with accelerate launch)")
    p.add_argument("--config", required=True, help="a JSON file of LoopConfig fields")
    p.add_argument("--out", required=True, help="directory for result.json (rank 0)")
    a = p.parse_args(argv)
    cfg = LoopConfig(**json.loads(Path(a.config).read_text()))
    try:
        train(cfg, Path(a.out))
    except Exception as e:  # noqa: BLE001 (an allocation failure is the candidate's failure; anything else a bug)
        if not is_allocation_failure(e):
            raise
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "result.json").write_text(json.dumps(dict(failure=f"{type(e).__name__}: {str(e)[:200]}")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
