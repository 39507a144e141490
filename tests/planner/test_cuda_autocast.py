"""``planner.cuda_autocast``: CUDA's autocast policy on CPU tensors. Its op lists are PyTorch's own (the
header the installed torch ships, and the kernels this build registers for CUDA's autocast key); each
policy gives the output dtypes the AMP documentation states; where the CPU's and CUDA's lists agree its
ledger equals real CPU autocast's, where they differ it differs by the bytes the lists predict; the
weight-cast cache, nested ``autocast(enabled=False)`` and checkpointing's recomputation behave as under
``torch.autocast``; and the CPU's own policy is back afterwards."""

import contextlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bp_mech.planner import cuda_autocast as C
from bp_mech.instruments.tracking import StorageTracker

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
LISTS = {"AT_FORALL_LOWER_PRECISION_FP": "lower", "AT_FORALL_FP32": "fp32",
         "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype", "AT_FORALL_PROMOTE": "promote"}
H, S = torch.float16, torch.float32


def _header_lists() -> dict[str, str]:
    """op overload -> policy, parsed from the macros of ``ATen/autocast_mode.h``."""
    text, out = HEADER.read_text(), {}
    for macro, policy in LISTS.items():
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            out[f"{name}.{overload}" if overload else name] = policy
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S).group(1)
    out.update(dict.fromkeys(re.findall(r'"(norm\.\w+)"', body), "fp32_append_dtype"))
    return out


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships no C++ headers")
def test_the_lists_are_the_headers():
    header = _header_lists()
    extra = {k: v for k, v in C.POLICY.items() if k not in header}
    assert {k: v for k, v in C.POLICY.items() if k in header} == header
    assert extra == {"cudnn_convolution": "lower", "cudnn_convolution_transpose": "lower",
                     "binary_cross_entropy": "banned"}  # registered in autocast_mode.cpp, outside the macros


def test_the_ops_are_those_cuda_autocast_registers():
    registered = {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
                  if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    assert set(C.POLICY) == registered


x32, x16 = torch.randn(4, 4), torch.randn(4, 4).half()


@pytest.mark.parametrize("op,expected", [
    (lambda: x32 @ x32, H), (lambda: F.linear(x32, x32), H), (lambda: torch.bmm(x32[None], x32[None]), H),
    (lambda: torch.addmm(x32, x32, x32), H), (lambda: torch.einsum("ij,jk->ik", x32, x32), H),
    (lambda: F.scaled_dot_product_attention(x32[None], x32[None], x32[None]), H),
    (lambda: x32.double() @ x32.double(), torch.float64),  # float64 is never cast
    (lambda: torch.exp(x16), S), (lambda: torch.rsqrt(x16.abs() + 1), S), (lambda: x16.pow(2), S),
    (lambda: F.layer_norm(x16, (4,)), S), (lambda: F.mse_loss(x16, x16), S),
    (lambda: F.nll_loss(x16, torch.tensor([0, 1, 2, 3])), S),
    (lambda: torch.softmax(x16, -1), S), (lambda: torch.log_softmax(x16, -1), S), (lambda: x16.sum(), S),
    (lambda: x16.sum(0), S), (lambda: torch.cumsum(x16, 0), S), (lambda: torch.linalg.vector_norm(x16), S),
    (lambda: torch.softmax(x16, -1, dtype=H), H),  # a dtype given is kept
    (lambda: torch.arange(4).sum(), torch.int64),  # a first argument that is not floating: unchanged
    (lambda: torch.norm(x16), S), (lambda: torch.norm(x16, dim=0), S),
    (lambda: torch.addcmul(x32, x16, x16), S), (lambda: torch.addcmul(x16, x16, x16), H),  # promote
    (lambda: x16 + x16, H), (lambda: torch.cat([x32, x16]), S), (lambda: F.relu(x16), H),  # unlisted
    (lambda: F.cross_entropy(x16, torch.tensor([0, 1, 2, 3])), S),  # decomposes into log_softmax + nll_loss
])
def test_output_dtypes_follow_cuda_s_lists(op, expected):
    with C.cuda_policy(), torch.autocast("cpu", dtype=H):
        assert op().dtype == expected


def test_bfloat16_is_the_low_dtype_when_asked_and_banned_ops_raise():
    with C.cuda_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x32 @ x32).dtype == torch.bfloat16 and torch.softmax(x32.bfloat16(), -1).dtype == S
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(4), torch.rand(4))


