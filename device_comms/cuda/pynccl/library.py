"""Finding ``libnccl.so.2`` and calling it through :mod:`ctypes`.

Discovery order (the first place that loads wins):

1. the file named by the environment variable ``GROUPCOORD_NCCL_SO_PATH``;
2. ``nvidia/nccl/lib/libnccl.so.2`` of the ``nvidia-nccl-cu13`` or
   ``nvidia-nccl-cu12`` wheel, found through the ``nvidia`` namespace
   package's ``__path__`` entries (torch is not imported for this);
3. ``libnccl.so.2`` on the dynamic loader's search path.

When none loads, :class:`~device_comms.errors.CommunicatorUnavailable` names
every place searched and why each failed.

:class:`NcclLibrary` declares ``restype``/``argtypes`` of every function it
uses from :data:`SIGNATURES` (kept as data so a test can compare it with
``nccl.h``) and turns any result other than ``ncclSuccess`` into
:class:`~device_comms.errors.NcclError` carrying NCCL's own message. Loading
is lazy: importing this module loads nothing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from device_comms.errors import CommunicatorUnavailable, NcclError

__all__ = [
    "ENV_SO_PATH",
    "SONAME",
    "SIGNATURES",
    "NcclUniqueId",
    "UNIQUE_ID_BYTES",
    "Candidate",
    "default_candidates",
    "find_library",
    "load_library",
    "NcclLibrary",
    "format_version",
    "version",
    "version_string",
    "unique_id",
]

logger = logging.getLogger(__name__)

ENV_SO_PATH = "GROUPCOORD_NCCL_SO_PATH"
SONAME = "libnccl.so.2"
WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
UNIQUE_ID_BYTES = 128
NCCL_SUCCESS = 0  # ncclResult_t ncclSuccess
NCCL_IN_PROGRESS = 7  # ncclInProgress: an operation of a non-blocking communicator is pending


class NcclUniqueId(ctypes.Structure):
    """``typedef struct { char internal[128]; } ncclUniqueId;``"""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


# C types of nccl.h, as ctypes.
ncclResult_t = ctypes.c_int
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_t = ctypes.c_void_p  # void* and const void*

_R = ncclResult_t
# name -> (restype, argtypes), in the order of the prototypes in nccl.h.
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ncclGetVersion": (_R, (ctypes.POINTER(ctypes.c_int),)),
    "ncclGetUniqueId": (_R, (ctypes.POINTER(NcclUniqueId),)),
    "ncclCommInitRank": (_R, (ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId,
                              ctypes.c_int)),
    "ncclCommDestroy": (_R, (ncclComm_t,)),
    "ncclCommAbort": (_R, (ncclComm_t,)),
    "ncclGetErrorString": (ctypes.c_char_p, (ncclResult_t,)),
    "ncclCommGetAsyncError": (_R, (ncclComm_t, ctypes.POINTER(ncclResult_t))),
    "ncclReduce": (_R, (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t,
                        ctypes.c_int, ncclComm_t, cudaStream_t)),
    "ncclBroadcast": (_R, (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int,
                           ncclComm_t, cudaStream_t)),
    "ncclAllReduce": (_R, (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t,
                           ncclComm_t, cudaStream_t)),
    "ncclReduceScatter": (_R, (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t,
                               ncclComm_t, cudaStream_t)),
    "ncclAllGather": (_R, (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclComm_t,
                           cudaStream_t)),
    "ncclSend": (_R, (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t,
                      cudaStream_t)),
    "ncclRecv": (_R, (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t,
                      cudaStream_t)),
    "ncclGroupStart": (_R, ()),
    "ncclGroupEnd": (_R, ()),
}
#: Bound where the library has them (``ncclGetLastError``: NCCL 2.13 on).
OPTIONAL_SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ncclGetLastError": (ctypes.c_char_p, (ncclComm_t,)),
}


# ---------------------------------------------------------------------- discovery
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One place to look for the library.

    Attributes:
        where: Human description of the place (used in error messages).
        target: A file path, or a bare soname for the loader's search path;
            None when the place yielded nothing to try.
        why_not: Why the place yielded nothing (when ``target`` is None).
    """

    where: str
    target: str | None
    why_not: str = ""


def _env_candidate(environ: Any) -> Candidate:
    where = f"${ENV_SO_PATH}"
    value = environ.get(ENV_SO_PATH, "")
    if not value:
        return Candidate(where, None, "not set")
    if not os.path.isfile(value):
        return Candidate(f"{where}={value}", None, "no such file")
    return Candidate(f"{where}={value}", value)


