"""Per-GPU model state under data parallelism: DDP, ZeRO's three stages and FSDP2, by formula (project 76).

With Ψ parameters trained in float32 by AdamW, a replica holds ``w = 4`` bytes of weights, ``g = 4`` of
gradients and ``o = 8`` of moments per parameter: 16 Ψ bytes. Data parallelism over N GPUs replicates all of it
(DDP); ZeRO partitions the moments (stage 1), then also the gradients (stage 2), then also the weights (stage 3,
which FSDP2's ``fully_shard`` is, a module at a time) over the ranks (Rajbhandari et al. 2020):

    DDP: (w + g + o) Ψ      ZeRO-1: (w + g) Ψ + o Ψ / N      ZeRO-2: w Ψ + (g + o) Ψ / N      ZeRO-3: (w + g + o) Ψ / N

This is the state at a step's boundaries only: the peak adds activations, the parameters a sharded stage gathers
while a block runs and the collectives' buffers, which ``bp-mech plan --gpus N`` traces.
"""

from __future__ import annotations

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")  # what each shards: nothing, moments, + gradients, + weights


def model_state_per_gpu(params: int, gpus: int, stage: str, w: int = 4, g: int = 4, o: int = 8) -> float:
    """Bytes of weights, gradients and optimizer state one GPU holds between steps.

    Args:
        params: trainable parameters Ψ (>= 0).
        gpus: data-parallel ranks N (>= 1).
        stage: one of ``STAGES``.
        w, g, o: bytes per parameter of weights, gradients and optimizer state (float32 AdamW: 4, 4, 8).

    Returns:
        the bytes, a float (a shard of Ψ / N parameters need not be whole).

    Example:
        >>> [model_state_per_gpu(8, 4, s) for s in STAGES]
        [128.0, 80.0, 56.0, 32.0]
    """
    if gpus < 1 or params < 0:
        raise ValueError(f"need params >= 0 and gpus >= 1, got {params} and {gpus}")
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    sharded = STAGES.index(stage)  # how many of (o, g, w) are partitioned, in that order
    per_param = [o, g, w]
    return float(sum(b / gpus if i < sharded else b for i, b in enumerate(per_param)) * params)
