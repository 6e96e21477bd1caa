"""A small ctypes binding of NVRTC: compile CUDA C++ to PTX without a GPU.

NVRTC is a host-only library, so this works on machines with no GPU and no
driver; CI uses it to check that the kernels compile for every target
architecture. The library is looked up, in order, at:

1. the path in the environment variable ``GROUPCOORD_NVRTC_SO_PATH``;
2. the pip wheels, inside the ``nvidia`` namespace package:
   ``cu13/lib/libnvrtc.so.13``, ``cuda_nvrtc/lib/libnvrtc.so.12`` and
   ``cuda_nvrtc/lib/libnvrtc.so.13``;
3. ``libnvrtc.so.13``, ``libnvrtc.so.12`` and ``libnvrtc.so`` on the
   dynamic loader's search path.

Nothing is loaded at import time; the first call loads the library once per
process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
import re
from collections.abc import Sequence
from typing import Any

from device_comms.errors import CommunicatorUnavailable, KernelCompileError

__all__ = [
    "ENV_SO_PATH",
    "CompiledPtx",
    "compile_to_ptx",
    "library_path",
    "nvrtc_version",
    "parse_arch",
    "supported_archs",
]

ENV_SO_PATH = "GROUPCOORD_NVRTC_SO_PATH"
_WHEEL_LIBS = ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12",
               "cuda_nvrtc/lib/libnvrtc.so.13")
_LOADER_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
_ARCH_RE = re.compile(r"^(?:sm_|compute_)?([1-9][0-9]{1,2})([af]?)$")
_SUCCESS = 0


@dataclasses.dataclass(frozen=True)
class CompiledPtx:
    """The result of :func:`compile_to_ptx`.

    Attributes:
        ptx: The PTX text.
        lowered_names: Each name expression mapped to its mangled (lowered) name,
            the name of the ``.entry`` in ``ptx``.
        log: NVRTC's log (warnings); often empty.
    """

    ptx: str
    lowered_names: dict[str, str]
    log: str


# ---------------------------------------------------------------------- loading
def _wheel_candidates() -> list[str]:
    """Paths of libnvrtc inside the ``nvidia`` pip wheels (nothing is imported)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(root, rel) for root in roots for rel in _WHEEL_LIBS]


def candidate_paths() -> list[str]:
    """Every place the library is looked for, in the order tried."""
    env = os.environ.get(ENV_SO_PATH, "").strip()
    return ([env] if env else []) + _wheel_candidates() + list(_LOADER_NAMES)


def _open_first(candidates: Sequence[str]) -> tuple[ctypes.CDLL, str]:
    """Load the first candidate that opens and exports NVRTC's API.

    Raises:
        CommunicatorUnavailable: None did, naming every candidate and why.
    """
    tried = []
    for path in candidates:
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (no such file)")
            continue
        try:
            lib = ctypes.CDLL(path)
            _ = lib.nvrtcVersion  # a library without the symbol raises AttributeError
        except (OSError, AttributeError) as e:
            tried.append(f"{path} ({e})")
            continue
        return lib, path
    raise CommunicatorUnavailable(
        "NVRTC (libnvrtc) could not be loaded; tried: " + "; ".join(tried)
        + f". Install the 'nvidia-cuda-nvrtc' wheel or set {ENV_SO_PATH} to its path."
    )


def _declare(lib: ctypes.CDLL) -> None:
    """Set the prototypes of the NVRTC functions used here."""
    p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pp, cp = ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p
    cpp = ctypes.POINTER(ctypes.c_char_p)
    protos: dict[str, list[Any]] = {
        "nvrtcVersion": [ctypes.POINTER(i), ctypes.POINTER(i)],
        "nvrtcGetNumSupportedArchs": [ctypes.POINTER(i)],
        "nvrtcGetSupportedArchs": [ctypes.POINTER(i)],
        "nvrtcCreateProgram": [pp, cp, cp, i, cpp, cpp],
        "nvrtcDestroyProgram": [pp],
        "nvrtcAddNameExpression": [p, cp],
        "nvrtcCompileProgram": [p, i, cpp],
        "nvrtcGetProgramLogSize": [p, ctypes.POINTER(s)],
        "nvrtcGetProgramLog": [p, ctypes.c_char_p],
        "nvrtcGetPTXSize": [p, ctypes.POINTER(s)],
        "nvrtcGetPTX": [p, ctypes.c_char_p],
        "nvrtcGetLoweredName": [p, cp, cpp],
    }
    for name, args in protos.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL, str]:
    lib, path = _open_first(candidate_paths())
    try:
        _declare(lib)
    except AttributeError as e:
        raise CommunicatorUnavailable(
            f"{path} lacks an NVRTC function this binding needs: {e}"
        ) from e
    return lib, path


def library_path() -> str:
    """The path (or loader name) of the NVRTC library in use; loads it if needed."""
    return _library()[1]


def _error_string(lib: ctypes.CDLL, rc: int) -> str:
    text = lib.nvrtcGetErrorString(rc)
    return f"{text.decode(errors='replace') if text else 'unknown error'} (code {rc})"


def _call(lib: ctypes.CDLL, what: str, rc: int) -> None:
    if rc != _SUCCESS:
        raise KernelCompileError(f"NVRTC {what} failed: {_error_string(lib, rc)}")


