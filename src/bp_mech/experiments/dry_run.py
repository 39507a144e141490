"""``--mode dry_run``: what an experiment would run, per mode, and about how long; no model is touched.

An experiment's ``dry_run(ctx)`` returns its own fields and a ``modes`` entry from ``per_mode``: the
schedule it would run on each device and an ``estimated_seconds`` from the assumed rates of
``bench.rates`` (never a measurement). The helpers here are those of the harness's two kinds of
experiment: ``same_weights_modes`` (19, 42: the arms share one model) and ``own_weights_modes`` (11,
AMP, 55, 56: each arm its own model).
"""

from __future__ import annotations

from typing import Callable

import torch

from bp_mech.bench.rates import ASSUMED_BUILD_S, dry_run_seconds
from bp_mech.bench.timing import CPU_TIMING_THREADS, SMOKE_SCHEDULE
from bp_mech.instruments.workload import param_count

MODES = (("cpu", "cpu"), ("real_gpu", "cuda"))  # (mode, its device) of every dry run
PROBE_BYTES_S = 50e9  # gradient bytes per second a probe copies and compares on the device


def schedule(device, smoke: bool = False) -> tuple[int, int]:
    """(timed rounds, warm-up rounds): every arm runs once per round. CUDA: at least 20 timed steps;
    CPU: 60 (a tiny step takes ~10 ms on one thread); a smoke run: ``bench.timing.SMOKE_SCHEDULE``."""
    if smoke:
        return SMOKE_SCHEDULE
    return (20, 3) if torch.device(device).type == "cuda" else (60, 3)


def per_mode(fields: Callable[[str], dict]) -> dict:
    """The one loop of every dry run: ``{mode: fields(its device type)}`` for ``cpu`` and ``real_gpu``."""
    return {mode: fields(dev) for mode, dev in MODES}


def steps_per_arm(rounds: int, warmup: int) -> int:
    """Training steps ``harness.measure`` runs per arm: the tracked one, the warm-up and the timed ones."""
    return 1 + warmup + rounds


def same_weights_seconds(w, factors, device, smoke: bool = False) -> float:
    """Estimated seconds of ``harness.same_weights``: per arm its tracked, warm-up and timed steps and the
    probe at ``factor`` x a plain pass, plus the probe's gradient copy; one model build and the update
    that allocates AdamW's moments."""
    dev = torch.device(device).type
    passes, probe_s = steps_per_arm(*schedule(dev, smoke)) + 1, param_count(w.arch) * 4 / PROBE_BYTES_S
    return round(ASSUMED_BUILD_S[dev] + dry_run_seconds(w.arch, w.batch * w.seq, 1, dev)
                 + sum(dry_run_seconds(w.arch, w.batch * w.seq, f * passes, dev) + probe_s for f in factors), 1)


def same_weights_modes(w, factors, smoke: bool = False, **per_device) -> dict:
    """Steps and estimated seconds per mode of an experiment on ``harness.same_weights`` (interleaved on
    both devices); ``per_device``: more fields, each a function of the device type."""
    def fields(dev):
        rounds, warmup = schedule(dev, smoke)
        return dict(timed_rounds=rounds, warmup_rounds=warmup, interleaved=True,
                    threads=CPU_TIMING_THREADS if dev == "cpu" else None,
                    estimated_seconds=same_weights_seconds(w, factors, dev, smoke),
                    **{k: v(dev) for k, v in per_device.items()})
    return per_mode(fields)


def own_weights_modes(mode_schedule: Callable[[str], tuple[int, int, dict]]) -> dict:
    """Per mode, an experiment whose arms own their models: ``mode_schedule(device type) -> (timed rounds,
    warm-up rounds, fields)`` (``estimated_seconds`` among them); added here the steps each arm runs and
    how they are timed (interleaved on one CPU thread; alone on CUDA)."""
    def fields(dev):
        rounds, warmup, own = mode_schedule(dev)
        return dict(timed_rounds=rounds, warmup_rounds=warmup, measured_steps=steps_per_arm(rounds, warmup),
                    interleaved=dev == "cpu", threads=CPU_TIMING_THREADS if dev == "cpu" else None, **own)
    return per_mode(fields)