def _nvidia_dirs() -> list[str]:
    """The ``nvidia`` namespace package's ``__path__`` entries (nothing imported)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [str(p) for p in spec.submodule_search_locations]


def _installed_wheels() -> list[str]:
    found = []
    for name in WHEELS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _wheel_candidates(nvidia_dirs: Sequence[str] | None) -> list[Candidate]:
    dirs = _nvidia_dirs() if nvidia_dirs is None else list(nvidia_dirs)
    wheels = _installed_wheels() if nvidia_dirs is None else []
    label = f"wheel {' or '.join(WHEELS)}"
    if wheels:
        label += f" (installed: {', '.join(wheels)})"
    if not dirs:
        return [Candidate(label, None, "no 'nvidia' namespace package on sys.path")]
    out = []
    for d in dirs:
        path = os.path.join(d, "nccl", "lib", SONAME)
        if os.path.isfile(path):
            out.append(Candidate(f"{label}: {path}", path))
        else:
            out.append(Candidate(f"{label}: {path}", None, "no such file"))
    return out


def default_candidates(
    environ: Any = None,
    nvidia_dirs: Sequence[str] | None = None,
    soname: str = SONAME,
) -> list[Candidate]:
    """The places searched, in order (arguments replace the real ones in tests).

    Args:
        environ: Mapping read for ``GROUPCOORD_NCCL_SO_PATH`` (default ``os.environ``).
        nvidia_dirs: Directories standing for the ``nvidia`` package's ``__path__``.
        soname: Name given to the dynamic loader last.
    """
    env = os.environ if environ is None else environ
    return [
        _env_candidate(env),
        *_wheel_candidates(nvidia_dirs),
        Candidate(f"dynamic loader search path ({soname})", soname),
    ]


def find_library(candidates: Sequence[Candidate] | None = None) -> str:
    """Return the first candidate that ``dlopen`` accepts and that exports NCCL.

    Raises:
        CommunicatorUnavailable: Nothing loaded; the message lists every
            place searched and why each failed.
    """
    cands = default_candidates() if candidates is None else list(candidates)
    failures = []
    for c in cands:
        if c.target is None:
            failures.append(f"{c.where}: {c.why_not}")
            continue
        why = _try_open(c.target)
        if why is None:
            if failures and failures[0].startswith(f"${ENV_SO_PATH}="):
                logger.warning("ignoring %s; using %s", failures[0], c.where)
            return c.target
        failures.append(f"{c.where}: {why}")
    raise CommunicatorUnavailable(
        "NCCL library (libnccl.so.2) not found. Searched, in order:\n  - "
        + "\n  - ".join(failures)
        + f"\nInstall a wheel (pip install {WHEELS[0]}) or set {ENV_SO_PATH} to the library file."
    )


def _try_open(target: str) -> str | None:
    """None if ``target`` loads and exports ``ncclGetVersion``, else why not."""
    try:
        lib = ctypes.CDLL(target)
    except OSError as e:
        return f"cannot be loaded ({e})"
    if not hasattr(lib, "ncclGetVersion"):
        return "loads, but does not export ncclGetVersion (not an NCCL library)"
    return None


# ---------------------------------------------------------------------- binding
class _LoadedLibraries:
    """Process-wide cache: one :class:`NcclLibrary` per resolved library path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, NcclLibrary] = {}

    def get(self, path: str, opener: Callable[[str], NcclLibrary]) -> NcclLibrary:
        """The library loaded from ``path``; ``opener(path)`` loads it the first time."""
        key = os.path.realpath(path) if os.sep in path else path
        with self._lock:
            lib = self._by_path.get(key)
            if lib is None:
                lib = self._by_path[key] = opener(path)
            return lib

    def paths(self) -> list[str]:
        """Paths loaded so far (empty until something asks for NCCL)."""
        with self._lock:
            return list(self._by_path)


_LOADED = _LoadedLibraries()


def load_library(path: str | None = None) -> NcclLibrary:
    """The cached :class:`NcclLibrary` for ``path`` (discovered when None).

    Raises:
        CommunicatorUnavailable: No library found, or it lacks a needed symbol.
    """
    return NcclLibrary(path if path is not None else find_library())


