"""Profiles, environment fields of a record, and the preflight check.

Two profiles, as in the quickstart seed:

* ``TRAIN-CPU``: CPU PyTorch + Transformers + Accelerate; correctness and framework
  conformance, never GPU performance evidence.
* ``TRAIN-CUDA-MECHANISM``: one CUDA GPU, PyTorch 2.11 (cu128); the GPU suite.

Each profile pins its versions in ``requirements/`` (``torch-cpu.txt`` or ``torch-cu128.txt``,
plus ``training-mechanism.txt`` for both); the preflight compares what is installed with those
pins. A record's ``numerics`` field holds the settings that decide its numbers beyond the
versions: float32 matmul precision, TF32 and cuDNN on CUDA, and the SDPA kernel that actually
runs for the workload's attention shape (probed with one call).
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from bp_mech import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

PROFILES = ("TRAIN-CPU", "TRAIN-CUDA-MECHANISM")
REQUIREMENTS = ROOT / "requirements"  # present in the source tree only
TORCH_PINS = {"TRAIN-CPU": "torch-cpu.txt", "TRAIN-CUDA-MECHANISM": "torch-cu128.txt"}  # profile -> its torch pin
FRAMEWORK_PINS = "training-mechanism.txt"  # transformers and accelerate, shared by both profiles
SDPA_DTYPES = ("float32", "bfloat16", "float16")  # the dtypes attention runs in: fp32 and the two autocast ones


class ProfileError(ValueError):
    pass


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ProfileError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    return profile


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bf16_supported(device: str) -> bool:
    """BF16 only where both the device and PyTorch report support."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return hasattr(torch, "bfloat16") and torch.amp.autocast_mode.is_autocast_available("cpu")


# --- what decides the numbers ---------------------------------------------------------

def sdpa_label(op_names) -> str:
    """The SDPA kernel named by the aten ops one call dispatched to: flash, efficient or cudnn
    (their fused ``aten::_scaled_dot_product_*`` op; the CPU's fused kernel,
    ``_scaled_dot_product_flash_attention_for_cpu``, is flash), math (no fused op: the
    composite path's matmuls and softmax), an unknown fused op by name, else "unknown"."""
    names = set(op_names)
    fused = sorted(n for n in names if n.startswith("aten::_scaled_dot_product_"))
    for op in fused:
        for label in ("flash", "efficient", "cudnn", "math"):
            if label in op:
                return label
    if fused:
        return fused[0]
    return "math" if any("softmax" in n for n in names) else "unknown"


class _OpNames(TorchDispatchMode):
    """Collects the name of every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _sdpa_backends() -> tuple:
    """The SDPA backends torch may choose from now (``torch.nn.attention.sdpa_kernel`` changes them)."""
    c = torch.backends.cuda
    return tuple(f() for f in (c.flash_sdp_enabled, c.mem_efficient_sdp_enabled, c.cudnn_sdp_enabled,
                               c.math_sdp_enabled))


def sdpa_kernel(device, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype,
                causal: bool = True) -> str:
    """The SDPA kernel one ``scaled_dot_product_attention`` call runs with this shape, read from
    the aten op it dispatched to (seen by a ``TorchDispatchMode``, below the point where torch
    picks the kernel; ``torch.profiler`` would see the same op but writes to the process's
    stderr on start, which the strict book build refuses).

    The call is the one transformers' ``sdpa_attention_forward`` makes for an unpadded causal
    training batch: no mask, ``is_causal``, ``enable_gqa`` where ``kv_heads < heads``, inputs
    that require grad. Cached per shape, dtype and enabled backends.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return _sdpa_kernel(str(torch.device(device)), batch, heads, kv_heads, seq, head_dim, dtype, causal,
                        _sdpa_backends())


@lru_cache(maxsize=64)
def _sdpa_kernel(device, batch, heads, kv_heads, seq, head_dim, dtype, causal, _backends) -> str:
    def x(h):
        return torch.randn(batch, h, seq, head_dim, device=device, dtype=dtype, requires_grad=True)

    q, k, v = x(heads), x(kv_heads), x(kv_heads)
    with torch.enable_grad(), _OpNames() as seen:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    return sdpa_label(seen.names)  # "aten::_scaled_dot_product_flash_attention_for_cpu", ...


