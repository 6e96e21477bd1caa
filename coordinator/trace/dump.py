"""Dumps of the flight recorder in PyTorch's flight-recorder format.

A dump is one pickle per process, named ``<prefix><global rank>``, holding
only dicts, lists, tuples, strings, numbers, booleans and None, so that
PyTorch's analyzer (``torchfrtrace DIR``) loads a directory of them without
groupcoord installed. The top level follows PyTorch's dump (version ``2.10``):

* ``version``: ``"2.10"``;
* ``pg_config``: per group name, ``{"name", "desc", "ranks"}`` with ``ranks``
  the members' global ranks written as a list literal (``"[0, 1]"``);
* ``pg_status``: per group, keyed by its ``pg_id`` as a string (as PyTorch
  keys it), the last enqueued, started and completed collective sequence
  numbers (-1 for none);
* ``entries``: the calls, oldest first, each with PyTorch's fields:
  ``record_id``, ``pg_id``, ``process_group`` (name, desc),
  ``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``profiling_name``
  (``nccl:all_reduce``, ``nccl:send 0->1``; see below), ``time_created_ns`` (wall
  clock), ``duration_ms``, ``is_p2p``, ``input_sizes``, ``input_dtypes``,
  ``output_sizes``, ``output_dtypes``, ``state`` (``scheduled``,
  ``started``, ``completed``, or ``failed``), ``time_discovered_started_ns``,
  ``time_discovered_completed_ns``, ``retired``, ``timeout_ms`` (the group's
  timeout), ``frames``, ``thread_id`` and ``thread_name`` (of the calling
  thread; the name is empty once that thread has ended). As in PyTorch,
  ``collective_seq_id`` and ``p2p_seq_id`` count the group's collectives and
  point-to-point calls so far (each entry carries both) and ``op_id`` their sum.
  Plus groupcoord's own fields: ``op`` (the public method), ``transport``
  (``shm``, ``gloo``, ``hierarchical``, ``pynccl``, ``custom_allreduce``,
  ``queue``...), ``error`` (the class of the error a failed call raised),
  ``peer``, ``time_created_monotonic_ns``, ``rows_vary``, ``true_input_sizes`` /
  ``true_output_sizes``, ``replays``, ``root`` (the group rank of a rooted
  call's root: a broadcast's or scatter's ``src``, a reduce's or gather's
  ``dst``; else None) and ``reduce_op`` (a reducing call's op by name,
  ``SUM``...; else None). PyTorch's loader ignores keys it does not read;
  these let ``groupcoord trace`` name ranks that disagree on a root or op;
* ``comm_lib_version``, and ``groupcoord``: rank, host, pid, why the dump was
  written, the monotonic and wall clocks at the dump.

**What every version of PyTorch's analyzer reads.** The analyzer splits
``profiling_name`` at the colon and refuses a library or an op type it does
not list, and the lists grew over time: torch 2.11's analyzer knows the
libraries ``nccl`` and ``xccl`` only (PyTorch named every backend's calls
``nccl:`` until it began to write the real backend, in 2026) and neither
``barrier`` nor ``all_gather_v``; torch 2.13's adds ``gloo``, those types and
others. So every name here is one that each version lists
(:data:`ANALYZER_TYPES`), and ``op`` is the real call:

* the library is ``nccl`` whatever the transport (``transport`` names the
  real one);
* a barrier is ``all_reduce_barrier``, as PyTorch's NCCL barrier writes it;
* the variable-size calls are the analyzer's equal-size ones with the
  dimension along which their rows differ (the ``dim`` argument of
  ``all_gatherv``/``reduce_scatterv``, else 0) shown as a negative count:
  ``all_gatherv``, ``all_gatherv_rows`` and MoE ``dispatch`` are
  ``all_gather`` with the input's rows shown as ``-1`` and the output's as
  ``-n`` (``n`` ranks); ``reduce_scatterv`` and MoE ``combine`` are
  ``reduce_scatter`` with the input's rows ``-n`` and the output's ``-1``;
  ``all_to_allv`` is ``all_to_all`` with both ``-1``.

The analyzer then compares the op type, the other dimensions and the
dtypes, and its element-count checks hold: an all-gather's output holds
``n`` times its input's elements, a reduce-scatter's input ``n`` times its
output's, and an all-to-all's two sides, summed over the ranks, balance.
``rows_vary`` (``[input, output]``) says which side's rows really differ by
rank, and the real sizes are in ``true_input_sizes``/``true_output_sizes``
(the output's None while a variable-size call has not completed):
``groupcoord trace`` compares the true sizes of the side that does not
vary. Calls that
carry objects (object broadcasts, tensor-dict metadata, queue broadcasts)
have no sizes. A tensor call that recorded no shape at all (a rank that
rejected its arguments without knowing the tensor its peers pass) shows
``[[]]`` sizes and no dtypes on both sides: PyTorch's analyzer reads
``input_sizes[0]`` and ``output_sizes[0]`` of every tensor call it compares,
and an empty first shape makes its dtype checks skip the call (its size
checks still compare it: where an op's sizes are compared, the call shows as
differing from its peers'). A call that has not completed (failed, or still
waiting) has no output yet: an ``all_gather``, ``reduce_scatter`` or a
``gather``'s root shows the output it produces (the input's shape with
``dim`` multiplied, or divided, by the group's size), so that ranks that
made the same call compare equal whatever became of it; where its arguments
give no output (``dim`` out of range or not divisible) it shows the input's.
A missing side of a rooted call (``gather``'s
output off the root, ``scatter``'s input off the source) shows the other
side's sizes, as the analyzer expects of PyTorch's in-place calls.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterable
from time import monotonic_ns
from typing import Any

import torch

from coordinator.trace.recorder import (
    CREATED,
    DEFAULT_DUMP_DIR,
    DEVICE,
    DIM,
    DONE,
    ERROR,
    FRAMES,
    GROUP,
    IN_DTYPES,
    IN_SIZES,
    OP,
    OUT_DTYPES,
    OUT_SIZES,
    P2P_SEQ,
    PEER,
    REDUCE_OP,
    RID,
    ROOT,
    SEQ,
    THREAD,
    TRANSPORT,
    FlightRecorder,
    GroupTrace,
    recorder,
)
from shm_broadcast import checks

__all__ = ["ANALYZER_TYPES", "FR_VERSION", "OPS", "snapshot", "write_dump", "dump_path",
           "global_rank"]

#: The PyTorch flight-recorder dump version these dumps follow.
FR_VERSION = "2.10"

#: The library every ``profiling_name`` names (see the module docstring).
PROFILING_LIBRARY = "nccl"

# op -> (PyTorch's op type, is_p2p, input rows vary by rank, output rows vary, has tensors)
OPS: dict[str, tuple[str, bool, bool, bool, bool]] = {
    "all_reduce": ("all_reduce", False, False, False, True),
    "all_gather": ("all_gather", False, False, False, True),
    "all_gatherv": ("all_gather", False, True, False, True),
    "all_gatherv_rows": ("all_gather", False, True, False, True),
    "dispatch": ("all_gather", False, True, False, True),
    "dispatch_router_logits": ("all_gather", False, True, False, True),
    "reduce_scatter": ("reduce_scatter", False, False, False, True),
    "reduce_scatterv": ("reduce_scatter", False, False, True, True),
    "combine": ("reduce_scatter", False, False, True, True),
    "gather": ("gather", False, False, False, True),
    "reduce": ("reduce", False, False, False, True),
    "scatter": ("scatter", False, False, False, True),
    "broadcast": ("broadcast", False, False, False, True),
    "all_to_all": ("all_to_all", False, False, False, True),
    "all_to_allv": ("all_to_all", False, True, True, True),
    "barrier": ("all_reduce_barrier", False, False, False, False),
    "broadcast_object": ("broadcast", False, False, False, False),
    "broadcast_object_list": ("broadcast", False, False, False, False),
    "broadcast_tensor_dict": ("broadcast", False, False, False, False),
    "queue_broadcast": ("broadcast", False, False, False, False),
    "send": ("send", True, False, False, True),
    "recv": ("recv", True, False, False, True),
    "isend": ("send", True, False, False, True),
    "irecv": ("recv", True, False, False, True),
    "send_object": ("send", True, False, False, False),
    "recv_object": ("recv", True, False, False, False),
    "send_tensor_dict": ("send", True, False, False, False),
    "recv_tensor_dict": ("recv", True, False, False, False),
    "isend_tensor_dict": ("send", True, False, False, False),
    "irecv_tensor_dict": ("recv", True, False, False, False),
}
#: An op missing from :data:`OPS` reads as a barrier (no sizes compared).
_UNKNOWN = ("all_reduce_barrier", False, False, False, False)
#: The op types of :data:`OPS`: each is one that every version of PyTorch's
#: analyzer lists (see the module docstring).
ANALYZER_TYPES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "gather", "reduce",
                            "scatter", "broadcast", "all_to_all", "all_reduce_barrier",
                            "send", "recv"})

# c10's scalar type names, which PyTorch's dumps use for dtypes.
_DTYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
    torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
for _name, _c10 in (("float8_e4m3fn", "Float8_e4m3fn"), ("float8_e5m2", "Float8_e5m2"),
                    ("uint16", "UInt16"), ("uint32", "UInt32"), ("uint64", "UInt64")):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _c10


def global_rank() -> int:
    """This process's global rank: torch.distributed's, else ``RANK``, else 0."""
    with contextlib.suppress(Exception):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return int(torch.distributed.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def dump_path(prefix: str, rank: int | None = None) -> str:
    """``<prefix><rank>``, the file a process's dump goes to."""
    return f"{prefix}{global_rank() if rank is None else rank}"


