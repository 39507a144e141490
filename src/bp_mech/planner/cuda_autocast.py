"""CUDA's autocast policy on CPU tensors: what ``torch.autocast("cuda")`` casts, traced where no GPU is.

A fake-tensor step (``planner.lifecycle.Session(fake=True)``) runs on the CPU, and the CPU's autocast
casts other operators than CUDA's: it runs ``cross_entropy_loss``, ``cat`` and ``stack`` under its own
rules and leaves ``softmax``, ``pow``, ``rsqrt``, ``sum``, ``exp`` and the norms in the input's dtype,
which CUDA's runs in float32. ``torch.autocast("cuda")`` cannot be traced instead: on a CPU-only build it
switches itself off, and forced onto fake CUDA tensors it aborts the process.

``cuda_policy()`` puts CUDA's policy on the CPU's autocast key for as long as it is entered: a kernel
at ``AutocastCPU`` for every operator of CUDA's lists (``POLICY``, transcribed from PyTorch's
``ATen/autocast_mode.h``, which ``tests/planner/test_cuda_autocast.py`` parses), and a fallthrough for
every operator that only the CPU's policy lists. ``torch.autocast("cpu", dtype)`` then casts as CUDA's
would, at the same level of the dispatcher (above autograd, so the casts are in the graph and the
low-precision copies are what autograd saves), with everything around it unchanged: nested
``autocast(enabled=False)`` regions, checkpointing's recomputation under the forward's autocast state,
and the weight-cast cache (a float32 leaf that requires grad is cast to the low dtype once per
autocast region, the copy held until the outermost region exits, as ``cached_cast`` does). The
policies, as ``autocast_mode.h`` and the AMP documentation state them:

===================  ========================================================================
``lower``            floating inputs to the autocast dtype (matmul family, linear, SDPA, convs)
``fp32``             floating inputs to float32 (pow, rsqrt, exp, log, norms, the losses)
``fp32_set_opt_dtype``  a float32 ``dtype=`` argument unless one is given (softmax, log_softmax,
                     sum, prod, cumsum, vector norms); a first argument that is not a floating
                     tensor runs unchanged
``fp32_append_dtype``  ``norm`` redispatched to its ``dtype`` overload with float32
``promote``          all floating inputs to the widest among them (addcmul, index_put, ...)
``banned``           an error (binary_cross_entropy: unsafe to autocast)
===================  ========================================================================

Float64 tensors are never cast. Every other operator runs in its inputs' dtypes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves, tree_map

LOWER = ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
         "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
         "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
         "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
         "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
         "cudnn_convolution", "cudnn_convolution_transpose")  # (the last two: CUDA-only kernels, same policy)
FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
        "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                      "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                      "sum.dim_IntList")
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)
POLICY: dict[str, str] = {**dict.fromkeys(LOWER, "lower"), **dict.fromkeys(FP32, "fp32"),
                          **dict.fromkeys(FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                          **dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype"), **dict.fromkeys(PROMOTE, "promote"),
                          **dict.fromkeys(BANNED, "banned")}  # operator overload ("mm", "pow.Scalar") -> policy
_KEY = "AutocastCPU"  # the key whose switch ``torch.autocast("cpu")`` flips: the policy sits there
_CACHE: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its low-precision copy): the weight-cast cache
_DEPTH = [0]  # how many ``cuda_policy()`` are entered (the kernels are registered once)


def overload(name: str):
    """The ``torch.ops.aten`` overload of ``"mm"`` or ``"pow.Scalar"``."""
    op, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), ov or "default")


@functools.cache
def cpu_listed() -> frozenset[str]:
    """Operators with a kernel of the CPU's autocast policy (read before any override is registered)."""
    return frozenset(n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
                     if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, _KEY))


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(t, dtype: torch.dtype, low: torch.dtype):
    """``cached_cast``: an eligible tensor in ``dtype``; a float32 leaf weight's low-precision copy is cached."""
    if not _eligible(t) or t.dtype == dtype:
        return t
    if dtype == low and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view() \
            and torch.is_autocast_cache_enabled():
        hit = _CACHE.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        _CACHE[id(t)] = (weakref.ref(t), out)
        return out
    return t.to(dtype)


def _no_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _kernel(name: str, policy: str):
    op = overload(name)
    schema = op._schema

    def run(*args, **kwargs):
        low = torch.get_autocast_dtype("cpu")
        with _no_autocast():
            if policy == "banned":
                raise RuntimeError(f"torch.{name.split('.')[0]} is unsafe to autocast (CUDA's policy bans it)")
            if policy in ("lower", "fp32"):
                to = low if policy == "lower" else torch.float32
                args, kwargs = tree_map(lambda t: _cast(t, to, low), (args, kwargs))
            elif policy == "promote":
                wide = any(_eligible(t) and t.dtype == torch.float32 for t in tree_leaves((args, kwargs)))
                to = torch.float32 if wide else low
                args, kwargs = tree_map(lambda t: _cast(t, to, low), (args, kwargs))
            elif policy == "fp32_set_opt_dtype" and _eligible(args[0]):
                args, kwargs = _with_dtype(schema, args, kwargs)
            elif policy == "fp32_append_dtype":
                dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
                return overload(FP32_APPEND_DTYPE[name])(*_padded(schema, args, len(schema.arguments)), dtype=dtype)
            return op(*args, **kwargs)

    return run


def _with_dtype(schema, args: tuple, kwargs: dict):
    """``set_opt_dtype``: the call with its optional ``dtype`` argument float32 unless one is given."""
    i, arg = next((i, a) for i, a in enumerate(schema.arguments) if a.name == "dtype")
    if arg.kwarg_only or "dtype" in kwargs:
        return args, dict(kwargs, dtype=kwargs.get("dtype") or torch.float32)
    args = _padded(schema, args, i + 1)
    args[i] = args[i] if args[i] is not None else torch.float32
    return tuple(args), kwargs


def _padded(schema, args: tuple, n: int) -> list:
    """The first ``n`` positional arguments, those not given at their schema's defaults."""
    return list(args) + [a.default_value for a in schema.arguments[len(args):n]]


def _clear(original):
    def clear():
        _CACHE.clear()
        original()
    return clear


@contextlib.contextmanager
def cuda_policy():
    """CUDA's autocast policy for ``torch.autocast("cpu", dtype)`` while entered (reentrant).

    Returns:
        a context manager; inside it, CPU (and fake CPU) tensors under ``torch.autocast("cpu", low)`` are
        cast as CUDA tensors under ``torch.autocast("cuda", low)`` would be.

    Example:
        >>> x = torch.ones(2, 2)
        >>> with cuda_policy(), torch.autocast("cpu", dtype=torch.float16):
        ...     (x @ x).dtype, torch.softmax(x.half(), -1).dtype, torch.exp(x.half()).dtype
        (torch.float16, torch.float32, torch.float32)
        >>> with torch.autocast("cpu", dtype=torch.float16):  # the CPU's own policy again
        ...     torch.exp(x.half()).dtype
        torch.float16
    """
    if _DEPTH[0]:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    only_cpu = cpu_listed() - POLICY.keys()
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point here
            for name in sorted(only_cpu):
                lib.impl(name, torch.library.fallthrough_kernel, _KEY)
            for name, policy in POLICY.items():
                lib.impl(name, _kernel(name, policy), _KEY)
        _DEPTH[0] += 1
        with mock.patch.object(torch, "clear_autocast_cache", _clear(torch.clear_autocast_cache)):
            yield
    finally:
        _DEPTH[0] = max(0, _DEPTH[0] - 1)
        _CACHE.clear()
        lib._destroy()