def attention_shape(workload) -> dict:
    """The attention shape of a workload's model: batch, heads, kv_heads, seq, head_dim."""
    from bp_mech.instruments.workload import ARCHITECTURES

    a = ARCHITECTURES[workload.arch]
    return dict(batch=workload.batch, heads=a["num_attention_heads"], kv_heads=a["num_key_value_heads"],
                seq=workload.seq, head_dim=a["hidden_size"] // a["num_attention_heads"])


def numerics(device: str = "cpu", attention: dict | None = None) -> dict:
    """The settings that decide a record's numbers on ``device``.

    Both: ``float32_matmul_precision`` and ``sdpa_kernel`` (per dtype in SDPA_DTYPES, for the
    ``attention`` shape; None without one; a dtype whose probe fails holds the error).
    CUDA: ``tf32_matmul``, ``tf32_cudnn``, ``cudnn`` (version). CPU: ``cpu_capability`` (the
    vector ISA torch's kernels use, which fixes float32 reduction order) and ``mkldnn``.
    """
    out = dict(float32_matmul_precision=torch.get_float32_matmul_precision())
    if torch.device(device).type == "cuda":
        out.update(tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
                   tf32_cudnn=bool(torch.backends.cudnn.allow_tf32), cudnn=torch.backends.cudnn.version())
    else:
        out.update(cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   mkldnn=bool(torch.backends.mkldnn.is_available()))
    kernels = None
    if attention is not None:
        kernels = {}
        for dt in SDPA_DTYPES:
            try:
                kernels[dt] = sdpa_kernel(device, dtype=dt, **attention)
            except Exception as e:  # noqa: BLE001 - a dtype the device lacks is recorded, not fatal
                kernels[dt] = f"probe failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    out["sdpa_kernel"] = kernels
    return out


def environment_fields(profile: str, device: str = "cpu", attention: dict | None = None) -> dict:
    """The environment group of a result record; ``attention`` (see ``attention_shape``) adds
    the SDPA probe to ``numerics``."""
    on_gpu = torch.device(device).type == "cuda"
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    return dict(
        profile_id=profile,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=version("transformers"),
        cuda=torch.version.cuda if on_gpu else None,
        device_name=props.name if on_gpu else f"cpu ({platform.machine()})",
        device_memory=int(props.total_memory) if on_gpu else None,
        numerics=numerics(device, attention),
    )


# --- preflight --------------------------------------------------------------------------

@dataclass
class Check:
    name: str  # what was checked
    ok: bool  # passed?
    detail: str  # the observed value or the reason


def pins(filename: str, root: Path = REQUIREMENTS) -> dict[str, str]:
    """``name==version`` lines of a requirements file (options, comments and ranges skipped).
    Raises FileNotFoundError where the file is absent (a package installed without the repo)."""
    out = {}
    for line in (root / filename).read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if m:
            out[m[1].lower()] = m[2]
    return out


def base_version(v: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0`` (the local build tag dropped)."""
    return v.split("+", 1)[0]


def _pin_check(dist: str, filename: str, installed: str | None, root: Path, base: bool = False) -> Check:
    try:
        pinned = pins(filename, root).get(dist)
    except OSError as e:
        return Check(dist, False, f"installed {installed}; cannot read the pin ({root / filename}: "
                                  f"{type(e).__name__}; an installed package without the repository?)")
    if pinned is None:
        return Check(dist, False, f"installed {installed}; {filename} pins no {dist}==")
    if installed is None:
        return Check(dist, False, f"not installed; {filename} pins {pinned}")
    want, have = (base_version(pinned), base_version(installed)) if base else (pinned, installed)
    return Check(dist, have == want, f"installed {installed}; {filename} pins {pinned}")


def _pip_check() -> Check:
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("pip check", False, f"could not run: {e}")
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return Check("pip check", r.returncode == 0, "; ".join(lines) if lines else f"exit {r.returncode}, no output")


def _cuda_check() -> Check:
    if not torch.cuda.is_available():
        return Check("cuda", False, f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
    if torch.version.cuda is None:
        return Check("cuda", False, "a device is visible but torch reports no CUDA version")
    return Check("cuda", True, f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name(0)}")


def preflight(profile: str, requirements: Path = REQUIREMENTS) -> dict:
    """Run the profile's checks; ``status`` is ok only when every check passed.

    Checks: the interpreter (path, version >= 3.10); torch equal to the profile's pin (base
    version: ``2.13.0+cpu`` meets ``torch==2.13.0``); transformers and accelerate equal to
    ``training-mechanism.txt``; on TRAIN-CUDA-MECHANISM a CUDA device and torch's CUDA version;
    ``pip check`` on TRAIN-CPU (on the GPU machine, whose Python is not ours, it is info). ``info`` reports what changes the candidates but fails nothing (bf16 support).
    """
    check_profile(profile)
    checks = [
        Check("python", sys.version_info[:2] >= (3, 10), f"{platform.python_version()} at {sys.executable}"),
        _pin_check("torch", TORCH_PINS[profile], torch.__version__, requirements, base=True),
    ]
    for dist in ("transformers", "accelerate"):
        checks.append(_pin_check(dist, FRAMEWORK_PINS, version(dist), requirements))
    if profile == "TRAIN-CUDA-MECHANISM":
        checks.append(_cuda_check())
        bf16 = bf16_supported("cuda")
        skipped = "" if bf16 else " (the bf16 candidates are not run)"
        info = [dict(name="bf16", detail=f"CUDA bf16 supported: {bf16}{skipped}")]
    else:
        info = [dict(name="bf16", detail=f"CPU bf16 autocast supported: {bf16_supported('cpu')}")]
    pip = _pip_check()
    if profile == "TRAIN-CPU":
        checks.append(pip)  # our own venv: a broken dependency is ours to fix
    else:  # the GPU machine's Python is not ours: report what pip says, stop on nothing it cannot fix
        info.append(dict(name="pip check", detail=f"{'ok' if pip.ok else 'broken'}: {pip.detail}"))
    return {
        "profile": profile,
        "status": "ok" if all(c.ok for c in checks) else "fail",
        "executable": sys.executable,
        "checks": [asdict(c) for c in checks],
        "info": info,
    }
