"""Profiles, environment fields of a record, and the preflight check.

Two profiles, as in the quickstart seed:

* ``TRAIN-CPU``: CPU PyTorch + Transformers + Accelerate; correctness and framework
  conformance, never GPU performance evidence.
* ``TRAIN-CUDA-MECHANISM``: one CUDA GPU, PyTorch 2.11 (cu128); the GPU suite.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

PROFILES = ("TRAIN-CPU", "TRAIN-CUDA-MECHANISM")


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


def environment_fields(profile: str, device: str = "cpu") -> dict:
    """The environment group of a result record."""
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
    )


@dataclass
class Check:
    name: str  # what was checked
    ok: bool  # passed?
    detail: str  # the observed value or the reason


def _pip_check() -> Check:
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("pip check", False, f"could not run: {e}")
    text = (r.stdout + r.stderr).strip().splitlines()
    return Check("pip check", r.returncode == 0, text[0] if text else "no output")


def preflight(profile: str) -> dict:
    """Run the profile's checks; ``status`` is ok only when every check passed."""
    check_profile(profile)
    checks = [
        Check("python", sys.version_info[:2] >= (3, 10), platform.python_version()),
        Check("torch", True, torch.__version__),
    ]
    for dist in ("transformers", "accelerate"):
        v = version(dist)
        checks.append(Check(dist, v is not None, v or "not installed"))
    if profile == "TRAIN-CUDA-MECHANISM":
        ok = torch.cuda.is_available()
        checks.append(Check("cuda", ok, f"{torch.version.cuda} on {torch.cuda.get_device_name(0)}" if ok
                            else f"torch {torch.__version__} reports no CUDA device"))
        checks.append(Check("bf16", True, f"supported={bf16_supported('cuda')}"))
    else:
        checks.append(Check("cuda", True, "not required (TRAIN-CPU forms no GPU evidence)"))
        checks.append(Check("bf16", True, f"cpu autocast supported={bf16_supported('cpu')}"))
    checks.append(_pip_check())
    return {
        "profile": profile,
        "status": "ok" if all(c.ok for c in checks) else "fail",
        "executable": sys.executable,
        "checks": [asdict(c) for c in checks],
    }
