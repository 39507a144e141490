"""The environment a record carries (numerics, SDPA kernel) and the preflight's checks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bp_mech.records import environment as env
from bp_mech.instruments.workload import parse_workload

TINY_ATTN = dict(batch=2, heads=4, kv_heads=2, seq=64, head_dim=16)  # tiny-b2s64's attention


# --- the SDPA kernel that ran ------------------------------------------------------------

@pytest.mark.parametrize("names, label", [
    (["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::detach"], "flash"),
    (["aten::_scaled_dot_product_flash_attention"], "flash"),
    (["aten::_scaled_dot_product_efficient_attention"], "efficient"),
    (["aten::_scaled_dot_product_cudnn_attention"], "cudnn"),
    (["aten::bmm", "aten::_safe_softmax", "aten::bmm"], "math"),
    (["aten::_scaled_dot_product_fused_attention_overrideable"],
     "aten::_scaled_dot_product_fused_attention_overrideable"),
    (["aten::empty"], "unknown"),
])
def test_sdpa_label_names_the_kernel_from_the_dispatched_ops(names, label):
    assert env.sdpa_label(names) == label


def test_sdpa_probe_reports_the_kernel_torch_ran_on_the_cpu():
    """Forcing a backend changes what the probe sees: it observes, it does not assume."""
    with sdpa_kernel(SDPBackend.MATH):
        assert env.sdpa_kernel("cpu", dtype="float32", **TINY_ATTN) == "math"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert env.sdpa_kernel("cpu", dtype=torch.float32, **TINY_ATTN) == "flash"
        assert env.sdpa_kernel("cpu", dtype="bfloat16", **TINY_ATTN) == "flash"


def test_sdpa_probe_is_cached_per_shape_and_backends(monkeypatch):
    env._sdpa_kernel.cache_clear()
    calls = []
    real = env._OpNames.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func.name())
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(env._OpNames, "__torch_dispatch__", counting)
    first = env.sdpa_kernel("cpu", dtype="float32", **TINY_ATTN)
    n = len(calls)
    assert n > 0 and env.sdpa_kernel("cpu", dtype="float32", **TINY_ATTN) == first and len(calls) == n
    env.sdpa_kernel("cpu", dtype="float32", **dict(TINY_ATTN, seq=32))  # another shape: probed again
    assert len(calls) > n


def test_attention_shape_comes_from_the_architecture():
    assert env.attention_shape(parse_workload("tiny-b2s64")) == TINY_ATTN
    assert env.attention_shape(parse_workload("qwen05-b2s512")) == dict(batch=2, heads=14, kv_heads=2, seq=512,
                                                                         head_dim=64)


# --- numerics -----------------------------------------------------------------------------

def test_cpu_numerics_hold_what_torch_reports(cpu_only):
    n = env.numerics("cpu", TINY_ATTN)
    assert n["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert n["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert n["mkldnn"] is torch.backends.mkldnn.is_available()
    assert n["sdpa_kernel"] == {dt: env.sdpa_kernel("cpu", dtype=dt, **TINY_ATTN) for dt in env.SDPA_DTYPES}
    assert "tf32_matmul" not in n and env.numerics("cpu")["sdpa_kernel"] is None  # no shape, no probe
    try:
        torch.set_float32_matmul_precision("medium")
        assert env.numerics("cpu")["float32_matmul_precision"] == "medium"
    finally:
        torch.set_float32_matmul_precision(n["float32_matmul_precision"])


def test_cuda_numerics_read_tf32_cudnn_and_the_probe(monkeypatch):
    """The CUDA branch on the CPU: the flags are torch's own, the probe is called per dtype."""
    probed = []
    monkeypatch.setattr(env, "sdpa_kernel", lambda device, dtype, **shape: probed.append((device, dtype, shape))
                        or ("flash" if dtype != "float32" else "efficient"))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not before
        n = env.numerics("cuda", TINY_ATTN)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert n["tf32_matmul"] is (not before) and n["tf32_cudnn"] is bool(torch.backends.cudnn.allow_tf32)
    assert n["cudnn"] == 90100 and "cpu_capability" not in n
    assert n["sdpa_kernel"] == {"float32": "efficient", "bfloat16": "flash", "float16": "flash"}
    assert probed == [("cuda", dt, TINY_ATTN) for dt in env.SDPA_DTYPES]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_failing_probe_is_recorded_not_raised():
    n = env.numerics("cuda", TINY_ATTN)
    assert all(v.startswith("probe failed: ") for v in n["sdpa_kernel"].values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probe_names_a_fused_kernel_for_bf16():
    shape = env.attention_shape(parse_workload("qwen05-b2s512"))
    assert env.sdpa_kernel("cuda", dtype="bfloat16", **shape) in ("flash", "efficient", "cudnn")
    with sdpa_kernel(SDPBackend.MATH):
        assert env.sdpa_kernel("cuda", dtype="bfloat16", **shape) == "math"


# --- preflight ----------------------------------------------------------------------------

def _pins(tmp_path: Path, torch_cpu=None, torch_cu=None, transformers=None, accelerate=None) -> Path:
    import importlib.metadata as md

    base = torch.__version__.split("+")[0]
    (tmp_path / "torch-cpu.txt").write_text(f"# comment\ntorch=={torch_cpu or base}\n")
    (tmp_path / "torch-cu128.txt").write_text(f"--extra-index-url https://x.invalid\ntorch=={torch_cu or base}+cu128\n")
    (tmp_path / "training-mechanism.txt").write_text(
        f"transformers=={transformers or md.version('transformers')}\n"
        f"accelerate=={accelerate or md.version('accelerate')}  # pinned\nnumpy>=1.26\n")
    return tmp_path


@pytest.fixture
def pip_ok(monkeypatch):
    ok = "No broken requirements found.\n"
    monkeypatch.setattr(env.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, ok, ""))