class NcclLibrary:
    """Typed access to the NCCL functions this package uses.

    ``NcclLibrary(path)`` returns the one instance for ``path`` (loaded once
    per process). Every method raises :class:`~device_comms.errors.NcclError`
    when NCCL returns an error.

    Args:
        path: A library file, or a soname for the loader's search path.
    """

    path: str
    _lib: ctypes.CDLL
    _fns: dict[str, Callable[..., Any]]

    def __new__(cls, path: str) -> NcclLibrary:
        if not isinstance(path, str) or not path:
            raise TypeError(f"path must be a non-empty str naming the NCCL library, got {path!r}")
        return _LOADED.get(path, cls._open)

    @classmethod
    def _open(cls, path: str) -> NcclLibrary:
        """Load ``path`` into a new instance (once per path: :data:`_LOADED` keeps it)."""
        lib = object.__new__(cls)
        lib._bind(path)
        return lib

    def _bind(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise CommunicatorUnavailable(f"cannot load the NCCL library {path!r}: {e}") from e
        self.path = path
        self._fns = {}
        for name, (restype, argtypes) in SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError as e:
                raise CommunicatorUnavailable(
                    f"the NCCL library {path!r} does not export {name}; it is too old or not NCCL"
                ) from e
            fn.restype, fn.argtypes = restype, list(argtypes)
            self._fns[name] = fn
        for name, (restype, argtypes) in OPTIONAL_SIGNATURES.items():
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, list(argtypes)
                self._fns[name] = fn

    def __repr__(self) -> str:
        return f"NcclLibrary({self.path!r}, version {self.version_string()})"

    # ------------------------------------------------------------------ errors
    def error_string(self, code: int) -> str:
        """NCCL's description of a ``ncclResult_t`` value."""
        raw = self._fns["ncclGetErrorString"](code)
        return raw.decode(errors="replace") if raw else f"unknown NCCL result {code}"

    def last_error(self) -> str:
        """NCCL's message for its latest failure (``ncclGetLastError``: what went
        wrong, where :meth:`error_string` gives only the class of error); ``""``
        when there is none or the library predates the call."""
        fn = self._fns.get("ncclGetLastError")
        raw = fn(None) if fn is not None else None  # NCCL ignores the comm argument
        return raw.decode(errors="replace").strip() if raw else ""

    def describe(self, code: int) -> str:
        """:meth:`error_string` of ``code``, with :meth:`last_error` where NCCL has one."""
        text, last = self.error_string(code), self.last_error()
        return f"{text}; NCCL's last message: {last}" if last else text

    def check(self, call: str, code: int) -> None:
        """Raise :class:`NcclError` for ``call`` unless ``code`` is ``ncclSuccess``."""
        if code != NCCL_SUCCESS:
            raise NcclError(call, code, self.describe(code))

    def _call(self, name: str, *args: Any) -> None:
        self.check(name, self._fns[name](*args))

    # ------------------------------------------------------------------ setup
    def version(self) -> int:
        """``ncclGetVersion``: e.g. 23203 for 2.32.3."""
        v = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def version_string(self) -> str:
        """The version as ``"major.minor.patch"``."""
        return format_version(self.version())

    def unique_id(self) -> bytes:
        """``ncclGetUniqueId``: 128 bytes naming a new communicator's bootstrap root."""
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid)  # not uid.internal: c_char arrays stop at the first NUL

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """``ncclCommInitRank`` (collective over the ``nranks`` ranks sharing ``unique_id``)."""
        if not isinstance(unique_id, (bytes, bytearray)):
            raise TypeError(f"unique_id must be bytes, got {type(unique_id).__name__}")
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(
                f"unique_id must be {UNIQUE_ID_BYTES} bytes long, got {len(unique_id)}"
            )
        uid = NcclUniqueId.from_buffer_copy(bytes(unique_id))
        comm = ncclComm_t()
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        return comm

    def comm_destroy(self, comm: Any) -> None:
        """``ncclCommDestroy``."""
        self._call("ncclCommDestroy", comm)

    def comm_abort(self, comm: Any) -> None:
        """``ncclCommAbort``."""
        self._call("ncclCommAbort", comm)

    def comm_get_async_error(self, comm: Any) -> int:
        """``ncclCommGetAsyncError``: the communicator's pending ``ncclResult_t``."""
        err = ncclResult_t()
        self._call("ncclCommGetAsyncError", comm, ctypes.byref(err))
        return err.value

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                   comm: Any, stream: int | None) -> None:
        """``ncclAllReduce``."""
        self._call("ncclAllReduce", send, recv, count, dtype, op, comm, stream)

    def all_gather(self, send: int, recv: int, count: int, dtype: int,
                   comm: Any, stream: int | None) -> None:
        """``ncclAllGather`` (``count`` elements per rank)."""
        self._call("ncclAllGather", send, recv, count, dtype, comm, stream)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int,
                       comm: Any, stream: int | None) -> None:
        """``ncclReduceScatter`` (``count`` elements received per rank)."""
        self._call("ncclReduceScatter", send, recv, count, dtype, op, comm, stream)

    def reduce(self, send: int, recv: int | None, count: int, dtype: int, op: int, root: int,
               comm: Any, stream: int | None) -> None:
        """``ncclReduce`` (``recv`` may be None except on ``root``)."""
        self._call("ncclReduce", send, recv, count, dtype, op, root, comm, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int,
                  comm: Any, stream: int | None) -> None:
        """``ncclBroadcast``."""
        self._call("ncclBroadcast", send, recv, count, dtype, root, comm, stream)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: Any,
             stream: int | None) -> None:
        """``ncclSend``."""
        self._call("ncclSend", buf, count, dtype, peer, comm, stream)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: Any,
             stream: int | None) -> None:
        """``ncclRecv``."""
        self._call("ncclRecv", buf, count, dtype, peer, comm, stream)

    def group_start(self) -> None:
        """``ncclGroupStart``."""
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        """``ncclGroupEnd``."""
        self._call("ncclGroupEnd")


def format_version(code: int) -> str:
    """``ncclGetVersion``'s integer as ``"major.minor.patch"`` (both NCCL encodings)."""
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        major, rest = divmod(code, 10000)
    else:  # older: major*1000 + minor*100 + patch
        major, rest = divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def version() -> int:
    """Version of the discovered NCCL library (e.g. 23203)."""
    return load_library().version()


def version_string() -> str:
    """Version of the discovered NCCL library as ``"2.32.3"``."""
    return load_library().version_string()


def unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) from the discovered library."""
    return load_library().unique_id()
