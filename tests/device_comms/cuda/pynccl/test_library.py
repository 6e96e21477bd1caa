"""The NCCL binding: discovery, loading, the signature table against nccl.h, errors.

None of this needs a GPU: ``ncclGetVersion``, ``ncclGetUniqueId`` and
``ncclGetErrorString`` work on any machine with the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

from device_comms.cuda.pynccl import library as L
from device_comms.errors import CommunicatorUnavailable, DeviceCommError, NcclError
from tests.device_comms.cuda.pynccl import _nccl_header as header


# ---------------------------------------------------------------------- discovery
def test_library_is_found_and_loaded(nccl_lib) -> None:
    path = L.find_library()
    assert os.path.exists(path) or path == L.SONAME
    assert nccl_lib.path == path
    assert L.load_library() is nccl_lib, "one NcclLibrary per path"
    assert L.NcclLibrary(path) is nccl_lib
    assert path in L._LOADED.paths() or os.path.realpath(path) in L._LOADED.paths()
    assert isinstance(nccl_lib._lib, ctypes.CDLL)


def test_wheel_is_found_through_the_nvidia_namespace(nccl_lib, monkeypatch) -> None:
    monkeypatch.delenv(L.ENV_SO_PATH, raising=False)
    cands = L.default_candidates()
    assert cands[0].target is None and cands[0].why_not == "not set"
    wheel = [c for c in cands if c.target and c.target.endswith("nvidia/nccl/lib/libnccl.so.2")]
    assert wheel, [c.where for c in cands]
    assert L.find_library() == wheel[0].target
    assert cands[-1].target == L.SONAME  # the loader's search path comes last


def test_env_path_comes_first(nccl_lib, monkeypatch) -> None:
    monkeypatch.setenv(L.ENV_SO_PATH, nccl_lib.path)
    assert L.default_candidates()[0].target == nccl_lib.path
    assert L.find_library() == nccl_lib.path


def test_failure_names_every_place(tmp_path) -> None:
    missing = str(tmp_path / "nope" / "libnccl.so.2")
    not_nccl = tmp_path / "fake.so"
    not_nccl.write_bytes(b"not an ELF file")
    cands = L.default_candidates(
        environ={L.ENV_SO_PATH: missing},
        nvidia_dirs=[str(tmp_path / "site-a" / "nvidia"), str(tmp_path / "site-b" / "nvidia")],
        soname="libnccl-groupcoord-test-missing.so.2",
    ) + [L.Candidate("a file that is not a library", str(not_nccl))]
    with pytest.raises(CommunicatorUnavailable) as info:
        L.find_library(cands)
    msg = str(info.value)
    for needle in (
        f"${L.ENV_SO_PATH}={missing}: no such file",
        str(tmp_path / "site-a" / "nvidia" / "nccl" / "lib" / "libnccl.so.2") + ": no such file",
        str(tmp_path / "site-b" / "nvidia" / "nccl" / "lib" / "libnccl.so.2") + ": no such file",
        "dynamic loader search path (libnccl-groupcoord-test-missing.so.2): cannot be loaded",
        "a file that is not a library: cannot be loaded",
        "nvidia-nccl-cu13",
    ):
        assert needle in msg, f"{needle!r} missing from:\n{msg}"
    assert msg.count("\n  - ") == 5


def test_failure_without_namespace_or_env(monkeypatch) -> None:
    cands = L.default_candidates(environ={}, nvidia_dirs=[],
                                 soname="libnccl-groupcoord-test-missing.so.2")
    with pytest.raises(CommunicatorUnavailable) as info:
        L.find_library(cands)
    msg = str(info.value)
    assert f"${L.ENV_SO_PATH}: not set" in msg
    assert "no 'nvidia' namespace package on sys.path" in msg


def test_library_without_nccl_symbols_is_rejected() -> None:
    libc = ctypes.util.find_library("c")
    with pytest.raises(CommunicatorUnavailable, match="does not export ncclGetVersion"):
        L.find_library([L.Candidate("libc", libc)])


def test_bad_env_path_falls_through_with_a_warning(nccl_lib, monkeypatch, caplog) -> None:
    monkeypatch.setenv(L.ENV_SO_PATH, "/does/not/exist/libnccl.so.2")
    with caplog.at_level("WARNING", logger=L.__name__):
        found = L.find_library()
    assert found != "/does/not/exist/libnccl.so.2"
    ignored = "ignoring $GROUPCOORD_NCCL_SO_PATH=/does/not/exist/libnccl.so.2: no such file"
    assert ignored in caplog.text


# ---------------------------------------------------------------------- calls without a GPU
def test_version(nccl_lib, nccl_header) -> None:
    code = nccl_lib.version()
    assert code == L.version() == header.define(nccl_header, "NCCL_VERSION_CODE")
    major, minor, patch = (header.define(nccl_header, f"NCCL_{k}")
                           for k in ("MAJOR", "MINOR", "PATCH"))
    assert nccl_lib.version_string() == L.version_string() == f"{major}.{minor}.{patch}"
    wheels = [w for w in L.WHEELS if _installed(w)]
    if wheels:
        assert importlib.metadata.version(wheels[0]).startswith(nccl_lib.version_string())


def _installed(dist_name: str) -> bool:
    try:
        importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("code, text", [(23203, "2.32.3"), (22400, "2.24.0"), (21003, "2.10.3"),
                                        (2708, "2.7.8"), (2406, "2.4.6")])
def test_format_version(code: int, text: str) -> None:
    assert L.format_version(code) == text


def test_unique_id(nccl_lib) -> None:
    a, b = nccl_lib.unique_id(), L.unique_id()
    assert isinstance(a, bytes) and len(a) == len(b) == L.UNIQUE_ID_BYTES == 128
    assert a != b, "every call names a new bootstrap root"
    assert a != bytes(128)
    assert ctypes.sizeof(L.NcclUniqueId) == 128


# ---------------------------------------------------------------------- signatures vs nccl.h
@pytest.mark.parametrize("name", sorted(L.SIGNATURES))
def test_signature_matches_header(name: str, nccl_header, nccl_lib) -> None:
    protos = header.prototypes(nccl_header)
    assert name in protos, f"{name} is not declared in nccl.h"
    want_res, want_args = protos[name]
    got_res, got_args = L.SIGNATURES[name]
    assert got_res is want_res, f"{name} restype: table {got_res}, nccl.h {want_res}"
    assert len(got_args) == len(want_args), (
        f"{name}: {len(got_args)} args, nccl.h has {len(want_args)}")
    for i, (g, w) in enumerate(zip(got_args, want_args, strict=True)):
        assert g is w, f"{name} argument {i}: table {g}, nccl.h {w}"
    fn = nccl_lib._fns[name]
    assert fn.restype is got_res and tuple(fn.argtypes) == got_args


def test_header_parser_reads_what_it_should(nccl_header) -> None:
    protos = header.prototypes(nccl_header)
    assert len(protos) > 30 and "ncclAllReduce" in protos and "pncclAllReduce" not in protos
    enums = header.enums(nccl_header)
    assert enums["ncclResult_t"]["ncclSuccess"] == L.NCCL_SUCCESS
    assert enums["ncclResult_t"]["ncclInProgress"] == L.NCCL_IN_PROGRESS
    assert header.define(nccl_header, "NCCL_UNIQUE_ID_BYTES") == L.UNIQUE_ID_BYTES


# ---------------------------------------------------------------------- errors
def test_nccl_error_carries_nccls_message(nccl_lib, nccl_header) -> None:
    results = header.enums(nccl_header)["ncclResult_t"]
    code = results["ncclInvalidArgument"]
    with pytest.raises(NcclError) as info:
        nccl_lib.check("ncclCommInitRank", code)
    e = info.value
    assert isinstance(e, DeviceCommError) and isinstance(e, RuntimeError)
    assert (e.call, e.code) == ("ncclCommInitRank", code)
    assert nccl_lib.error_string(code) in str(e) and "invalid argument" in str(e)
    assert "ncclCommInitRank" in str(e) and str(code) in str(e)
    nccl_lib.check("ncclAllReduce", L.NCCL_SUCCESS)  # success raises nothing


def test_real_failing_calls_raise_nccl_error(nccl_lib) -> None:
    with pytest.raises(NcclError) as info:
        nccl_lib.comm_get_async_error(None)  # NULL communicator
    assert info.value.call == "ncclCommGetAsyncError" and info.value.code != 0
    assert nccl_lib.error_string(info.value.code) in str(info.value)
    # what went wrong, not only the class of error (ncclGetLastError)
    assert "NCCL's last message:" in str(info.value) and "NULL" in str(info.value), info.value
    # Rank 5 of a 1-rank communicator: invalid without a GPU, and with one.
    with pytest.raises(NcclError) as info:
        nccl_lib.comm_init_rank(1, nccl_lib.unique_id(), 5)
    assert info.value.call == "ncclCommInitRank" and info.value.code != 0
    assert nccl_lib.error_string(info.value.code) in str(info.value)
    assert "NCCL's last message:" in str(info.value), info.value
    assert "NULL" not in str(info.value), f"the previous failure's message: {info.value}"


def test_nccl_error_pickles() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(NcclError("ncclSend", 6, "remote process exited")))
    assert (e.call, e.code, e.detail) == ("ncclSend", 6, "remote process exited")
    assert str(e) == "ncclSend failed with NCCL error 6: remote process exited"


def test_comm_init_rank_checks_the_id(nccl_lib) -> None:
    with pytest.raises(ValueError, match="unique_id must be 128 bytes long, got 5"):
        nccl_lib.comm_init_rank(1, b"short", 0)
    with pytest.raises(TypeError, match="unique_id must be bytes, got str"):
        nccl_lib.comm_init_rank(1, "x" * 128, 0)
    with pytest.raises(TypeError, match="path must be a non-empty str"):
        L.NcclLibrary("")


# ---------------------------------------------------------------------- import-light
# A CUDA build of torch links NCCL itself, so the probe compares the NCCL
# mappings after our import with those after a plain ``import torch``.
_PROBE = textwrap.dedent(
    """
    import json, sys
    def nccl_maps():
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "libnccl" in ln})
    import torch
    baseline = nccl_maps()
    cuda_before = torch.cuda.is_initialized()
    import device_comms
    from device_comms import CudaCommunicator, list_device_communicators
    from device_comms.cuda.pynccl import library
    out = {"after_import": nccl_maps() != baseline, "loaded": library._LOADED.paths()}
    out["cuda_initialized"] = torch.cuda.is_initialized() and not cuda_before
    out["available"] = CudaCommunicator.is_available()
    out["listed"] = list_device_communicators()["cuda"]["available"]
    out["after_probe"] = nccl_maps() != baseline
    out["has_gpu"] = torch.cuda.is_available()
    print(json.dumps(out))
    """
)


def test_import_loads_no_nccl() -> None:
    env = dict(os.environ)
    env.pop(L.ENV_SO_PATH, None)
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, env=env, cwd=os.getcwd())
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["after_import"] is False and out["loaded"] == [], out
    assert out["cuda_initialized"] is False
    if not out["has_gpu"]:  # without a GPU the probe does not even open NCCL
        assert out["available"] is False and out["listed"] is False
        assert out["after_probe"] is False, out
