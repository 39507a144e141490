"""Assumed sustained rates: what ``--mode dry_run`` estimates seconds from, and the planner's time model.

Never measurements. "cuda" is one H200-class GPU, conservative (float32 matmuls without TF32; 16-bit
under autocast); "cpu" is 2 cores. A pass is one forward + backward (+ optimizer update) over ``tokens``.
"""

from __future__ import annotations

import torch

from bp_mech.instruments.workload import param_count

ASSUMED_FLOPS = {"cuda": {"float32": 20e12, "low": 150e12}, "cpu": {"float32": 1e10, "low": 5e9}}
ASSUMED_PASS_S = {"cuda": 0.03, "cpu": 0.01}  # per pass: kernel launches, memory-bound ops, AdamW
ASSUMED_BUILD_S = {"cuda": 4.0, "cpu": 2.0}  # per model: random init on the device (~1 s) + the CUDA context
ASSUMED_BASIS = ("6 x parameters x tokens FLOPs per pass at ASSUMED_FLOPS + ASSUMED_PASS_S per pass + "
                 "ASSUMED_BUILD_S per model (bp_mech.bench.rates); real_gpu = one H200-class GPU, float32 without "
                 "TF32; cpu = 2 cores")


def dry_run_seconds(arch: str, tokens: int, passes: float, device, low: bool = False) -> float:
    """Estimated seconds of ``passes`` passes over ``tokens`` tokens each (6 N tokens FLOPs per pass)."""
    dev = torch.device(device).type
    flops = ASSUMED_FLOPS[dev]["low" if low else "float32"]
    return passes * (6 * param_count(arch) * tokens / flops + ASSUMED_PASS_S[dev])