def _sizes(value: Any) -> list[list[int]]:
    """Shapes as PyTorch's dumps write them: a list of int lists (``[]`` for none)."""
    if value is None:
        return []
    if _is_shape(value):
        return [[int(d) for d in value]]
    if isinstance(value, (list, tuple)) and all(_is_shape(s) for s in value):
        return [[int(d) for d in s] for s in value]
    return []


def _is_shape(value: Any) -> bool:
    return isinstance(value, (torch.Size, tuple, list)) and all(
        isinstance(d, int) for d in value)


def _dtypes(value: Any) -> list[str]:
    """Dtypes as PyTorch's dumps write them: c10's names (``Float``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [_dtype_name(d) for d in value]
    return [_dtype_name(value)]


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return str(dtype)


def _varying(sizes: list[list[int]], dim: int, shown: int) -> list[list[int]]:
    """``sizes`` with each tensor's dimension ``dim`` (its rows; negative counts
    from the end) shown as ``shown``; a shape without that dimension as it is."""
    return [[shown if i == dim % len(s) else d for i, d in enumerate(s)]
            if -len(s) <= dim < len(s) else s for s in sizes]


def _shown_rows(fr_type: str, vary_in: bool, vary_out: bool,
                n: int) -> tuple[int | None, int | None]:
    """What the varying dimension of each side shows in PyTorch's view (None: the
    true sizes) for a group of ``n`` ranks (see the module docstring)."""
    if not (vary_in or vary_out):
        return None, None
    if fr_type == "all_gather":
        return -1, -n  # PyTorch's check: output numel == input numel * n
    if fr_type == "reduce_scatter":
        return -n, -1  # input numel == output numel * n
    return -1, -1  # all_to_all: each side's numel summed over the ranks balances


def _expected_out(entry: list[Any], n: int) -> Any:
    """The output shape ``entry``'s call produces, derived from its input's shape,
    its ``dim`` and the group's size ``n`` (see :mod:`coordinator.trace.recorder`):
    an ``all_gather``'s input with ``dim`` times ``n``, a ``reduce_scatter``'s
    with ``dim`` divided by ``n``, a ``gather``'s on its root as an all-gather's,
    an ``all_to_all``'s (``dim``: ``(scatter_dim, gather_dim)``) divided along
    the first and multiplied along the second. None for other calls, and where
    the arguments cannot give an output (a ``dim`` out of range, not divisible
    by ``n``): those show the input's."""
    op, sizes = entry[OP], entry[IN_SIZES]
    if op == "gather":
        if entry[ROOT] != entry[GROUP].rank_in_group:
            return None  # no output off the root
        op = "all_gather"
    if not isinstance(sizes, torch.Size):
        return None
    if op == "all_to_all":
        dims = entry[DIM] if isinstance(entry[DIM], tuple) and len(entry[DIM]) == 2 else (0, 0)
        split, joined = (_dim_in(d, sizes) for d in dims)
        if split is None or joined is None:
            return None
        grown = _grown(sizes, split, n, divide=True)
        return None if grown is None else _grown(grown, joined, n, divide=False)
    if op != "all_gather" and op != "reduce_scatter":
        return None
    dim = _dim_in(-1 if entry[DIM] is None else entry[DIM], sizes)  # None: the default
    return None if dim is None else _grown(sizes, dim, n, divide=op == "reduce_scatter")


