"""``CudaCommunicator``: CUDA tensors through NCCL called directly (ctypes).

Every accelerated op goes to a :class:`~device_comms.cuda.pynccl.PyNcclCommunicator`
built over the group's CPU side at construction (collective), so each op is
one NCCL launch (or one fused group) on the current stream, safe inside CUDA
graph capture. All-reduce first asks an optional ``custom_ar`` (a one-node
custom all-reduce, plugged in by its owner): when it takes the tensor, NCCL is
not used. ``scatter`` and ``all_to_all`` keep the ``torch.distributed``
implementation over ``device_group``. ``all_to_allv`` agrees on every rank's
sizes over the CPU group (a host-side exchange; mismatched sizes and rejected
arguments raise on every rank), then runs as grouped NCCL send/recv.
``all_gatherv_rows`` exchanges the row counts the same way when the caller
does not give them, then gathers every tensor in one NCCL group of
broadcasts straight into the outputs (no packing).

Aborts (:meth:`~device_comms.base.DeviceCommunicator.abort`, a watchdog's):
the NCCL communicator is aborted from the aborting thread (``ncclCommAbort``,
see :mod:`device_comms.cuda.pynccl.communicator`), which ends the NCCL work in
flight, and the custom all-reduce is marked broken. Not verified on a GPU yet.

Rejected calls: a rank whose own arguments fail validation raises locally; its
peers are not told (except where sizes are exchanged over the CPU group first:
``all_to_allv``, and ``all_gatherv_rows`` without ``sizes``) (as for every GPU transport, see
:meth:`DeviceCommunicator._reject`) and wait as NCCL does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from device_comms import row_gather
from device_comms.cuda.pynccl.communicator import PyNcclCommunicator
from device_comms.errors import DecodeError, PeerRejectedError, add_note
from device_comms.reduce_op import ReduceOp
from device_comms.torch_dist import gloo_alltoallv
from device_comms.torch_dist.torch_communicator import TorchDistributedCommunicator
from shm_broadcast.checks import check_timeout
from shm_broadcast.describe import describe
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.timeouts import default_timeout

if TYPE_CHECKING:
    from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce

__all__ = ["CudaCommunicator"]

#: Seconds an abort waits for NCCL to release the communicator (the release
#: goes on by itself after that; the aborting thread has other groups to watch).
_ABORT_WAIT_S = 10.0


class CudaCommunicator(TorchDistributedCommunicator):
    """NCCL (through ctypes) for CUDA tensors; torch.distributed for the rest.

    Args:
        cpu_group: A gloo group over the same ranks (carries the NCCL unique id).
        device: This rank's CUDA device.
        device_group: The torch.distributed group used by the fallbacks.
        unique_name: The owning group's unique name.
        use_custom_allreduce: False never builds the custom all-reduce; None
            (default) builds it unless ``GROUPCOORD_DISABLE_CUSTOM_ALLREDUCE``
            is set or ``set_custom_all_reduce(False)`` was called (those two
            also override True). Either way every rank agrees on the outcome.
        custom_allreduce_max_size: Largest message for the custom all-reduce
            in bytes (default 8 MiB).
        timeout: Seconds a custom all-reduce kernel waits for a peer (default:
            ``GROUPCOORD_TIMEOUT``, else 300; 0 polls once).

    Attributes:
        pynccl: The NCCL communicator (None for a group of one, which never communicates).
        custom_ar: The custom all-reduce (``should_use(t)``, ``all_reduce(t)``,
            ``capture()``, ``close()``), or None.
        custom_ar_reason: Why ``custom_ar`` is None ("" when it is set).
    """

    name = "cuda"
    device_types = frozenset({"cuda"})
    priority = 10

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        device: torch.device,
        device_group: dist.ProcessGroup | None = None,
        unique_name: str = "",
        *,
        use_custom_allreduce: bool | None = None,
        custom_allreduce_max_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, timeout=timeout)
        if use_custom_allreduce is not None and not isinstance(use_custom_allreduce, bool):
            raise TypeError(
                "use_custom_allreduce must be a bool or None, got "
                f"{type(use_custom_allreduce).__name__}"
            )
        self.custom_ar: CustomAllreduce | None = None
        self.custom_ar_reason = "world size 1" if self.world_size == 1 else ""
        self.pynccl: PyNcclCommunicator | None = (
            self._make_pynccl() if self.world_size > 1 else None
        )
        if self.world_size > 1:
            try:
                self._make_custom_ar(use_custom_allreduce, custom_allreduce_max_size, timeout)
            except BaseException as e:  # the NCCL communicator made above goes with this one
                if self.pynccl is not None:
                    try:
                        self.pynccl.close(abort=True)
                    except Exception as close_error:  # the setup's failure is the one raised
                        add_note(e, f"closing the NCCL communicator also failed: {close_error}")
                raise

    def _make_pynccl(self) -> PyNcclCommunicator:
        """Build the NCCL communicator (collective over ``cpu_group``)."""
        return PyNcclCommunicator(self.cpu_group, self.device)

    def _make_custom_ar(
        self, use: bool | None, max_size: int | None, timeout: float | None
    ) -> None:
        """Build the custom all-reduce (collective: every rank takes part, and agrees)."""
        from device_comms.cuda.custom_allreduce import eligibility as elig

        if self.device.type != "cuda":
            self.custom_ar_reason = f"device {self.device} is not a CUDA device"
            return  # every rank of a group has the same device type
        if self.world_size not in elig.SUPPORTED_WORLD_SIZES:
            self.custom_ar_reason = f"world size {self.world_size} is not one of 2, 4, 6, 8"
            return  # every rank sees the same world size: no exchange needed
        checked = check_timeout(timeout)
        # A group timeout of 0 (poll once) is no time for a kernel to wait for its peers.
        wait_s = checked if checked else default_timeout()
        size = elig.DEFAULT_MAX_SIZE if max_size is None else elig.check_max_size(max_size)
        cupy_ok = _cupy_imports()
        enabled = use is not False and cupy_ok
        from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce

        car = CustomAllreduce(
            self.cpu_group, self.device, size, enabled=enabled, timeout=wait_s,
            unique_name=self.unique_name or "custom-allreduce",
        )
        if car.disabled:
            self.custom_ar_reason = car.reason + ("" if cupy_ok else " (CuPy does not import here)")
            car.close()
            return
        self.custom_ar = car

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA device is visible and the NCCL library loads (never raises)."""
        try:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                return False
            from device_comms.cuda.pynccl.library import load_library

            load_library()
        except Exception:
            return False
        return True

    @property
    def _nccl(self) -> PyNcclCommunicator:
        if self.pynccl is None:  # only a group of one, whose ops never reach a hook
            raise RuntimeError(
                f"group {self.unique_name!r} has no NCCL communicator (world size 1)"
            )
        return self.pynccl

    # --- reductions -----------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        car = self.custom_ar
        if car is not None and op is ReduceOp.SUM and car.should_use(t):
            return car.all_reduce(t)
        return self._nccl.all_reduce(t, op=op)

    def _reduce(self, t: torch.Tensor, dst: int, op: ReduceOp) -> torch.Tensor | None:
        out = torch.empty_like(t) if self.rank_in_group == dst else None
        self._nccl.reduce(t, out, dst, op)
        return out

    def _reduce_scatter(self, t: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.world_size,) + x.shape[1:])
        self._nccl.reduce_scatter(out, x, op)
        return out.movedim(0, dim).contiguous()

    def _reduce_scatterv(
        self, t: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((sizes[self.rank_in_group],) + x.shape[1:])
        self._nccl.reduce_scatterv(out, x, sizes, op)
        return out.movedim(0, dim).contiguous()

    # --- data movement ----------------------------------------------------------
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        out = t.new_empty((self.world_size,) + t.shape)
        self._nccl.all_gather(out, t)
        return _concat_ranks(out, dim)

    def _all_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((sum(sizes),) + x.shape[1:])
        self._nccl.all_gatherv(out, x, sizes)
        return out.movedim(0, dim).contiguous()

    def _all_gatherv_rows(
        self, ts: list[torch.Tensor], sizes: list[int] | None
    ) -> tuple[list[torch.Tensor], list[int]]:
        # No packing: one NCCL group of every tensor's per-rank broadcasts, written
        # straight into each output.
        if sizes is None:
            sizes = self._row_counts(ts[0].shape[0])
            row_gather.check_counts_fit(sizes, ts, self.unique_name)
        outs = [t.new_empty((sum(sizes), *t.shape[1:])) for t in ts]
        nccl = self._nccl
        with nccl.grouped():
            for out, t in zip(outs, ts, strict=True):
                nccl.all_gatherv(out, t, sizes)
        return outs, sizes

    def _row_counts(self, n: int) -> list[int]:
        # Over the CPU group (host-side, no stream synchronisation), where a rank
        # that rejected its arguments says so (:meth:`_abort_collective`).
        return _settle_counts(self, object_group(self.cpu_group).all_gather(["ok", n]))

    def _gather(self, t: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        if self.rank_in_group != dst:
            self._nccl.gather(None, t, dst)
            return None
        out = t.new_empty((self.world_size,) + t.shape)
        self._nccl.gather(out, t, dst)
        return _concat_ranks(out, dim)

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return self._nccl.broadcast(t, src)

    def _all_to_allv(
        self, t: torch.Tensor, send: list[int], recv: list[int] | None
    ) -> torch.Tensor:
        # The sizes are agreed over the CPU group first (host-side msgpack, no stream
        # synchronisation): NCCL pairs a send only with a receive of the same size.
        got = gloo_alltoallv.exchange_sizes(self, send, recv)
        out = t.new_empty((sum(got),) + t.shape[1:])
        return self._nccl.all_to_allv(out, t, send, got)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self._nccl.send(t, dst)

    def _recv(self, size: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(size, dtype=dtype, device=self.device)
        return self._nccl.recv(out, src)

    def _abort_collective(self, op: str, message: str, *meta: Any) -> None:
        """NCCL ops carry no "rejected" mark: peers of a rejecting rank are not told,
        except in ``all_to_allv``, whose sizes are agreed over the CPU group first."""
        if op == "all_to_allv":
            self._guard(op, gloo_alltoallv.reject_exchange, self, message)
        elif op == "all_gatherv_rows":  # the row counts are exchanged over the CPU group first
            everyone = object_group(self.cpu_group).all_gather(["rejected", message[:4000]])
            with contextlib.suppress(PeerRejectedError):  # this rank raises its own error
                _settle_counts(self, everyone)

    # --- lifecycle ----------------------------------------------------------------
    def _abort(self) -> None:
        """Break the custom all-reduce and ``ncclCommAbort`` the NCCL communicator
        (from the aborting thread; see :meth:`PyNcclCommunicator.abort`). NCCL ends
        its work in flight; a custom all-reduce kernel in flight ends at its own
        timeout. ``scatter``/``all_to_all`` of ``device_group`` are not stopped."""
        car, nccl = self.custom_ar, self.pynccl
        why = f"{type(self.broken).__name__}: {self.broken}"
        if car is not None:
            car.abort(why)
        if nccl is not None:
            nccl.abort(timeout=_ABORT_WAIT_S)

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Enter ``custom_ar.capture()`` around the capture when a custom all-reduce is set."""
        if self.custom_ar is None:
            yield
            return
        with self.custom_ar.capture():
            yield

    def destroy(self) -> None:
        """Close the custom all-reduce and the NCCL communicator; idempotent."""
        car, self.custom_ar = self.custom_ar, None
        nccl, self.pynccl = self.pynccl, None
        try:
            if car is not None:
                car.close()
        finally:
            try:
                if nccl is not None:
                    nccl.close()
            finally:
                super().destroy()


def _settle_counts(comm: CudaCommunicator, everyone: list[Any]) -> list[int]:
    """Every rank's row count from the CPU-group exchange of ``["ok", n]`` /
    ``["rejected", reason]`` records.

    Raises:
        PeerRejectedError: Another rank rejected its arguments.
        DecodeError: A record is malformed.
    """
    name, counts = comm.unique_name, []
    for q, item in enumerate(everyone):
        ok = (type(item) is list and len(item) == 2 and type(item[0]) is str
              and item[0] in ("ok", "rejected"))
        if ok and item[0] == "ok" and not (type(item[1]) is int and item[1] >= 0):
            ok = False
        if not ok:
            raise DecodeError(f"group {name!r}, op all_gatherv_rows: rank {q} sent "
                              f"{describe(item)}", queue=name, peers=(q,))
        if item[0] == "rejected":
            if q != comm.rank_in_group:
                raise PeerRejectedError(name, "all_gatherv_rows", q, str(item[1]))
            counts.append(0)
        else:
            counts.append(item[1])
    return counts


def _cupy_imports() -> bool:
    """Whether CuPy imports (the custom all-reduce compiles its kernels with it)."""
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _concat_ranks(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``(n, *shape)`` -> ``shape`` with ``dim`` ``n`` times longer (rank-major concat)."""
    n, shape = stacked.shape[0], list(stacked.shape[1:])
    if dim == 0:
        return stacked.reshape([n * shape[0]] + shape[1:])
    shape[dim] *= n
    return stacked.movedim(0, dim).reshape(shape).contiguous()
