"""``PyNcclCommunicator``: NCCL collectives on CUDA tensors, called through ctypes.

Setup is collective over the group's CPU side: group rank 0 creates an
``ncclUniqueId``, the 128 bytes reach every rank (:mod:`.bootstrap`), the
ranks agree that each could load NCCL, then each calls ``ncclCommInitRank``
with its device current.

**The capture rule.** Every operation enqueues its NCCL kernel(s) on
``torch.cuda.current_stream(device)`` (or the ``stream`` passed; see
:mod:`.streams`) and makes no other CUDA call on the way: no synchronisation,
no ``cudaGetDevice``, no host<->device copy; pointers come from
``tensor.data_ptr()``. An operation issued while a CUDA graph is being
captured on that stream is therefore recorded into the graph and replays with
it, reading and writing the same addresses. The only device work besides NCCL
is what a dtype conversion needs (``int16``/``uint16`` reductions are widened
to ``int32`` and cast back; a gather copies this rank's own piece), all
stream-ordered kernels that capture as well. Under capture, pass tensors whose
memory outlives the graph.

Arguments are checked before anything is enqueued (wrong device,
non-contiguous, mismatched sizes or dtypes, unsupported dtype/op:
``TypeError``/``ValueError`` naming the argument; see :mod:`.arguments` and
:mod:`.types`). While disabled (:meth:`PyNcclCommunicator.disable`,
:meth:`PyNcclCommunicator.paused`) every operation raises
:class:`~device_comms.errors.CommunicatorUnavailable`; it never silently does
nothing.

Ranks are ranks within the group (``0 .. world_size-1``). As with NCCL itself,
every rank must issue the same operations in the same order with matching
sizes; a mismatch is not detected and hangs or corrupts. A rank that fails
inside ``ncclCommInitRank`` leaves its peers waiting in NCCL's bootstrap.

**Aborting.** :meth:`PyNcclCommunicator.abort` may be called from any thread
(a watchdog's) while the owner's thread uses the communicator. NCCL's calls
on one communicator are not thread-safe, so every operation holds a lock
(re-entrant: :meth:`~PyNcclCommunicator.grouped` holds it from
``ncclGroupStart`` to ``ncclGroupEnd`` and the operations inside take it
again) while it reads the communicator handle and launches; ``abort`` takes
the lock, swaps the handle for None and releases the lock, then calls
``ncclCommAbort``. An operation that checks afterwards raises
:class:`~device_comms.errors.CommunicatorClosed`; one that checked before but
takes the lock after the swap hands NCCL a NULL communicator, which NCCL
refuses (:class:`~device_comms.errors.NcclError`); one that read the handle
finished its launch before the swap. The one exception: a launch
that holds the lock longer than :data:`LAUNCH_WAIT_S` is blocked inside
NCCL (a blocking communicator waiting for a peer to connect), and
``ncclCommAbort`` is called anyway, concurrently with it, because NCCL's
abort is how such a wait ends and the alternative is to wait forever. Work
already on the stream is ended by NCCL's abort: its results are invalid.
On one H200 at world size 1, an abort from another thread while an
all-reduce sat queued behind about 1.5 s of device work returned after those
1.5 s (that work could complete, and NCCL let it), later calls raised
:class:`~device_comms.errors.CommunicatorClosed` and the device stayed usable
(``tests/gpu/test_watchdog_cuda.py``). A launch blocked inside NCCL, and the
abort of work that waits for a peer, need two GPUs: not verified.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from device_comms import validation
from device_comms.cuda.pynccl import all_to_allv as a2av
from device_comms.cuda.pynccl import bootstrap
from device_comms.cuda.pynccl.arguments import (
    check_device,
    check_operand,
    check_peer,
    check_rows,
    check_same,
)
from device_comms.cuda.pynccl.library import (
    NCCL_IN_PROGRESS,
    NCCL_SUCCESS,
    format_version,
    load_library,
)
from device_comms.cuda.pynccl.streams import (
    current_torch_stream,
    device_context,
    made_current,
    on_stream,
)
from device_comms.cuda.pynccl.types import (
    DATATYPE_CODES,
    ReducePlan,
    as_reduce_op,
    bytes_view,
    reduction_plan,
)
from device_comms.errors import (
    CollectiveTimeout,
    CommunicatorClosed,
    CommunicatorUnavailable,
    NcclError,
    add_note,
)
from device_comms.reduce_op import ReduceOp

__all__ = ["PyNcclCommunicator", "LAUNCH_WAIT_S"]

#: Seconds :meth:`PyNcclCommunicator.abort` waits for a launch in progress on
#: another thread before it aborts anyway (a launch takes microseconds; one
#: that holds on this long is blocked inside NCCL, waiting for a peer).
LAUNCH_WAIT_S = 1.0
_UINT8 = DATATYPE_CODES["ncclUint8"]


class PyNcclCommunicator:
    """One NCCL communicator over the ranks of ``group``, bound to ``device``.

    Args:
        group: The group's CPU side: a gloo ``torch.distributed.ProcessGroup``
            or a stateless group (``rank``, ``world_size``, ``broadcast_obj``).
        device: This rank's CUDA device (``"cuda:1"``, an index, a torch.device).
        library: An :class:`~device_comms.cuda.pynccl.library.NcclLibrary` (default:
            the discovered one). An injected library (tests) may serve CPU devices.

    Raises:
        CommunicatorUnavailable: NCCL cannot be loaded on some rank.
        NcclError: ``ncclCommInitRank`` failed.
    """

    def __init__(self, group: Any, device: torch.device | str | int, library: Any = None) -> None:
        # Held while operations are launched; abort() takes it (see "Aborting").
        self._launch = threading.RLock()
        self.rank, self.world_size = bootstrap.group_rank_and_size(group)
        self.group = group
        self._comm: Any = None
        self._disabled = False
        self._group_depth = 0
        # (step, the stream it runs on) to run once the outermost group launched
        self._after_group: list[tuple[Callable[[], Any], Any]] = []
        # Tensors the operations of the open group read or write: NCCL enqueues a
        # grouped operation's kernels at ncclGroupEnd, so a buffer freed before
        # that could go to a later allocation whose kernels run first (the caching
        # allocator reuses a block once the frees on its stream are enqueued).
        self._held: list[torch.Tensor] = []
        error: BaseException | None = None
        try:
            self.device = check_device(device, injected=library is not None)
            self.lib = library if library is not None else load_library()
            self.nccl_version: int = self.lib.version()
        except (TypeError, ValueError, CommunicatorUnavailable, NcclError) as e:
            error, self.lib = e, bootstrap.UnusableLibrary(e)
        uid = bootstrap.exchange_unique_id(group, self.lib)
        failed = bootstrap.ranks_failed(group, error is not None)
        if error is not None:
            raise error
        if failed:
            raise CommunicatorUnavailable(
                f"rank {self.rank}: group rank(s) {failed} could not set up NCCL (see their "
                f"errors); no communicator was created"
            )
        with device_context(self.device):
            self._comm = self.lib.comm_init_rank(self.world_size, uid, self.rank)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("disabled" if self._disabled else "ready")
        return (f"PyNcclCommunicator(rank {self.rank}/{self.world_size}, {self.device}, "
                f"NCCL {format_version(self.nccl_version)}, {state})")

    # ------------------------------------------------------------------ reductions
    def all_reduce(
        self,
        in_: torch.Tensor,
        out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
        stream: Any = None,
    ) -> torch.Tensor:
        """Reduce ``in_`` over the group into ``out`` (allocated when None; may be ``in_``).

        Returns:
            ``out``.
        """
        self._check_usable("all_reduce")
        x = check_operand(in_, "in_", self.device)
        plan = self._plan(x.dtype, op)
        if out is not None:
            check_same(check_operand(out, "out", self.device), x, "out", "in_", x.numel())
        with self._launch, on_stream(stream, self.device) as s:
            out = torch.empty_like(x) if out is None else out

            def issue(send: torch.Tensor, recv: torch.Tensor) -> None:
                self.lib.all_reduce(send.data_ptr(), recv.data_ptr(), send.numel(), plan.dtype,
                                    plan.op, self._comm, s)

            self._reduction(plan, x, out, issue, send_count=_send_count(x, plan))
        return out

    def reduce_scatter(
        self, out: torch.Tensor, in_: torch.Tensor, op: ReduceOp = ReduceOp.SUM, stream: Any = None
    ) -> torch.Tensor:
        """Reduce ``in_`` (``world_size`` equal flat pieces); rank ``i`` gets piece ``i``."""
        self._check_usable("reduce_scatter")
        x, o = check_operand(in_, "in_", self.device), check_operand(out, "out", self.device)
        plan = self._plan(x.dtype, op)
        validation.check_divisible(x.numel(), self.world_size, "in_.numel()")
        check_same(o, x, "out", "in_", x.numel() // self.world_size,
                   what="in_.numel() / world_size")
        with self._launch, on_stream(stream, self.device) as s:

            def issue(send: torch.Tensor, recv: torch.Tensor) -> None:
                self.lib.reduce_scatter(send.data_ptr(), recv.data_ptr(), recv.numel(), plan.dtype,
                                        plan.op, self._comm, s)

            self._reduction(plan, x, o, issue, send_count=_send_count(o, plan))
        return o

    def reduce(
        self,
        in_: torch.Tensor,
        out: torch.Tensor | None,
        root: int,
        op: ReduceOp = ReduceOp.SUM,
        stream: Any = None,
    ) -> torch.Tensor | None:
        """Reduce ``in_`` onto group rank ``root``'s ``out`` (``out`` may be None elsewhere).

        Returns:
            ``out`` (None on other ranks when they passed None).
        """
        self._check_usable("reduce")
        x = check_operand(in_, "in_", self.device)
        root = validation.check_rank(root, self.world_size, "root")
        plan = self._plan(x.dtype, op)
        if self.rank == root and out is None:
            raise ValueError(f"out must be a tensor on the root rank {root}, got None")
        if out is not None:
            check_same(check_operand(out, "out", self.device), x, "out", "in_", x.numel())
        with self._launch, on_stream(stream, self.device) as s:

            def issue(send: torch.Tensor, recv: torch.Tensor | None) -> None:
                self.lib.reduce(send.data_ptr(), None if recv is None else recv.data_ptr(),
                                send.numel(), plan.dtype, plan.op, root, self._comm, s)

            self._reduction(plan, x, out if self.rank == root else None, issue,
                            send_count=_send_count(x, plan))
        return out

    def reduce_scatterv(
        self,
        out: torch.Tensor,
        in_: torch.Tensor,
        sizes: Sequence[int],
        op: ReduceOp = ReduceOp.SUM,
        stream: Any = None,
    ) -> torch.Tensor:
        """Reduce ``in_``; rank ``i`` gets the ``sizes[i]`` rows (dim 0) after ``sum(sizes[:i])``.

        Runs as one grouped ``ncclReduce`` per rank (each rank the root of its rows).
        """
        self._check_usable("reduce_scatterv")
        x, o = check_operand(in_, "in_", self.device), check_operand(out, "out", self.device)
        plan = self._plan(x.dtype, op)
        sz = check_rows(o, x, sizes, "out", "in_", gathered="in_", rank=self.rank,
                        world_size=self.world_size)
        inner = math.prod(x.shape[1:]) * plan.factor
        with self._launch, on_stream(stream, self.device) as s:

            def issue(send: torch.Tensor, recv: torch.Tensor) -> None:
                step = send.element_size() * inner
                with self.grouped():
                    off = send.data_ptr()
                    for r, rows in enumerate(sz):
                        if rows:
                            self.lib.reduce(off, recv.data_ptr() if r == self.rank else None,
                                            rows * inner, plan.dtype, plan.op, r, self._comm, s)
                        off += rows * step

            self._reduction(plan, x, o, issue, send_count=_send_count(x, plan))
        return o

    # ------------------------------------------------------------------ data movement
    def all_gather(self, out: torch.Tensor, in_: torch.Tensor, stream: Any = None) -> torch.Tensor:
        """Concatenate every rank's flat ``in_`` (rank order) into ``out`` (dim 0 for
        tensors of the same shape); any dtype."""
        self._check_usable("all_gather")
        x, o = check_operand(in_, "in_", self.device), check_operand(out, "out", self.device)
        check_same(o, x, "out", "in_", x.numel() * self.world_size, what="in_.numel() * world_size")
        with self._launch, on_stream(stream, self.device) as s:
            src, dst = bytes_view(x, "in_"), bytes_view(o, "out")
            self._hold(x, o)
            if src.numel():
                self.lib.all_gather(src.data_ptr(), dst.data_ptr(), src.numel(), _UINT8,
                                    self._comm, s)
        return o

    def all_gatherv(
        self, out: torch.Tensor, in_: torch.Tensor, sizes: Sequence[int], stream: Any = None
    ) -> torch.Tensor:
        """Concatenate along dim 0 pieces of ``sizes[i]`` rows from rank ``i`` into ``out``.

        Runs as one grouped ``ncclBroadcast`` per rank into its slice of ``out``.
        """
        self._check_usable("all_gatherv")
        x, o = check_operand(in_, "in_", self.device), check_operand(out, "out", self.device)
        sz = check_rows(x, o, sizes, "in_", "out", gathered="out", rank=self.rank,
                        world_size=self.world_size)
        row = math.prod(o.shape[1:]) * o.element_size()
        with self._launch, on_stream(stream, self.device) as s:
            src, dst = bytes_view(x, "in_"), bytes_view(o, "out")
            self._hold(x, o)
            with self.grouped():
                off = dst.data_ptr()
                for r, rows in enumerate(sz):
                    if rows and row:
                        send = src.data_ptr() if r == self.rank else off
                        self.lib.broadcast(send, off, rows * row, _UINT8, r, self._comm, s)
                    off += rows * row
        return o

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> torch.Tensor:
        """Broadcast ``tensor`` from group rank ``src`` in place (any dtype); returns it."""
        self._check_usable("broadcast")
        t = check_operand(tensor, "tensor", self.device)
        src = validation.check_rank(src, self.world_size, "src")
        with self._launch, on_stream(stream, self.device) as s:
            buf = bytes_view(t, "tensor")
            self._hold(t)
            if buf.numel():
                self.lib.broadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(), _UINT8, src,
                                   self._comm, s)
        return t

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (which must :meth:`recv` the same bytes)."""
        self._check_usable("send")
        t = check_operand(tensor, "tensor", self.device)
        dst = check_peer(dst, "dst", self.rank, self.world_size)
        with self._launch, on_stream(stream, self.device) as s:
            buf = bytes_view(t, "tensor")
            self._hold(t)
            if buf.numel():
                self.lib.send(buf.data_ptr(), buf.numel(), _UINT8, dst, self._comm, s)

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> torch.Tensor:
        """Receive into ``tensor`` from group rank ``src``; returns it."""
        self._check_usable("recv")
        t = check_operand(tensor, "tensor", self.device)
        src = check_peer(src, "src", self.rank, self.world_size)
        with self._launch, on_stream(stream, self.device) as s:
            buf = bytes_view(t, "tensor")
            self._hold(t)
            if buf.numel():
                self.lib.recv(buf.data_ptr(), buf.numel(), _UINT8, src, self._comm, s)
        return t

    def gather(
        self, out: torch.Tensor | None, in_: torch.Tensor, dst: int, stream: Any = None
    ) -> torch.Tensor | None:
        """Concatenate every rank's flat ``in_`` (rank order) into ``out`` on rank ``dst``.

        Other ranks pass ``out=None``. Runs as grouped send/recv.
        """
        self._check_usable("gather")
        x = check_operand(in_, "in_", self.device)
        dst = validation.check_rank(dst, self.world_size, "dst")
        if self.rank == dst:
            if out is None:
                raise ValueError(f"out must be a tensor on the destination rank {dst}, got None")
            check_same(check_operand(out, "out", self.device), x, "out", "in_",
                       x.numel() * self.world_size, what="in_.numel() * world_size")
        with self._launch, on_stream(stream, self.device) as s:
            src = bytes_view(x, "in_")
            self._hold(x, out)
            if out is not None and self.rank == dst:
                self._gather_into(bytes_view(out, "out"), src, dst, s)
                return out
            if src.numel():
                with self.grouped():
                    self.lib.send(src.data_ptr(), src.numel(), _UINT8, dst, self._comm, s)
        return None

    def _gather_into(self, out: torch.Tensor, src: torch.Tensor, dst: int, s: int | None) -> None:
        """On ``dst``: copy this rank's bytes into place, receive every other rank's."""
        n = src.numel()
        out[dst * n:(dst + 1) * n].copy_(src)
        if not n:
            return
        with self.grouped():
            for r in range(self.world_size):
                if r != dst:
                    self.lib.recv(out.data_ptr() + r * n, n, _UINT8, r, self._comm, s)

    def all_to_allv(
        self, out: torch.Tensor, in_: torch.Tensor, send_sizes: Sequence[int],
        recv_sizes: Sequence[int], stream: Any = None,
    ) -> torch.Tensor:
        """Rows ``send_sizes[r]`` of ``in_`` (dim 0, rank order) to rank ``r``; rows from
        rank ``r`` into ``out`` in rank order. Grouped send/recv (:mod:`.all_to_allv`)."""
        self._check_usable("all_to_allv")
        o, x, send, recv = a2av.check_arguments(out, in_, send_sizes, recv_sizes, self.rank,
                                                self.world_size, self.device)
        with self._launch, on_stream(stream, self.device) as s:
            self._hold(o, x)
            a2av.all_to_allv(self.lib, self._comm, self.grouped, o, x, send, recv, self.rank, s)
        return o

    # ------------------------------------------------------------------ grouping
    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """``ncclGroupStart``/``ncclGroupEnd`` around the body (nests).

        Operations inside are fused and launched when the outermost group ends;
        a dtype conversion back (``int16`` reductions) runs after that.
        """
        self._check_usable("grouped")
        with self._launch:  # the group's operations launch at its end: abort() waits for it
            self.lib.group_start()
            self._group_depth += 1
            try:
                yield
            except BaseException as e:
                self._group_depth -= 1
                try:
                    self.lib.group_end()
                except NcclError as end_error:
                    add_note(e, f"ncclGroupEnd after the failure also failed: {end_error}")
                if self._group_depth == 0:
                    self._after_group.clear()
                    self._held.clear()
                raise
            self._group_depth -= 1
            pending: list[tuple[Callable[[], Any], Any]] = []
            held: list[torch.Tensor] = []
            if self._group_depth == 0:
                pending, self._after_group = self._after_group, []
                held, self._held = self._held, []
            self.lib.group_end()  # on failure the pending conversions are dropped with it
        # The kernels are enqueued now: the buffers may go once the conversions back
        # (on the streams their operations ran on) are enqueued too.
        for fn, stream in pending:
            with made_current(stream):
                fn()
        del held

    # ------------------------------------------------------------------ state
    def disable(self) -> None:
        """Refuse every operation (each raises CommunicatorUnavailable) until :meth:`enable`."""
        self._disabled = True

    def enable(self) -> None:
        """Accept operations again after :meth:`disable`."""
        self._disabled = False

    @property
    def disabled(self) -> bool:
        """Whether operations are refused."""
        return self._disabled

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Disabled inside the body; the previous state is restored on exit."""
        before = self._disabled
        self._disabled = True
        try:
            yield
        finally:
            self._disabled = before

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._comm is None

    def check_async_error(self) -> None:
        """Raise :class:`NcclError` if NCCL reports an asynchronous error (no synchronisation)."""
        if self._comm is None:
            raise self._closed_error("check_async_error")
        code = self.lib.comm_get_async_error(self._comm)
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(
                "ncclCommGetAsyncError", code,
                f"{self.lib.describe(code)} (asynchronous error of the communicator of rank "
                f"{self.rank}/{self.world_size}; close it with close(abort=True))",
            )

    def close(self, abort: bool | None = None, timeout: float = 60.0) -> None:
        """Release the NCCL communicator; idempotent.

        NCCL (2.26 and later) does not release a communicator while a CUDA
        graph that captured its operations is alive: delete such graphs (and
        ``torch.compile`` caches holding them) first. The release runs on a
        helper thread and this call waits at most ``timeout`` for it; if a
        graph still holds the communicator it raises, and the release
        finishes by itself once the last such graph is destroyed.

        Args:
            abort: True: ``ncclCommAbort`` (does not wait for peers or pending
                work). False: ``ncclCommDestroy``. None: abort only if
                ``ncclCommGetAsyncError`` reports an error.
            timeout: Seconds to wait for NCCL to release the communicator.

        Raises:
            CollectiveTimeout: NCCL did not release it within ``timeout``.
        """
        if self._comm is None:
            return
        comm, self._comm = self._comm, None
        if abort is None:
            try:
                code = self.lib.comm_get_async_error(comm)
                abort = code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS)
            except NcclError:
                abort = True
        release = self.lib.comm_abort if abort else self.lib.comm_destroy
        gc.collect()  # graphs that are only garbage let go of the communicator now
        who = f"rank {self.rank}/{self.world_size} ({self.device})"
        _release_bounded(release, comm, timeout, who)

    def abort(self, timeout: float = 60.0) -> bool:
        """``ncclCommAbort`` from any thread: NCCL ends the work in flight, which
        then never completes correctly (see "Aborting" in the module docstring).

        Afterwards the communicator is closed (every operation raises
        :class:`~device_comms.errors.CommunicatorClosed`). Waits at most
        :data:`LAUNCH_WAIT_S` for a launch in progress on another thread, then
        at most ``timeout`` for NCCL to release the communicator.

        Returns:
            Whether there was a communicator to abort (False once closed).

        Raises:
            CollectiveTimeout: NCCL did not release it within ``timeout``.
        """
        if self._comm is None:
            return False
        held = self._launch.acquire(timeout=LAUNCH_WAIT_S)
        try:
            comm, self._comm = self._comm, None
        finally:
            if held:
                self._launch.release()
        if comm is None:
            return False
        who = f"rank {self.rank}/{self.world_size} ({self.device})"
        _release_bounded(self.lib.comm_abort, comm, timeout, who)
        return True

    def destroy(self) -> None:
        """Same as :meth:`close` with ``abort=None``."""
        self.close()

    def __enter__(self) -> PyNcclCommunicator:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(abort=True if exc_type is not None else None)

    # ------------------------------------------------------------------ helpers
    def _check_usable(self, op: str) -> None:
        if self._comm is None:
            raise self._closed_error(op)
        if self._disabled:
            raise CommunicatorUnavailable(
                f"{op} on PyNcclCommunicator (rank {self.rank}/{self.world_size}, {self.device}) "
                f"refused: the communicator is disabled; call enable() (or leave paused()) first"
            )

    def _closed_error(self, op: str) -> CommunicatorClosed:
        return CommunicatorClosed(
            f"{op} on PyNcclCommunicator (rank {self.rank}/{self.world_size}): it was closed; "
            f"create a new one to communicate again"
        )

    def _plan(self, dtype: torch.dtype, op: Any) -> ReducePlan:
        return reduction_plan(dtype, as_reduce_op(op), self.nccl_version)

    def _reduction(self, plan: ReducePlan, x: torch.Tensor, out: torch.Tensor | None,
                   issue: Callable[..., None], send_count: int) -> None:
        """Run ``issue(send, recv)`` on flat wire views (a widened copy for int16/uint16)."""
        if send_count == 0:
            return  # every rank has zero elements: nothing to enqueue
        if plan.kind != "widen":
            self._hold(x, out)
            issue(plan.wire(x), None if out is None else plan.wire(out))
            return
        send = x.reshape(-1).to(plan.wide)
        recv = None if out is None else torch.empty(out.numel(), dtype=plan.wide, device=out.device)
        self._hold(x, out, send, recv)
        issue(send, recv)
        if out is not None and recv is not None:  # recv is a tensor whenever out is
            self._then(lambda: out.copy_(recv.view(out.shape)))

    def _then(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` now, or after the outermost :meth:`grouped` launched the NCCL work
        (then on the stream current now: the operation's)."""
        if self._group_depth:
            self._after_group.append((fn, current_torch_stream(self.device)))
        else:
            fn()

    def _hold(self, *tensors: torch.Tensor | None) -> None:
        """Inside :meth:`grouped`: keep ``tensors`` alive until the outermost group
        launched its kernels (see ``_held``)."""
        if self._group_depth:
            self._held.extend(t for t in tensors if t is not None)


def _send_count(t: torch.Tensor, plan: ReducePlan) -> int:
    """NCCL elements of ``t`` under ``plan`` (0 when there is nothing to reduce)."""
    return t.numel() * plan.factor


def _release_bounded(release: Callable[[Any], Any], comm: Any, timeout: float, who: str) -> None:
    """Run ``release(comm)`` on a daemon thread; wait at most ``timeout`` seconds for it."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            release(comm)
        except BaseException as e:  # reported to the caller below
            failure.append(e)

    worker = threading.Thread(target=run, name="groupcoord-nccl-release", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise CollectiveTimeout(
            f"releasing the NCCL communicator of {who} did not finish within {timeout:g}s: "
            f"NCCL keeps a communicator until every CUDA graph that captured its operations "
            f"is destroyed; delete those graphs first (the release completes when they go)"
        )
    if failure:
        raise failure[0]