def _dim_in(dim: Any, sizes: torch.Size) -> int | None:
    """``dim`` (an integer as given) as an index into ``sizes``; None if out of range."""
    d = checks.as_int(dim)
    return d % len(sizes) if d is not None and -len(sizes) <= d < len(sizes) else None


def _grown(sizes: torch.Size, dim: int, n: int, divide: bool) -> torch.Size | None:
    """``sizes`` with dimension ``dim`` divided (None: not divisible) or multiplied by ``n``."""
    out = list(sizes)
    if not divide:
        out[dim] *= n
    elif out[dim] % n:
        return None
    else:
        out[dim] //= n
    return torch.Size(out)


def _reduce_op_name(op: Any) -> str | None:
    """A reduce op as a dump writes it: its name (``SUM``), None for none."""
    if op is None:
        return None
    try:
        name = getattr(op, "name", None)
        return name if isinstance(name, str) else str(op)[:64]
    except Exception:
        return type(op).__name__


def _state(entry: list[Any]) -> tuple[str, int | None, int | None, int | None]:
    """(state, started, completed, replays) of ``entry``; times monotonic ns.

    A device call's marks that cannot be read (a sticky CUDA error makes every
    event query raise) leave the call ``started`` with no times (or ``failed``
    when it raised): the dump of everything else is what matters then.
    """
    marks = entry[DEVICE]
    replays = None
    if marks is not None:
        try:
            started, done = marks.started_ns(), marks.completed_ns()
            replays = marks.replays()
        except Exception:
            started = done = replays = None
            if entry[ERROR] is None:
                return "started", None, None, None
    else:
        started, done = entry[CREATED], (entry[DONE] or None)
    if entry[ERROR] is not None:
        return "failed", started, done, replays
    if done is not None:
        return "completed", started, done, replays
    return ("started" if started is not None else "scheduled"), started, None, replays


