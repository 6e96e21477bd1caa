"""Asynchronous point-to-point calls of a CUDA group: NCCL on a side stream, with events.

Imported by :mod:`coordinator.p2p.async_p2p` at a CUDA group's first asynchronous
call (never at module load). Not exercised in CI (no GPU there): only its
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
ordering rule of :mod:`coordinator.p2p.async_p2p`. NCCL matches a send only with
a receive posted by its peer; as for NCCL's own blocking send/recv, two ranks
that each issue ``isend`` before ``irecv`` to one another need the peer to
post its receive (NCCL buffers small messages; large ones may wait): order
such exchanges by rank parity, or receive first on one side.

Tensor dicts: the metadata (and any CPU tensors of the dict) travel over the
group's gloo side exactly as in the blocking calls. ``isend_tensor_dict``
queues that part on the sending thread of :mod:`coordinator.p2p.async_p2p` and
enqueues the CUDA tensors' sends at once; ``irecv_tensor_dict`` must know the
shapes before it can enqueue receives in issue order, so it receives the
metadata (and CPU tensors) on the caller's thread, in its turn, and only the
CUDA payload is asynchronous.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from coordinator.errors import ClosedError
from coordinator.group import object_comm
from coordinator.group.call_errors import WAIT_ERRORS
from coordinator.p2p import tensor_dict as tensor_dict_ops
from coordinator.p2p.async_p2p import SEND, P2PHandle, ordered, submit
from coordinator.p2p.channels import Work
from device_comms.torch_dist.torch_communicator import wire_view

if TYPE_CHECKING:
    from coordinator.group.group_coordinator import GroupCoordinator

__all__ = ["CudaP2P", "EventWork"]

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
        coord: The group (its communicator's ``pynccl`` carries the tensors;
            without one, ``torch.distributed`` on the device group does).
    """

    def __init__(self, coord: GroupCoordinator) -> None:
        self.coord = coord
        self.stream = torch.cuda.Stream(device=coord.device)
        self._pending: list[EventWork] = []

    # ------------------------------------------------------------------ tensors
    def isend(self, t: torch.Tensor, dst: int, seq: int) -> P2PHandle:
        ev = self._enqueue(lambda s: self._send(t, dst, s), [t])
        return self._handle("isend", dst, seq, ev, None)

    def irecv(self, buf: torch.Tensor | None, size: torch.Size, dtype: torch.dtype, src: int,
              seq: int) -> P2PHandle:
        out = torch.empty(size, dtype=dtype, device=self.coord.device) if buf is None else buf
        target = out if out.is_contiguous() else torch.empty_like(
            out, memory_format=torch.contiguous_format)

        def run(s: Any) -> None:
            self._recv(target, src, s)
            if target is not out:
                with torch.no_grad():  # as for a CPU receive into a buffer that requires grad
                    out.copy_(target)

        ev = self._enqueue(run, [target, out])
        return self._handle("irecv", src, seq, ev, out)

    # ------------------------------------------------------------------ tensor dicts
    def isend_tensor_dict(self, d: dict[Any, Any], dst: int, seq: int) -> P2PHandle:
        coord = self.coord
        meta, payload = tensor_dict_ops.flatten_tensor_dict(d, device=coord.device)
        on_gpu = [t.contiguous() for t in payload if t.numel() and t.device.type == "cuda"]
        on_cpu = [t.contiguous() for t in payload if t.numel() and t.device.type == "cpu"]
        cpu = submit(coord, SEND, dst, "isend_tensor_dict", seq, _send_meta, coord, meta,
                     on_cpu, dst)
        ev = self._enqueue(lambda s: [self._send(t, dst, s) for t in on_gpu], on_gpu)
        return self._handle("isend_tensor_dict", dst, seq, ev, None, cpu)

    def irecv_tensor_dict(self, src: int, seq: int) -> P2PHandle:
        coord = self.coord
        try:
            out, on_gpu = ordered(coord, "recv", src, "irecv_tensor_dict", _recv_meta, coord, src)
        except WAIT_ERRORS as e:  # a failed wait: translated like every other call's
            coord._errors.explain("irecv_tensor_dict", seq, e, partner=src)
            raise
        ev = self._enqueue(lambda s: [self._recv(t, src, s) for t in on_gpu], on_gpu)
        return self._handle("irecv_tensor_dict", src, seq, ev, out)

    # ------------------------------------------------------------------ closing
    def close(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for enqueued transfers (NCCL work cannot be
        cancelled); the ones still running fail their handles with ``ClosedError``."""
        deadline = time.monotonic() + grace
        for w in self._pending:
            if not w.block(max(0.0, deadline - time.monotonic())) and w.error is None:
                w.error = ClosedError(f"group {self.coord.unique_name!r} was destroyed while "
                                      f"{w.describe()} was still running on the GPU",
                                      queue=self.coord.unique_name, peers=(w.peer,))
        self._pending.clear()

    # ------------------------------------------------------------------ helpers
    def _enqueue(self, fn: Any, tensors: list[torch.Tensor]) -> Any:
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.coord.device))
        with torch.cuda.stream(s):
            fn(s)
            for t in tensors:
                t.record_stream(s)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def _send(self, t: torch.Tensor, dst: int, s: Any) -> None:
        nccl = getattr(self.coord.comm, "pynccl", None)
        if nccl is not None:
            nccl.send(t, dst, stream=s)
        else:
            dist.send(wire_view(t), dst=self.coord.ranks[dst], group=self.coord.device_group)

    def _recv(self, t: torch.Tensor, src: int, s: Any) -> None:
        nccl = getattr(self.coord.comm, "pynccl", None)
        if nccl is not None:
            nccl.recv(t, src, stream=s)
        else:
            dist.recv(wire_view(t), src=self.coord.ranks[src], group=self.coord.device_group)

    def _handle(self, op: str, peer: int, seq: int, ev: Any, result: Any,
                cpu: Work | None = None) -> P2PHandle:
        w = EventWork(op, peer, seq, ev, self.coord.device, result, self.coord._errors, cpu)
        self._pending = [p for p in self._pending if not p.done()] + [w]
        return P2PHandle(w, self.coord.timeout)


def _send_meta(coord: GroupCoordinator, meta: list[Any], cpu: list[torch.Tensor],
               dst: int) -> None:
    """The gloo part of a CUDA group's tensor dict: metadata, then its CPU tensors."""
    coord._send_object(meta, dst, object_comm.DICT_META)
    for t in cpu:
        dist.send(wire_view(t), dst=coord.ranks[dst], group=coord.cpu_group)


def _recv_meta(coord: GroupCoordinator, src: int) -> tuple[dict[Any, Any], list[torch.Tensor]]:
    """Receive the gloo part; returns the dict (CUDA tensors allocated, not yet filled)
    and those CUDA tensors in order."""
    meta = tensor_dict_ops.check_metadata(coord._recv_object(src, object_comm.DICT_META), coord.device.type)
    out: dict[Any, Any] = {}
    on_gpu: list[torch.Tensor] = []
    for key, kind, value in meta:
        if kind != tensor_dict_ops.TENSOR:
            out[key] = value
            continue
        if value[3]:
            raise ValueError(f"irecv_tensor_dict: the sender sliced tensor {key!r} for an "
                             f"all-gather, which asynchronous receives do not do")
        t = out[key] = tensor_dict_ops._alloc(value, coord.device)
        if not t.numel():
            continue
        if t.device.type == "cpu":
            dist.recv(wire_view(t), src=coord.ranks[src], group=coord.cpu_group)
        else:
            on_gpu.append(t)
    return out, on_gpu