# ---------------------------------------------------------------------- queries
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)`` version, e.g. ``(13, 0)``.

    Raises:
        CommunicatorUnavailable: The library cannot be found.
    """
    lib = _library()[0]
    major, minor = ctypes.c_int(), ctypes.c_int()
    _call(lib, "nvrtcVersion", lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    return major.value, minor.value


def supported_archs() -> list[int]:
    """Compute capabilities NVRTC can target, e.g. ``[75, 80, 86, 89, 90, ...]``.

    Raises:
        CommunicatorUnavailable: The library cannot be found.
    """
    lib = _library()[0]
    n = ctypes.c_int()
    _call(lib, "nvrtcGetNumSupportedArchs", lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)))
    archs = (ctypes.c_int * n.value)()
    _call(lib, "nvrtcGetSupportedArchs", lib.nvrtcGetSupportedArchs(archs))
    return list(archs)


def parse_arch(arch: Any) -> str:
    """Normalise an architecture to NVRTC's digits and suffix: ``"80"``, ``"90a"``.

    Accepts ``80``, ``"80"``, ``"sm_90"``, ``"compute_90"`` and the arch-specific
    forms ``"sm_90a"``/``"compute_100f"``.

    Raises:
        TypeError: ``arch`` is neither an int nor a str.
        ValueError: ``arch`` is not an architecture.
    """
    if isinstance(arch, bool) or not isinstance(arch, (int, str)):
        raise TypeError(
            f"arch must be an int like 80 or a str like 'sm_90', got {type(arch).__name__}"
        )
    m = _ARCH_RE.match(str(arch).strip().lower())
    if m is None:
        raise ValueError(
            f"arch must be a compute capability like 80, '80', 'sm_90' or 'compute_90', "
            f"got {arch!r}"
        )
    return m.group(1) + m.group(2)


# ---------------------------------------------------------------------- compile
def _check_str(value: Any, arg: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
    return value


def _check_strs(values: Any, arg: str) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{arg} must be a sequence of str, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, str) or not v.strip():
            raise (TypeError if not isinstance(v, str) else ValueError)(
                f"{arg}[{i}] must be a non-empty str, got {v!r}"
            )
        out.append(v)
    return list(dict.fromkeys(out))  # NVRTC rejects nothing, but duplicates are pointless


def _check_supported(arch: str) -> None:
    cc = int(arch.rstrip("af"))
    archs = supported_archs()
    if cc not in archs:
        major, minor = nvrtc_version()
        raise ValueError(
            f"arch must be one this NVRTC ({major}.{minor}) supports, {archs}; got {arch}"
        )


def _c_strings(items: Sequence[str]) -> Any:
    arr = (ctypes.c_char_p * max(1, len(items)))()
    for i, s in enumerate(items):
        arr[i] = s.encode()
    return arr


def _read_log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != _SUCCESS or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetProgramLog(prog, buf) != _SUCCESS:
        return ""
    return buf.value.decode(errors="replace").strip()


def _read_ptx(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    _call(lib, "nvrtcGetPTXSize", lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    buf = ctypes.create_string_buffer(size.value)
    _call(lib, "nvrtcGetPTX", lib.nvrtcGetPTX(prog, buf))
    return buf.value.decode()


def _lowered(lib: ctypes.CDLL, prog: ctypes.c_void_p, names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        ptr = ctypes.c_char_p()
        rc = lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(ptr))
        _call(lib, f"nvrtcGetLoweredName({name!r})", rc)
        out[name] = (ptr.value or b"").decode()
    return out


def _compile(
    lib: ctypes.CDLL, prog: ctypes.c_void_p, arch: str, names: list[str],
    options: list[str], filename: str,
) -> CompiledPtx:
    for name in names:
        rc = lib.nvrtcAddNameExpression(prog, name.encode())
        _call(lib, f"nvrtcAddNameExpression({name!r})", rc)
    opts = [f"--gpu-architecture=compute_{arch}", *options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), _c_strings(opts))
    log = _read_log(lib, prog)
    if rc != _SUCCESS:
        err = KernelCompileError(
            f"NVRTC could not compile {filename} for compute_{arch} with options {opts} "
            f"({_error_string(lib, rc)}); compiler log:\n{log or '(empty)'}"
        )
        err.log = log
        raise err
    return CompiledPtx(ptx=_read_ptx(lib, prog), lowered_names=_lowered(lib, prog, names), log=log)


def compile_to_ptx(
    source: str,
    arch: str | int,
    name_expressions: Sequence[str] = (),
    options: Sequence[str] = (),
    filename: str = "kernels.cu",
) -> CompiledPtx:
    """Compile CUDA C++ ``source`` to PTX for ``arch`` (no GPU needed).

    Args:
        source: The CUDA C++ translation unit.
        arch: Target compute capability: ``80``, ``"80"``, ``"sm_90"``, ``"compute_90"``.
            The PTX is made for the virtual architecture ``compute_<arch>``.
        name_expressions: Kernel names to instantiate and lower, such as
            ``"scale<float, 4>"`` (see ``nvrtcAddNameExpression``).
        options: Extra NVRTC options, e.g. ``("-std=c++17",)``; do not pass an
            architecture option.
        filename: The name NVRTC uses for ``source`` in its messages.

    Returns:
        The PTX, each name expression's lowered name, and the compiler log.

    Raises:
        TypeError, ValueError: An argument is malformed, or ``arch`` is not
            supported by this NVRTC.
        KernelCompileError: Compilation failed; the message holds NVRTC's log.
        CommunicatorUnavailable: NVRTC cannot be found.
    """
    src, fname = _check_str(source, "source"), _check_str(filename, "filename")
    cc = parse_arch(arch)
    names = _check_strs(name_expressions, "name_expressions")
    opts = _check_strs(options, "options")
    lib = _library()[0]
    _check_supported(cc)
    prog = ctypes.c_void_p()
    _call(lib, "nvrtcCreateProgram",
          lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), fname.encode(), 0, None, None))
    try:
        return _compile(lib, prog, cc, names, opts, fname)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
