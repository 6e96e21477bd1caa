"""The NVRTC binding compiles CUDA C++ to PTX without a GPU."""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from device_comms import KernelCompileError
from device_comms.cuda.custom_allreduce import nvrtc as nvrtc_mod
from device_comms.errors import CommunicatorUnavailable, DeviceCommError

TEMPLATE_SOURCE = r"""
template <typename T, int N>
__global__ void gc_scale(T* x, T a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) x[i] = x[i] * a;
}
"""
NAMES = ("gc_scale<float, 4>", "gc_scale<double, 8>")


@pytest.mark.parametrize("arch", [80, "sm_90"], ids=["sm_80-int", "sm_90-str"])
def test_compiles_template_kernels(nvrtc: ModuleType, arch: int | str) -> None:
    out = nvrtc.compile_to_ptx(TEMPLATE_SOURCE, arch, NAMES, ["-std=c++17"], "scale.cu")
    cc = str(arch).removeprefix("sm_")
    assert re.search(rf"^\.target sm_{cc}\b", out.ptx, re.M), out.ptx[:400]
    assert set(out.lowered_names) == set(NAMES)
    for name, lowered in out.lowered_names.items():
        assert lowered.startswith("_Z") and "gc_scale" in lowered, (name, lowered)
        assert re.search(rf"\.entry\s+{re.escape(lowered)}\s*\(", out.ptx), lowered
    assert out.lowered_names[NAMES[0]] != out.lowered_names[NAMES[1]]


@pytest.mark.parametrize("arch", ["compute_80", "80", 90, "SM_90"], ids=str)
def test_arch_spellings(nvrtc: ModuleType, arch: int | str) -> None:
    out = nvrtc.compile_to_ptx(TEMPLATE_SOURCE, arch, NAMES[:1])
    cc = nvrtc.parse_arch(arch)
    assert f".target sm_{cc}" in out.ptx


def test_version_and_archs(nvrtc: ModuleType) -> None:
    major, minor = nvrtc.nvrtc_version()
    assert major >= 11 and minor >= 0
    archs = nvrtc.supported_archs()
    assert 80 in archs and 90 in archs and archs == sorted(archs)


def test_syntax_error_raises_with_log(nvrtc: ModuleType) -> None:
    with pytest.raises(KernelCompileError) as info:
        nvrtc.compile_to_ptx("__global__ void broken(int* x) { x[0] = ; }", 80, filename="bad.cu")
    e = info.value
    assert isinstance(e, DeviceCommError) and isinstance(e, RuntimeError)
    assert "error" in e.log and "bad.cu" in e.log
    assert e.log in str(e) and "compute_80" in str(e)


def test_unknown_name_expression_raises(nvrtc: ModuleType) -> None:
    with pytest.raises(KernelCompileError, match="no_such_kernel"):
        nvrtc.compile_to_ptx(TEMPLATE_SOURCE, 80, ["no_such_kernel<int>"])


def test_unsupported_arch_raises_value_error(nvrtc: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"arch must be one this NVRTC .* supports.*got 35"):
        nvrtc.compile_to_ptx(TEMPLATE_SOURCE, 35)


@pytest.mark.parametrize(
    "arch, exc",
    [
        ("sm_x", ValueError),
        ("", ValueError),
        ("sm_8", ValueError),
        ("gfx90a", ValueError),
        (-80, ValueError),
        (8.0, TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
    ids=["sm_x", "empty", "one-digit", "amd", "negative", "float", "bool", "none"],
)
def test_bad_arch(arch: object, exc: type[Exception]) -> None:
    """Malformed architectures are rejected before NVRTC is even loaded."""
    with pytest.raises(exc, match="arch"):
        nvrtc_mod.compile_to_ptx(TEMPLATE_SOURCE, arch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"source": b"x"}, TypeError, "source"),
        ({"name_expressions": "gc_scale<float, 4>"}, TypeError, "name_expressions"),
        ({"name_expressions": [""]}, ValueError, r"name_expressions\[0\]"),
        ({"options": [1]}, TypeError, r"options\[0\]"),
        ({"filename": None}, TypeError, "filename"),
    ],
    ids=["bytes-source", "str-names", "empty-name", "int-option", "none-filename"],
)
def test_bad_arguments(kwargs: dict, exc: type[Exception], match: str) -> None:
    args = {"source": TEMPLATE_SOURCE, "arch": 80, **kwargs}
    with pytest.raises(exc, match=match):
        nvrtc_mod.compile_to_ptx(**args)


def test_missing_library_names_every_place_tried(tmp_path) -> None:
    missing = str(tmp_path / "libnvrtc.so.99")
    not_a_lib = tmp_path / "libfake.so"
    not_a_lib.write_text("not an ELF file")
    with pytest.raises(CommunicatorUnavailable) as info:
        nvrtc_mod._open_first([missing, str(not_a_lib), "libnvrtc-not-there.so.0"])
    msg = str(info.value)
    for place in (missing, str(not_a_lib), "libnvrtc-not-there.so.0", nvrtc_mod.ENV_SO_PATH):
        assert place in msg


def test_candidates_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nvrtc_mod.ENV_SO_PATH, "/opt/custom/libnvrtc.so.13")
    cands = nvrtc_mod.candidate_paths()
    assert cands[0] == "/opt/custom/libnvrtc.so.13"
    assert cands[-3:] == ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    wheel = cands[1:-3]
    assert len(wheel) % 3 == 0  # three per root of the nvidia namespace package (if any)
    assert [p.split("/nvidia/")[-1] for p in wheel[:3]] == [
        "cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12", "cuda_nvrtc/lib/libnvrtc.so.13",
    ][: len(wheel)]