def test_the_cpu_policy_is_back_afterwards():
    with C.cuda_policy(), torch.autocast("cpu", dtype=H):
        assert torch.exp(x16).dtype == S
    with torch.autocast("cpu", dtype=H):
        assert torch.exp(x16).dtype == H and torch.softmax(x16, -1).dtype == H  # unlisted on the CPU
        assert torch.stack([x32, x16]).dtype == S  # the CPU's own promote kernel
    assert "autocast_mode.cpp" in torch._C._dispatch_dump("aten::mm").split("AutocastCPU:")[1].split("\n")[0]
    assert C._DEPTH == [0] and not C._CACHE


def test_weight_casts_are_cached_once_per_region_and_nested_disables_hold():
    w = torch.nn.Parameter(torch.randn(4, 4))
    copies = []
    with C.cuda_policy():
        with torch.autocast("cpu", dtype=H):
            a, b = F.linear(x32, w), F.linear(x32, w)
            c = F.linear(x32, w * 1)  # not a leaf: cast every time
            copies.append(len(C._CACHE))
            with torch.autocast("cpu", enabled=False):
                assert (x32 @ x32).dtype == S
            assert (x32 @ x32).dtype == H
        copies.append(len(C._CACHE))  # the outermost region's exit drops the cache
    assert copies == [1, 0] and a.dtype == b.dtype == c.dtype == H


def _tracked(fn, policy: bool) -> tuple[int, int, int]:
    """(bytes alive after the forward, peak, bytes alive after the backward) of ``fn`` under fp16 autocast,
    CUDA's policy (``policy``) or the CPU's."""
    torch.manual_seed(0)
    w1, w2 = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32, 64))
    x = torch.randn(16, 32)
    tr = StorageTracker("cpu")
    for t in (w1, w2, x):
        tr.add(t)
    with C.cuda_policy() if policy else contextlib.nullcontext(), tr:
        with torch.autocast("cpu", dtype=H):
            loss = fn(x, w1, w2)
        forward = tr.current
        loss.backward()
        del loss
    return forward, tr.peak, tr.current


def _mlp(x, w1, w2):  # linear, relu, linear, mse: the CPU's and CUDA's lists treat each alike
    return F.mse_loss(F.linear(F.relu(F.linear(x, w1)), w2), x)


def _softmax(x, w1, w2):  # softmax: float32 under CUDA's list, the input's float16 under the CPU's
    return F.linear(torch.softmax(F.linear(x, w1), -1), w2).float().square().mean()


def test_ledger_equals_real_cpu_autocast_where_the_lists_agree():
    assert _tracked(_mlp, policy=True) == _tracked(_mlp, policy=False)


def test_ledger_differs_by_what_the_lists_predict_where_they_differ():
    """CUDA's softmax returns float32: its (16, 64) output, which softmax saves, is 2 bytes an element wider,
    and the next linear casts it back to float16 and saves that (16, 64) copy: 16 * 64 * (2 + 2) more bytes
    alive after the forward; none after the backward."""
    cuda, cpu = _tracked(_softmax, policy=True), _tracked(_softmax, policy=False)
    assert cuda[0] - cpu[0] == 16 * 64 * (2 + 2) and cuda[2] == cpu[2]


def test_checkpointing_recomputes_under_the_forward_s_policy():
    seen = []

    def block(x):
        y = torch.softmax(x @ x, -1)
        seen.append(y.dtype)
        return y.sin()  # (sin saves y: its backward needs the recomputation)

    x = torch.randn(4, 4, requires_grad=True)
    with C.cuda_policy():
        with torch.autocast("cpu", dtype=H):
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        out.float().sum().backward()  # the recomputation re-enters the forward's autocast state
    assert seen == [S, S] and x.grad is not None