def _entry(entry: list[Any], wall_offset: int, threads: dict[int, str]) -> dict[str, Any]:
    """One entry as a plain dict in PyTorch's layout (see the module docstring);
    ``threads`` names the live threads by ident."""
    group: GroupTrace = entry[GROUP]
    op: str = entry[OP]
    fr_type, is_p2p, vary_in, vary_out, tensors = OPS.get(op, _UNKNOWN)
    transport = entry[TRANSPORT] or "gloo"
    if entry[TRANSPORT] is None and group.transport_of is not None:
        with contextlib.suppress(Exception):
            transport = str(group.transport_of(op, entry))
    n = len(group.ranks)
    out_raw = entry[OUT_SIZES]
    if out_raw is None:  # not completed (or no output): the one the call produces
        out_raw = _expected_out(entry, n)
    in_sizes, out_sizes = _sizes(entry[IN_SIZES]), _sizes(out_raw)
    in_dtypes, out_dtypes = _dtypes(entry[IN_DTYPES]), _dtypes(entry[OUT_DTYPES])
    if out_raw is not None and entry[OUT_DTYPES] is None:
        out_dtypes = in_dtypes  # only the shape changed (all_gather, reduce_scatter)
    if tensors:  # a missing side reads as the other one (see the module docstring)
        if out_raw is None:
            out_sizes, out_dtypes = in_sizes, in_dtypes
        if entry[IN_SIZES] is None:
            in_sizes, in_dtypes = out_sizes, out_dtypes
        if not in_sizes and not out_sizes:  # nothing known: see the module docstring
            in_sizes, out_sizes, in_dtypes, out_dtypes = [[]], [[]], [], []
    else:
        in_sizes = out_sizes = []
        in_dtypes = out_dtypes = []
    shown_in, shown_out = _shown_rows(fr_type, vary_in, vary_out, n)
    dim = checks.as_int(entry[DIM]) or 0  # the rows of a variable-size call differ along it
    name = f"{PROFILING_LIBRARY}:{fr_type}"
    me, peer = group.rank_in_group, entry[PEER]
    if is_p2p:
        name += f" {me}->{peer}" if fr_type == "send" else f" {me}<-{peer}"
    state, started, done, replays = _state(entry)
    created = entry[CREATED]
    return {
        "record_id": entry[RID],
        "pg_id": group.pg_id,
        "process_group": (group.name, group.desc),
        "collective_seq_id": entry[SEQ],
        "p2p_seq_id": entry[P2P_SEQ],
        "op_id": entry[SEQ] + entry[P2P_SEQ],
        "profiling_name": name,
        "time_created_ns": created + wall_offset,
        "duration_ms": None if done is None else (done - created) / 1e6,
        "is_p2p": is_p2p,
        "input_sizes": in_sizes if shown_in is None else _varying(in_sizes, dim, shown_in),
        "input_dtypes": in_dtypes,
        "output_sizes": out_sizes if shown_out is None else _varying(out_sizes, dim, shown_out),
        "output_dtypes": out_dtypes,
        "state": state,
        "time_discovered_started_ns": None if started is None else started + wall_offset,
        "time_discovered_completed_ns": None if done is None else done + wall_offset,
        "retired": done is not None or state == "failed",
        "timeout_ms": group.timeout_ms,
        "frames": list(entry[FRAMES] or []),
        "thread_id": "" if entry[THREAD] is None else str(entry[THREAD]),
        "thread_name": threads.get(entry[THREAD], ""),
        "op": op,
        "transport": transport,
        "error": entry[ERROR],
        "peer": peer if is_p2p else None,
        "time_created_monotonic_ns": created,
        "rows_vary": [vary_in, vary_out],
        "true_input_sizes": _sizes(entry[IN_SIZES]),
        "true_output_sizes": _sizes(out_raw) if out_raw is not None
        else None if (vary_in or vary_out) and done is None else _sizes(entry[IN_SIZES]),
        "replays": replays,
        "root": checks.as_int(entry[ROOT]),
        "reduce_op": _reduce_op_name(entry[REDUCE_OP]),
    }


