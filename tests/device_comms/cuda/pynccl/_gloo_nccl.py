"""A stand-in for :class:`~device_comms.cuda.pynccl.library.NcclLibrary` that runs on CPU.

Every "NCCL call" reads and writes CPU memory at the raw pointers it is given
(as NCCL would read device memory) and moves the data over a gloo group, so
:class:`~device_comms.cuda.pynccl.PyNcclCommunicator` and
:class:`~device_comms.cuda.communicator.CudaCommunicator` run end to end on
real processes without a GPU: pointer arithmetic, element counts, datatype and
operator codes, roots and grouping are all exercised.

Semantics follow nccl.h: reductions combine the ranks' buffers element-wise
(in rank order, with :func:`reduce_local`, so results match the tests'
references bitwise); collectives inside ``group_start``/``group_end`` run in
issue order (every rank issues the same sequence), at once or, with
``defer=True``, at the outermost ``group_end`` as NCCL may run them ("when
called inside a group, stream operations ... can return without having
enqueued the operation"; the buffers are read then); point-to-point calls
inside a group are posted together at the outermost ``group_end``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
import torch.distributed as dist

from device_comms.cuda.pynccl.library import format_version
from device_comms.cuda.pynccl.types import DATATYPE_CODES, REDOP_CODES
from device_comms.reduce_op import ReduceOp, reduce_local

_TORCH = {
    "ncclInt8": torch.int8, "ncclUint8": torch.uint8, "ncclInt32": torch.int32,
    "ncclUint32": torch.uint32, "ncclInt64": torch.int64, "ncclUint64": torch.uint64,
    "ncclFloat16": torch.float16, "ncclFloat32": torch.float32, "ncclFloat64": torch.float64,
    "ncclBfloat16": torch.bfloat16, "ncclFloat8e4m3": torch.float8_e4m3fn,
    "ncclFloat8e5m2": torch.float8_e5m2,
}
DTYPES = {DATATYPE_CODES[k]: v for k, v in _TORCH.items()}
OPS = {
    REDOP_CODES["ncclSum"]: ReduceOp.SUM, REDOP_CODES["ncclProd"]: ReduceOp.PRODUCT,
    REDOP_CODES["ncclMax"]: ReduceOp.MAX, REDOP_CODES["ncclMin"]: ReduceOp.MIN,
    REDOP_CODES["ncclAvg"]: ReduceOp.AVG,
}
COMM = "gloo-nccl-comm"
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def memory(ptr: int | None, count: int, dtype: int) -> torch.Tensor:
    """``count`` elements of NCCL type ``dtype`` at address ``ptr`` (shared, writable)."""
    dt = DTYPES[dtype]
    nbytes = count * torch.empty((), dtype=dt).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dt)
    if not ptr:
        raise ValueError(f"NULL buffer for {count} elements")
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dt)


class GlooNccl:
    """The NcclLibrary interface over a gloo group (see module doc).

    Attributes:
        calls: ``(name, args)`` of every call, in order.
        closed_with: ``"destroy"`` or ``"abort"`` once the communicator went away.
        async_error: What ``comm_get_async_error`` reports (tests set it).
    """

    def __init__(self, group: Any = None, nccl_version: int = 23203, defer: bool = False) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank(self.group)
        self.n = dist.get_world_size(self.group)
        self._version = nccl_version
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.closed_with: str | None = None
        self.async_error = 0
        self.depth = 0
        self._p2p: list[tuple[str, torch.Tensor, int]] = []
        self.uid: bytes | None = None
        self.defer = defer
        self._deferred: list[Any] = []  # collectives of the open group (defer=True)

    def _run(self, job: Any) -> None:
        """Run a collective now, or at the outermost ``group_end`` (``defer``)."""
        if self.defer and self.depth:
            self._deferred.append(job)
        else:
            job()

    # ------------------------------------------------------------------ setup
    def version(self) -> int:
        return self._version

    def version_string(self) -> str:
        return format_version(self._version)

    def unique_id(self) -> bytes:
        self.calls.append(("unique_id", ()))
        return os.urandom(128)

    def error_string(self, code: int) -> str:
        return f"fake NCCL error {code}"

    def describe(self, code: int) -> str:
        return self.error_string(code)

    def comm_init_rank(self, nranks: int, uid: bytes, rank: int) -> str:
        if (nranks, rank) != (self.n, self.rank) or len(uid) != 128:
            raise AssertionError(f"comm_init_rank({nranks}, <{len(uid)} bytes>, {rank})")
        self.uid = uid
        self.calls.append(("comm_init_rank", (nranks, rank)))
        return COMM

    def comm_destroy(self, comm: Any) -> None:
        self._closing("destroy", comm)

    def comm_abort(self, comm: Any) -> None:
        self._closing("abort", comm)

    def _closing(self, how: str, comm: Any) -> None:
        if comm != COMM or self.closed_with is not None:
            raise AssertionError(f"comm_{how} on {comm!r} (closed_with={self.closed_with})")
        self.closed_with = how

    def comm_get_async_error(self, comm: Any) -> int:
        return self.async_error

    # ------------------------------------------------------------------ helpers
    def _log(self, name: str, comm: Any, stream: Any, *args: Any) -> None:
        if comm != COMM or stream is not None:
            raise AssertionError(f"{name}: comm={comm!r}, stream={stream!r} (CPU: NULL stream)")
        self.calls.append((name, args))

    def _gathered(self, send: torch.Tensor) -> list[torch.Tensor]:
        raw = send.view(torch.uint8) if send.numel() else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(self.n * raw.numel(), dtype=torch.uint8)
        _all_gather_flat(out, raw.clone(), group=self.group)
        return [p.view(send.dtype) for p in out.chunk(self.n)] if raw.numel() else [send] * self.n

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any,
                   stream: Any) -> None:
        self._log("all_reduce", comm, stream, count, dtype, op)

        def job() -> None:
            xs = self._gathered(memory(send, count, dtype))
            memory(recv, count, dtype).copy_(reduce_local(xs, OPS[op]))
        self._run(job)

    def all_gather(self, send: int, recv: int, count: int, dtype: int, comm: Any,
                   stream: Any) -> None:
        self._log("all_gather", comm, stream, count, dtype)

        def job() -> None:
            xs = self._gathered(memory(send, count, dtype))
            memory(recv, count * self.n, dtype).copy_(torch.cat(xs))
        self._run(job)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any,
                       stream: Any) -> None:
        self._log("reduce_scatter", comm, stream, count, dtype, op)

        def job() -> None:
            xs = self._gathered(memory(send, count * self.n, dtype))
            full = reduce_local(xs, OPS[op])
            memory(recv, count, dtype).copy_(full[self.rank * count:(self.rank + 1) * count])
        self._run(job)

    def reduce(self, send: int, recv: int | None, count: int, dtype: int, op: int, root: int,
               comm: Any, stream: Any) -> None:
        self._log("reduce", comm, stream, count, dtype, op, root)

        def job() -> None:
            xs = self._gathered(memory(send, count, dtype))
            if self.rank == root:
                memory(recv, count, dtype).copy_(reduce_local(xs, OPS[op]))
        self._run(job)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: Any,
                  stream: Any) -> None:
        self._log("broadcast", comm, stream, count, dtype, root)

        def job() -> None:
            buf = memory(recv, count, dtype)
            if self.rank == root and send != recv:
                buf.copy_(memory(send, count, dtype))
            dist.broadcast(buf.view(torch.uint8), src=self.ranks[root], group=self.group)
        self._run(job)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: Any, stream: Any) -> None:
        self._log("send", comm, stream, count, dtype, peer)
        self._p2p.append(("send", memory(buf, count, dtype).view(torch.uint8), peer))
        if not self.depth:
            self._flush()

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: Any, stream: Any) -> None:
        self._log("recv", comm, stream, count, dtype, peer)
        self._p2p.append(("recv", memory(buf, count, dtype).view(torch.uint8), peer))
        if not self.depth:
            self._flush()

    def group_start(self) -> None:
        self.calls.append(("group_start", ()))
        self.depth += 1

    def group_end(self) -> None:
        self.calls.append(("group_end", ()))
        if self.depth <= 0:
            raise AssertionError("group_end without group_start")
        self.depth -= 1
        if not self.depth:
            jobs, self._deferred = self._deferred, []
            for job in jobs:
                job()
            self._flush()

    def _flush(self) -> None:
        ops, self._p2p = self._p2p, []
        reqs = [
            (dist.isend if kind == "send" else dist.irecv)(t, self.ranks[peer], group=self.group)
            for kind, t, peer in ops
        ]
        for r in reqs:
            r.wait()

    def names(self) -> list[str]:
        """Names of the calls so far."""
        return [name for name, _ in self.calls]