def _checks(report) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_pins_are_parsed_from_requirement_lines(tmp_path):
    _pins(tmp_path, torch_cu="2.11.0")
    assert env.pins("torch-cu128.txt", tmp_path) == {"torch": "2.11.0+cu128"}
    assert set(env.pins("training-mechanism.txt", tmp_path)) == {"transformers", "accelerate"}
    assert env.base_version("2.13.0+cpu") == "2.13.0" == env.base_version("2.13.0")


def test_the_repository_pins_are_found():
    assert env.pins("torch-cpu.txt")["torch"] and env.pins("torch-cu128.txt")["torch"] == "2.11.0+cu128"


def test_train_cpu_checks_versions_against_the_pins_and_nothing_constant(tmp_path, pip_ok):
    report = env.preflight("TRAIN-CPU", _pins(tmp_path))
    checks = _checks(report)
    assert list(checks) == ["python", "torch", "transformers", "accelerate", "pip check"]  # no CUDA on TRAIN-CPU
    assert report["status"] == "ok" and all(c["ok"] for c in checks.values())
    assert sys.executable in checks["python"]["detail"]
    assert report["info"] == [dict(name="bf16", detail=f"CPU bf16 autocast supported: {env.bf16_supported('cpu')}")]


@pytest.mark.parametrize("wrong", [dict(torch_cpu="1.0.0"), dict(transformers="0.0.1"), dict(accelerate="0.0.1")])
def test_a_version_off_its_pin_fails_its_check(tmp_path, pip_ok, wrong):
    report = env.preflight("TRAIN-CPU", _pins(tmp_path, **wrong))
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    assert report["status"] == "fail" and failed == [next(iter(wrong)).split("_")[0]]
    assert f"pins {next(iter(wrong.values()))}" in _checks(report)[failed[0]]["detail"]


def test_missing_requirements_fail_the_pinned_checks_and_say_so(tmp_path, pip_ok):
    report = env.preflight("TRAIN-CPU", tmp_path / "absent")
    checks = _checks(report)
    for name in ("torch", "transformers", "accelerate"):
        assert not checks[name]["ok"] and "without the repository" in checks[name]["detail"]


def test_python_check_fails_below_3_10(tmp_path, pip_ok, monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 9, 18))
    assert not _checks(env.preflight("TRAIN-CPU", _pins(tmp_path)))["python"]["ok"]


def test_pip_check_says_what_is_broken(tmp_path, monkeypatch):
    out = "foo 1.0 has requirement bar>=2, but you have bar 1.0.\nbaz 3 requires qux, which is not installed.\n"
    monkeypatch.setattr(env.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, out, ""))
    report = env.preflight("TRAIN-CPU", _pins(tmp_path))
    pip = _checks(report)["pip check"]
    assert report["status"] == "fail" and not pip["ok"]
    assert "bar>=2" in pip["detail"] and "qux" in pip["detail"]


def test_cuda_profile_needs_a_device_and_reports_bf16_as_information(tmp_path, pip_ok, monkeypatch):
    pins = _pins(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = env.preflight("TRAIN-CUDA-MECHANISM", pins)
    assert report["status"] == "fail" and not _checks(report)["cuda"]["ok"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    report = env.preflight("TRAIN-CUDA-MECHANISM", pins)
    checks = _checks(report)
    assert report["status"] == "ok" and checks["cuda"]["detail"] == "CUDA 12.8 on NVIDIA H200"
    assert "bf16" not in checks and report["info"][0]["detail"].startswith("CUDA bf16 supported: False")
    monkeypatch.setattr(torch.version, "cuda", None)  # a device but no CUDA version: not a CUDA build we know
    assert not _checks(env.preflight("TRAIN-CUDA-MECHANISM", pins))["cuda"]["ok"]


def test_real_preflight_runs_pip_check():
    report = env.preflight("TRAIN-CPU")
    pip = _checks(report)["pip check"]
    assert pip["detail"] and isinstance(pip["ok"], bool)
    assert report["status"] == ("ok" if all(c["ok"] for c in report["checks"]) else "fail")
