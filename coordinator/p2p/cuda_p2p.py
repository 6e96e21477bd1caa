"""Asynchronous point-to-point calls of a CUDA group: NCCL on a side stream, with events.

Imported by :mod:`coordinator.p2p.point_to_point` at a CUDA group's first
asynchronous call (never at module load). Not exercised in CI (no GPU there): only its
dispatch and argument paths are.

Why no thread: NCCL calls return as soon as their kernels are enqueued, and
every rank must enqueue the operations of one communicator in the same order
(a receive enqueued later than its send's rank enqueued a collective would
deadlock). So an asynchronous call enqueues its NCCL work *on the caller's
thread, at the call*, on one side stream per group, and records a CUDA event:

* the side stream first waits for the caller's current stream, so a send
  reads the tensor after the kernels that produced it;
* the tensors are marked used by the side stream (``record_stream``), so the
  caching allocator does not reuse their memory before the transfer ends;
* ``is_completed()`` queries the event; ``wait(timeout)`` polls it until the
  deadline (a hung NCCL operation cannot be cancelled: the timeout only stops
  the wait), then makes the caller's current stream wait for it, so a
  received tensor is ready for the kernels that follow.

Calls of one group run on its side stream in issue order, which is the
ordering rule of :mod:`coordinator.p2p.point_to_point`. NCCL matches a send only with
a receive posted by its peer; as for NCCL's own blocking send/recv, two ranks
that each issue ``isend`` before ``irecv`` to one another need the peer to
post its receive (NCCL buffers small messages; large ones may wait): order
such exchanges by rank parity, or receive first on one side.

Tensor dicts: the metadata (and any CPU tensors of the dict) travel over the
group's gloo side exactly as in the blocking calls. ``isend_tensor_dict``
queues that part on the sending thread of :mod:`coordinator.p2p.point_to_point` and
enqueues the CUDA tensors' sends at once; ``irecv_tensor_dict`` must know the
shapes before it can enqueue receives in issue order, so it receives the
metadata (and CPU tensors) on the caller's thread, in its turn, and only the
CUDA payload is asynchronous.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from coordinator.calls.call_errors import WAIT_ERRORS, CallErrors
from coordinator.calls.group_view import GroupView
from coordinator.errors import ClosedError
from coordinator.p2p.channels import RECV, SEND, Work
from coordinator.p2p.handle import P2PHandle
from coordinator.trace.cuda_marks import CudaMarks
from coordinator.trace.recorder import DEVICE
from coordinator.wire import object_comm
from coordinator.wire.object_comm import ObjectChannel
from coordinator.wire.tensor_dict_format import (
    INLINE,
    TENSOR,
    AllGatherGroup,
    SlicedDict,
    alloc,
    check_metadata,
    flatten_tensor_dict,
    own_slices,
    plain,
    rebuild_slices,
)
from device_comms.torch_dist.torch_communicator import wire_view
from device_comms.validation import dense

__all__ = ["CudaP2P", "Ordering", "EventWork"]


class Ordering(Protocol):
    """The group's point-to-point order, which the gloo side of a tensor dict keeps
    (:class:`~coordinator.p2p.point_to_point.PointToPoint`)."""

    def ordered(self, direction: str, peer: Any, op: str, fn: Callable[..., Any],
                *args: Any) -> Any: ...

    def submit(self, direction: str, peer: int, op: str, seq: int, fn: Callable[..., Any],
               *args: Any, quiet: bool = False) -> Work: ...

_POLL_S = 50e-6  # first poll interval of wait(); doubles up to _POLL_MAX_S
_POLL_MAX_S = 1e-3


class EventWork:
    """A call whose completion is a CUDA event (same interface as
    :class:`~coordinator.p2p.channels.Work`), optionally after a CPU-side
    :class:`Work` (a tensor dict's metadata)."""

    def __init__(self, op: str, peer: int, call: int, event: Any, device: torch.device,
                 result: Any, errors: Any, cpu: Work | None = None) -> None:
        self.op, self.peer, self.call = op, peer, call
        self._device = device
        self.errors, self.result = errors, result
        self._event, self._cpu = event, cpu
        self.error: BaseException | None = None
        self.observed = self.dropped = self.quiet = False

    def done(self) -> bool:
        """Whether the GPU transfer (and the CPU part) finished."""
        if self._cpu is not None and not self._cpu.done():
            return False
        self._take_cpu_error()
        return self.error is not None or bool(self._event.query())

    def block(self, timeout: float) -> bool:
        """Poll until done or ``timeout``; when done, order the current stream after it."""
        deadline = time.monotonic() + timeout
        if self._cpu is not None and not self._cpu.block(timeout):
            return False
        pause = _POLL_S
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)
        if self.error is None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def dead_peer(self) -> BaseException | None:
        """None: NCCL reports its own failures (and a hung kernel cannot be stopped)."""
        return None

    def declare(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def describe(self) -> str:
        where = "to" if "send" in self.op else "from"
        return f"{self.op} {where} rank {self.peer} (call #{self.call})"

    def _take_cpu_error(self) -> None:
        if self._cpu is not None and self.error is None and self._cpu.error is not None:
            self._cpu.observed = True
            self.error = self._cpu.error


class CudaP2P:
    """A CUDA group's asynchronous calls (see the module docstring).

    Args:
        group: The group (its communicator's ``pynccl`` carries the tensors;
            without one, ``torch.distributed`` on the device group does).
        errors: The group's explanation of failed waits.
        objects: The group's object calls (a tensor dict's metadata).
        order: The group's point-to-point order.
    """

    def __init__(self, group: GroupView, errors: CallErrors, objects: ObjectChannel,
                 order: Ordering) -> None:
        self._group = group
        self._errors = errors
        self._objects = objects
        self._order = order
        self.stream = torch.cuda.Stream(device=group.device)
        self._pending: list[EventWork] = []

    # ------------------------------------------------------------------ tensors
    def isend(self, t: torch.Tensor, dst: int, seq: int,
              entry: list[Any] | None = None) -> P2PHandle:
        """Enqueue sending ``t`` to ``dst`` (call ``seq``; ``entry``: its recorder
        entry, which gets the transfer's marks)."""
        t = dense(t)  # NCCL sends contiguous memory; a conj or neg view is resolved first
        ev = self._enqueue(lambda s: self._send(t, dst, s), [t], entry)
        return self._handle("isend", dst, seq, ev, None)

    def irecv(self, buf: torch.Tensor | None, size: torch.Size, dtype: torch.dtype, src: int,
              seq: int, entry: list[Any] | None = None) -> P2PHandle:
        """Enqueue receiving from ``src`` into ``buf`` or a new tensor (call ``seq``;
        ``entry``: its recorder entry, which gets the transfer's marks)."""
        out = torch.empty(size, dtype=dtype, device=self._group.device) if buf is None else buf
        target = out if out.is_contiguous() else torch.empty_like(
            out, memory_format=torch.contiguous_format)

        def run(s: Any) -> None:
            self._recv(target, src, s)
            if target is not out:
                with torch.no_grad():  # as for a CPU receive into a buffer that requires grad
                    out.copy_(target)

        ev = self._enqueue(run, [target, out], entry)
        return self._handle("irecv", src, seq, ev, out)

    # ------------------------------------------------------------------ tensor dicts
    def isend_tensor_dict(self, d: dict[Any, Any], dst: int, seq: int,
                          gather: AllGatherGroup | None = None,
                          slicing: Mapping[Any, bool] | None = None) -> P2PHandle:
        """Send ``d`` to ``dst`` (call ``seq``); with ``gather``, the tensors ``slicing``
        marks travel as this rank's slice of ``gather``'s size."""
        n = gather.world_size if gather is not None else 1
        meta, payload = flatten_tensor_dict(d, slicing=slicing if gather is not None else None,
                                            parts=n, device=self._group.device)
        if gather is not None:
            payload = own_slices(meta, payload, n, gather.rank_in_group)
        on_gpu = [dense(t) for t in payload if t.numel() and t.device.type == "cuda"]
        on_cpu = [dense(t) for t in payload if t.numel() and t.device.type == "cpu"]
        cpu = self._order.submit(SEND, dst, "isend_tensor_dict", seq, self._send_meta, meta,
                                 on_cpu, dst)
        ev = self._enqueue(lambda s: self._send_all(on_gpu, dst, s), on_gpu)
        return self._handle("isend_tensor_dict", dst, seq, ev, None, cpu)

    def irecv_tensor_dict(self, src: int, seq: int,
                          gather: AllGatherGroup | None = None) -> P2PHandle:
        """Receive a dict from ``src`` (call ``seq``); with ``gather``, the handle's
        ``wait()`` rebuilds the sliced tensors with all-gathers over it, after the
        current stream was ordered after the transfer."""
        try:
            got, on_gpu, problem = self._order.ordered(RECV, src, "irecv_tensor_dict",
                                                       self._recv_meta, src, gather)
        except WAIT_ERRORS as e:  # a failed wait: translated like every other call's
            self._errors.explain("irecv_tensor_dict", seq, e, partner=src)
            raise
        ev = self._enqueue(lambda s: self._recv_all(on_gpu, src, s), on_gpu)
        if problem:  # raised once every piece the sender sends has a receive posted
            raise ValueError(problem)
        if gather is None:
            return self._handle("irecv_tensor_dict", src, seq, ev, got.out)
        return self._handle("irecv_tensor_dict", src, seq, ev, got,
                            finish=lambda received: rebuild_slices(received, gather))

    # ------------------------------------------------------------------ closing
    def close(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for enqueued transfers (NCCL work cannot be
        cancelled); the ones still running fail their handles with ``ClosedError``."""
        deadline = time.monotonic() + grace
        for w in self._pending:
            if not w.block(max(0.0, deadline - time.monotonic())) and w.error is None:
                name = self._group.unique_name
                w.error = ClosedError(f"group {name!r} was destroyed while {w.describe()} was "
                                      f"still running on the GPU", queue=name, peers=(w.peer,))
        self._pending.clear()

    # ------------------------------------------------------------------ helpers
    def _enqueue(self, fn: Any, tensors: list[torch.Tensor],
                 entry: list[Any] | None = None) -> Any:
        """Run ``fn(stream)`` on the side stream after the current stream's work;
        returns the event recorded after it. ``entry`` (a recorder entry) gets
        CUDA-event marks of the transfer (:mod:`coordinator.trace.cuda_marks`)."""
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self._group.device))
        with torch.cuda.stream(s):
            marks = None if entry is None else CudaMarks(None, s, None)
            fn(s)
            for t in tensors:
                t.record_stream(s)
            ev = torch.cuda.Event()
            ev.record(s)
            if marks is not None and entry is not None:
                marks.finish()
                entry[DEVICE] = marks
        return ev

    def _send(self, t: torch.Tensor, dst: int, s: Any) -> None:
        g = self._group
        nccl = getattr(g.comm, "pynccl", None)
        if nccl is not None:
            nccl.send(t, dst, stream=s)
        else:
            dist.send(wire_view(t), dst=g.ranks[dst], group=g.device_group)

    def _recv(self, t: torch.Tensor, src: int, s: Any) -> None:
        g = self._group
        nccl = getattr(g.comm, "pynccl", None)
        if nccl is not None:
            nccl.recv(t, src, stream=s)
        else:
            dist.recv(wire_view(t), src=g.ranks[src], group=g.device_group)

    def _send_all(self, tensors: list[torch.Tensor], dst: int, s: Any) -> None:
        for t in tensors:
            self._send(t, dst, s)

    def _recv_all(self, tensors: list[torch.Tensor], src: int, s: Any) -> None:
        for t in tensors:
            self._recv(t, src, s)

    def _handle(self, op: str, peer: int, seq: int, ev: Any, result: Any,
                cpu: Work | None = None,
                finish: Callable[[Any], Any] | None = None) -> P2PHandle:
        g = self._group
        w = EventWork(op, peer, seq, ev, g.device, result, self._errors, cpu)
        self._pending = [p for p in self._pending if not p.done()] + [w]
        return P2PHandle(w, g.timeout, finish)

    # ------------------------------------------------------------------ the gloo side of a dict
    def _send_meta(self, meta: list[Any], cpu: list[torch.Tensor], dst: int) -> None:
        """The gloo part of a CUDA group's tensor dict: metadata, then its CPU tensors."""
        g = self._group
        self._objects.send(meta, dst, object_comm.DICT_META)
        for t in cpu:
            dist.send(wire_view(t), dst=g.ranks[dst], group=g.cpu_group)

    def _recv_meta(self, src: int, gather: AllGatherGroup | None,
                   ) -> tuple[SlicedDict, list[torch.Tensor], str]:
        """Receive the gloo part; returns the dict (CUDA tensors allocated, not yet
        filled; a tensor sliced for ``gather`` as this rank's slice), those CUDA
        tensors in order, and what is wrong with the dict ("" when nothing).

        A tensor the sender sliced into other than ``gather``'s size (or with no
        ``gather``) is received all the same, as the slice the sender sends, and
        reported afterwards: a receive left unposted would leave its bytes on the
        gloo pair, where the next receive from ``src`` would take them (gloo
        aborts the process when they are longer than that receive).
        """
        g = self._group
        meta = check_metadata(self._objects.recv(src, object_comm.DICT_META), g.device.type, src)
        out: dict[Any, Any] = {}
        sliced: list[tuple[Any, torch.Tensor, tuple[int, ...]]] = []
        on_gpu: list[torch.Tensor] = []
        problem = ""
        have = gather.world_size if gather is not None else None
        for key, kind, value in meta:
            if kind != TENSOR:  # an honest sender inlines no tensor here; a peer's may be odd
                out[key] = plain(value) if kind == INLINE else value
                continue
            parts = int(value[3])
            t = alloc(value, g.device, parts or 1)
            if not parts:
                out[key] = t
            elif parts == have:
                out[key] = t
                sliced.append((key, t, tuple(value[2])))
            else:
                given = ("no all_gather_group" if have is None
                         else f"an all_gather_group of size {have}")
                problem = problem or (
                    f"irecv_tensor_dict: the sender sliced tensor {key!r} into {parts} parts "
                    f"for an all-gather, but irecv_tensor_dict was called with {given}; pass "
                    f"the same kind of all_gather_group on both sides")
            if not t.numel():
                continue
            if t.device.type == "cpu":
                dist.recv(wire_view(t), src=g.ranks[src], group=g.cpu_group)
            else:
                on_gpu.append(t)
        return SlicedDict(out, sliced), on_gpu, problem