def _pg_status(groups: Iterable[GroupTrace], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ``str(pg_id)``, as PyTorch keys it: the last collective enqueued (every
    entry's ``collective_seq_id`` counts the group's collectives so far, so a
    point-to-point entry tells it too), started and completed; -1 for none."""
    status: dict[str, dict[str, int]] = {}
    for g in groups:
        status[str(g.pg_id)] = {"last_enqueued_collective": -1, "last_started_collective": -1,
                                "last_completed_collective": -1}
    for e in entries:
        s = status.get(str(e["pg_id"]))
        if s is None:
            continue
        seq = e["collective_seq_id"]
        if seq > 0:
            s["last_enqueued_collective"] = max(s["last_enqueued_collective"], seq)
        if e["is_p2p"]:
            continue
        if e["state"] in ("started", "completed", "failed"):
            s["last_started_collective"] = max(s["last_started_collective"], seq)
        if e["state"] == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], seq)
    return status


def snapshot(rec: FlightRecorder | None = None, reason: str = "on demand",
             rank: int | None = None) -> dict[str, Any]:
    """The recorder's content as a PyTorch flight-recorder dump (plain data only).

    Args:
        rec: The recorder; None: the process's.
        reason: Why the dump is taken (kept under ``groupcoord``).
        rank: The global rank to name; None: this process's.
    """
    rec = rec if rec is not None else recorder()
    wall_offset = time.time_ns() - monotonic_ns()
    raw = rec.entries()
    threads = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    entries = [_entry(e, wall_offset, threads) for e in raw]
    groups = rec.groups()
    listed = {id(g) for g in groups}
    for e in raw:  # a group forgotten since its entries were read is still described
        g = e[GROUP]
        if id(g) not in listed:
            listed.add(id(g))
            groups.append(g)
    pg_config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
                 for g in groups}
    return {
        "version": FR_VERSION,
        "comm_lib_version": f"groupcoord {_version()}",
        "pg_config": pg_config,
        "pg_status": _pg_status(groups, entries),
        "entries": entries,
        "groupcoord": {
            "rank": global_rank() if rank is None else rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "reason": str(reason),
            "capacity": rec.capacity,
            "monotonic_ns": monotonic_ns(),
            "wall_ns": time.time_ns(),
        },
    }


def write_dump(rec: FlightRecorder | None = None, path: str | None = None,
               reason: str = "on demand", rank: int | None = None) -> str:
    """Write :func:`snapshot` to ``path`` (default ``<prefix><global rank>``), owner-only.

    The file is written under a temporary name in the same directory, created
    with mode 0600 (never following a link), then renamed into place, so a
    reader never sees half a dump. A missing directory is created with mode 0700.

    Returns:
        The path written.
    """
    rec = rec if rec is not None else recorder()
    if path is None:
        path = dump_path(rec.dump_prefix, rank)
    data = pickle.dumps(snapshot(rec, reason, rank), protocol=4)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.abspath(path).startswith(_default_dir() + os.sep):
        _check_private(directory)
    fd, tmp = tempfile.mkstemp(prefix=".groupcoord_trace.", dir=directory)  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _default_dir() -> str:
    """The default dump directory (see :func:`coordinator.trace.recorder.default_dump_prefix`)."""
    return os.path.join(tempfile.gettempdir(), DEFAULT_DUMP_DIR.format(uid=os.geteuid()))


def _check_private(directory: str) -> None:
    """Refuse the shared temp directory's default dump directory unless it is this
    user's own and nobody else may use it at all (mode 0700 or stricter: someone
    else may have made it first, to read or to replace the dumps)."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"the default dump directory {directory} is not a directory of this user's "
            f"own that only it may use (owner uid {st.st_uid}, mode "
            f"{oct(stat.S_IMODE(st.st_mode))}, expected 0700); remove it, or set "
            f"GROUPCOORD_TRACE_DUMP")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("groupcoord")
    except Exception:
        return "unknown"
