"""Project 73's back-of-envelope: model-FLOPs utilisation (MFU) of the training baseline.

The model FLOPs of one trained token (the PaLM paper's count, Chowdhery et al. 2022, appendix B):
every weight of a matrix product does one multiply-add (2 FLOPs) forward and two backward (the
input's and the weight's gradient), 6 FLOPs per weight; attention's two products (Q K^T and the
weights times V) add 2 * 2 * s * d forward per layer and token, 12 * s * d with the backward:

    F = 6 N + 12 L d s

N: the weights of the model's matrix products (every ``nn.Linear``, the LM head included; the
embedding lookup does no arithmetic), L layers, d the attention width (heads x head dim), s the
sequence length (without halving for the causal mask). MFU is F times the useful tokens per second
over the machine's matrix-product throughput, measured here with ``matmul_peak``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from bp_mech.bench.timing import matmul_flops


@dataclass(frozen=True)
class TokenFlops:
    """The model FLOPs of one trained token, by term."""

    matmul_weights: int  # N: weights of the matrix products
    layers: int  # L
    attention_width: int  # d = heads x head dim
    seq: int  # s: tokens per sequence

    @property
    def weights(self) -> int:
        return 6 * self.matmul_weights  # 6 N

    @property
    def attention(self) -> int:
        return 12 * self.layers * self.attention_width * self.seq  # 12 L d s

    @property
    def total(self) -> int:
        return self.weights + self.attention


def token_flops(model: torch.nn.Module, seq: int) -> TokenFlops:
    """The model FLOPs per trained token of ``model`` at sequence length ``seq``, F = 6 N + 12 L d s.

    Args:
        model: a Transformers causal LM (its ``config`` gives layers, heads and head dim).
        seq: tokens per sequence.

    Returns:
        ``TokenFlops`` (``.total`` is F).

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> cfg = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16,
        ...                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> f = token_flops(Qwen2ForCausalLM(cfg), seq=4)
        >>> f.matmul_weights  # q 8x8, k and v 4x8, o 8x8, MLP 3 x 8x16, head 10x8
        656
        >>> f.total == 6 * 656 + 12 * 1 * 8 * 4
        True
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return TokenFlops(n, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim, seq)


def matmul_throughput(n: int = 1024, repeats: int = 7, threads: int = 1) -> float:
    """The float32 matrix-product throughput of this machine (FLOP/s): the fastest of ``repeats``
    products of two n x n matrices (2 n^3 FLOPs each) on ``threads`` intra-op threads.

    Args:
        n: the matrices' side.
        repeats: timed products (after one untimed warm-up).
        threads: torch's intra-op threads during the measurement.

    Returns:
        FLOPs per second of the fastest product.

    Example:
        >>> matmul_throughput(n=64, repeats=2) > 0
        True
    """
    return matmul_flops(n, repeats, threads)


SIZES = (64, 128, 256, 512, 1024)  # the square products that probe the machine: in cache to out


def matmul_peak(sizes=SIZES, repeats: int = 7, threads: int = 1) -> tuple[float, int]:
    """The machine's float32 matrix-product throughput: the fastest ``matmul_throughput`` over
    square products of the given sides (small ones stay in cache, large ones do not).

    Args:
        sizes: the matrices' sides to try.
        repeats: timed products per side.
        threads: torch's intra-op threads during the measurement.

    Returns:
        (FLOPs per second, the side it was reached at).

    Example:
        >>> rate, n = matmul_peak(sizes=(16, 32), repeats=2)
        >>> rate > 0 and n in (16, 32)
        True
    """
    return max((matmul_throughput(n, repeats, threads), n) for n in sizes)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``) and the
    logical cores the OS reports.

    Returns:
        e.g. ``"AMD EPYC 7B13, 2 logical cores"``.

    Example:
        >>> "logical cores" in cpu_name()
        True
    """
    name = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} logical cores"


def mfu(flops_per_token: float, tokens_per_s: float, processes: int,
        per_process_flops_s: float) -> float:
    """Model-FLOPs utilisation: the model FLOPs done per second over what ``processes`` processes,
    each at ``per_process_flops_s``, could do.

    Args:
        flops_per_token: F of one useful token.
        tokens_per_s: useful tokens per second, all processes together.
        processes: processes that shared the work.
        per_process_flops_s: one process's matrix-product throughput.

    Returns:
        The fraction (1.0 = every cycle a matrix product at the measured rate).

    Example:
        >>> mfu(6e6, 100.0, 2, 1e9)
        0.3
    """
    return flops_per_token * tokens_per_s / (processes * per_process_flops_s)
