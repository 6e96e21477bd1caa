"""``GroupcoordProcessGroup``: a torch.distributed process group over our CPU communicator.

torch lets a Python class stand in for a process group only as a subclass of
``torch.distributed.ProcessGroup`` (its C++ ``Backend`` has no Python
constructor); the creator registered by :mod:`coordinator.torch_backend.registration`
returns one, and torch uses it as the group itself. Its methods are the ones
torch's functions call (``dist.all_reduce`` calls ``allreduce([t], opts)``;
C++ callers such as DDP and functional collectives reach the same methods
through torch's trampoline); each translates the call
(:mod:`coordinator.torch_backend.translate`) and runs it on the group's
:class:`~device_comms.cpu.communicator.CpuCommunicator`:

* on the shared-memory engine (ranks on one host): ``allreduce`` (every
  ReduceOp but PREMUL_SUM) and ``allreduce_coalesced``, ``broadcast``,
  ``reduce``, ``allgather`` and its tensor and coalesced forms, ``gather``,
  ``reduce_scatter`` and its tensor and coalesced forms, ``alltoall`` and
  ``alltoall_base`` (with or without split sizes), ``barrier``;
* on gloo, through the communicator (which still checks the ranks' calls
  agree): ``scatter``;
* on gloo directly: ``send``/``recv``/``recv_anysource`` (tags, works that
  complete later) and ``monitored_barrier``.

Across hosts the communicator runs all-reduce hierarchically and the rest on
gloo (see its module docstring). A gloo backend is also registered on this
group for CPU, so a C++ caller reaching an op this class does not define gets
gloo's, and torch's per-group name lives there.

The coalesced all-reduce and reduce-scatter and ``scatter`` first agree on
the ranks' layouts (:meth:`GroupcoordProcessGroup._agree`): their one
exchange alone would not tell ranks with different pieces apart.

Collectives run to completion on the calling thread, bounded by the group's
timeout, and return a finished :class:`~coordinator.torch_backend.work.GroupcoordWork`;
their errors raise at the call (with ``async_op=True`` too). The communicator
is built at the group's first collective (every rank reaches it at the same
call), not in the creator: torch's default group does not exist yet while
the creator of ``init_process_group`` runs, and the communicator's set-up asks
torch about its gloo group.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from coordinator.torch_backend import gloo_group
from coordinator.torch_backend.translate import (
    check_inputs,
    check_outputs,
    check_whole_and_piece,
    copy_pieces,
    known_reduce_op,
    root_list,
    same_dtype,
    single,
    split_sizes,
    tensor_list,
    to_reduce_op,
)
from coordinator.torch_backend.work import GroupcoordWork
from device_comms.cpu.communicator import CpuCommunicator
from device_comms.cpu.repeat_calls import apart, plain, writable
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.errors import (
    CollectiveMismatch,
    CommunicatorClosed,
    add_note,
    translate_backend_error,
)
from device_comms.reduce_op import ReduceOp
from device_comms.row_gather import layout_key
from device_comms.validation import check_tensor, check_writable
from shm_broadcast.errors import GroupCoordError

__all__ = ["BACKEND_NAME", "GroupcoordProcessGroup"]

BACKEND_NAME = "groupcoord"
_CPU = torch.device("cpu")
_GLOO = dist.ProcessGroup.BackendType.GLOO
_T = TypeVar("_T")
#: Collectives are not autograd ops (as in torch's C++ backends): the copies into
#: the caller's tensors are neither recorded nor refused on tensors that require grad.
_no_grad = torch.no_grad()
_M = TypeVar("_M", bound=Callable[..., Any])


def _apart(output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether contiguous ``output`` and contiguous ``input`` span disjoint bytes
    (False when either is not contiguous: the caller then copies)."""
    return output.is_contiguous() and input.is_contiguous() and apart(output, input)


def _gather_into(comm: CpuCommunicator, output: torch.Tensor, input: torch.Tensor) -> None:
    """Every rank's ``input``, flattened, in rank order into ``output`` (checked: its
    element count is the group's size times ``input``'s)."""
    flat = input if input.dim() == 1 else input.reshape(-1)
    if _apart(output, input):  # the communicator writes into the output itself
        comm.all_gather(flat, 0, out=output if output.dim() == 1 else output.view(-1))
    else:  # a non-contiguous output, or the input is part of it (torch allows that)
        output.copy_(comm.all_gather(flat, 0).view(output.shape))


def _host_kernels(method: _M) -> _M:
    """Run a collective of the group under ``torch.no_grad()`` and its communicator's
    kernel-thread limit (:meth:`CpuCommunicator.kernel_threads`): the copies into
    the caller's outputs are element-wise torch kernels like the engine's own,
    and with torch's default threads on every rank they would otherwise run as
    OpenMP teams spinning on the CPUs the peers need."""
    @functools.wraps(method)
    def run(self: GroupcoordProcessGroup, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self.communicator.kernel_threads():
            return method(self, *args, **kwargs)
    return cast(_M, run)


class GroupcoordProcessGroup(dist.ProcessGroup):
    """The process group torch gets for backend ``"groupcoord"``.

    Collective over the group's ranks (builds the gloo group beneath it).

    Args:
        store: The store torch's creator received (already prefixed by torch
            with the group's name and device).
        rank: This process's rank in the group.
        size: The group's size.
        timeout: Bound of every wait of the group (gloo's and the
            shared-memory engine's).
        global_ranks: The group's ranks in the default group (empty: the
            default group itself).
        name: The group's name in torch (``group_id``).

    Attributes:
        gloo: The gloo backend beneath (point-to-point, monitored_barrier).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        global_ranks: Sequence[int] = (),
        name: str = "",
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the only constructor a subclass may use
        ranks = list(global_ranks) or list(range(size))
        self._size = size  # size() is a call into C++; the fast paths read this
        self._name = name or BACKEND_NAME
        self._timeout_s = timeout.total_seconds()
        self._cpu_group, gloo = gloo_group.build(store, rank, size, timeout, ranks, self._name)
        #: torch's stub of ProcessGroupGloo lacks the methods of its C++ base (send, recv...).
        self.gloo: Any = gloo
        self._set_default_backend(_GLOO)
        self._register_backend(_CPU, _GLOO, self.gloo)
        self._comm: CpuCommunicator | None = None
        self._comm_lock = threading.Lock()
        self._shut = False

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        """``"groupcoord"``."""
        return BACKEND_NAME

    @property
    def communicator(self) -> CpuCommunicator:
        """The group's communicator (built at the first call that needs it: collective)."""
        comm = self._comm
        if comm is not None:
            return comm
        with self._comm_lock:
            if self._shut:
                raise CommunicatorClosed(f"process group {self._name!r} (groupcoord) was "
                                         "destroyed; create a new one to communicate again")
            if self._comm is None:
                self._comm = CpuCommunicator(self._cpu_group, _CPU,
                                             unique_name=f"groupcoord:{self._name}",
                                             timeout=self._timeout_s)
            return self._comm

    def _where(self, op: str) -> str:
        return f"group {self._name!r} (groupcoord, rank {self.rank()}/{self.size()}), op {op}"

    def _done(self, result: Sequence[torch.Tensor]) -> GroupcoordWork:
        return GroupcoordWork(result, timeout=self._timeout_s)

    def _checked(self, op: str, check: Callable[[], _T]) -> _T:
        """``check()``'s result; when it raises TypeError/ValueError, the peers
        (already in ``op``) are told this rank rejected the call, then it raises."""
        try:
            return check()
        except (TypeError, ValueError) as e:
            try:
                self.communicator.reject(op, e)
            except GroupCoordError as notify:  # closed, broken: this rank's error still raises
                add_note(e, f"telling the peers of group {self._name!r} failed: {notify}")
            raise

    def _agree(self, comm: CpuCommunicator, op: str, what: str,
               rows: Sequence[torch.Tensor]) -> None:
        """Raise on every rank unless every rank's ``rows`` have the same dtypes and row
        shapes, in order: one small all-gather of a digest
        (:func:`~device_comms.row_gather.layout_key`).

        For the calls whose one exchange signs less than their layout: a coalesced
        call's flat buffer signs only the total element count (pieces of 2 and 3
        elements against 3 and 2 would mix), and scatter's receivers are told the
        root's dtype rather than compared with it.

        Raises:
            CollectiveMismatch: The ranks' layouts differ (on every rank; the
                group stays usable).
        """
        try:
            own_key = torch.tensor([layout_key(rows)], dtype=torch.int64, device="cpu")
            keys = comm.all_gather(own_key, 0)
        except GroupCoordError as e:
            add_note(e, f"{self._where(op)}: raised by the check that the ranks' layouts agree")
            raise
        mine = keys[self.rank()]
        if bool((keys != mine).any()):
            others = [r for r in range(self.size()) if keys[r] != mine]
            layout = [(str(t.dtype)[6:], tuple(t.shape[1:])) for t in rows]
            raise CollectiveMismatch(
                f"{self._where(op)}: the ranks passed different {what}: this rank's are "
                f"{layout}, rank(s) {others} passed others")

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor],  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
                  opts: Any = None) -> GroupcoordWork:
        """``dist.all_reduce``: reduce ``tensors[0]`` in place across ranks."""
        opts = opts if opts is not None else dist.AllreduceOptions()
        comm = self.communicator
        t, op = self._checked("all_reduce", lambda: (
            single(tensors, "tensors"), to_reduce_op(opts.reduceOp)))
        if t.layout is not torch.strided:
            return self._sparse_all_reduce(comm, t, op, opts)
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            comm.all_reduce(t, op, out=t)  # checks that t can be written here
        else:
            self._checked("all_reduce", lambda: check_writable(t, "tensors[0]"))
            with torch.no_grad(), comm.kernel_threads():
                t.copy_(comm.all_reduce(t, op))
        return self._done([t])

    def _sparse_all_reduce(self, comm: CpuCommunicator, t: torch.Tensor, op: ReduceOp,
                           opts: Any) -> GroupcoordWork:
        """A sparse ``all_reduce`` (SUM of COO tensors, as gloo offers it) on the gloo
        group, once the ranks agree on the dense shape and dtype: gloo's sparse path
        does not compare them."""
        def check() -> None:
            if t.layout is not torch.sparse_coo:
                raise TypeError(f"tensors[0] must be a dense or sparse COO tensor, got a "
                                f"{t.layout} tensor")
            if op is not ReduceOp.SUM:
                raise ValueError(f"opts.reduceOp must be SUM for a sparse tensor (gloo "
                                 f"reduces only that), got {op.name}")

        self._checked("all_reduce", check)
        # layout_key compares row shapes: a leading 1 makes the whole shape a row
        self._agree(comm, "all_reduce", "sparse tensor shapes or dtypes",
                    [torch.empty((1, *t.shape), dtype=t.dtype, device="meta")])
        where = self._where("all_reduce (sparse, gloo)")
        w = self._start(lambda: self.gloo.allreduce([t], opts), where)
        return GroupcoordWork([t], pending=w, timeout=self._timeout_s, where=where)

    @_host_kernels
    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: Any = None) -> GroupcoordWork:
        """``dist.all_reduce_coalesced``: several tensors of one dtype, in one call."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        comm = self.communicator

        def check() -> tuple[list[torch.Tensor], ReduceOp]:
            ts = tensor_list(tensors, "tensors")
            if not ts:
                raise ValueError("tensors must hold at least one tensor")
            check_outputs(ts, "tensors")
            same_dtype(ts, ts[0].dtype, "tensors")
            return ts, to_reduce_op(opts.reduceOp)

        ts, op = self._checked("all_reduce", check)
        if len(ts) > 1:
            self._agree(comm, "all_reduce_coalesced", "tensors (dtype, shape)",
                        [t.unsqueeze(0) for t in ts])
        flat = torch.cat([t.reshape(-1) for t in ts])
        comm.all_reduce(flat, op, out=flat)
        copy_pieces(flat, ts)
        return self._done(ts)

    @_host_kernels
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupcoordWork:  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
        """``dist.reduce``: the reduction lands in ``tensors[0]`` on the root only."""
        opts = opts if opts is not None else dist.ReduceOptions()
        comm = self.communicator

        def check() -> tuple[torch.Tensor, ReduceOp]:
            t = single(tensors, "tensors")
            if self.rank() == opts.rootRank:  # the result is written into it
                check_writable(t, "tensors[0]")
            return t, to_reduce_op(opts.reduceOp)

        t, op = self._checked("reduce", check)
        out = comm.reduce(t, opts.rootRank, op)
        if out is not None:
            t.copy_(out)
        return self._done([t])

    @_host_kernels
    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
                       input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> GroupcoordWork:
        """``dist.reduce_scatter``: rank ``i`` gets the reduction of every rank's ``inputs[i]``."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        comm = self.communicator
        world = self.size()

        def check() -> tuple[torch.Tensor, list[torch.Tensor], ReduceOp]:
            out = single(output_tensors, "output_tensors")
            check_outputs([out], "output_tensors")
            if not isinstance(input_tensors, Sequence) or len(input_tensors) != 1:
                raise ValueError("input_tensors must be a list holding one list of tensors")
            ins = tensor_list(input_tensors[0], "input_list", world)
            check_inputs(ins, "input_list")
            same_dtype(ins, out.dtype, "input_list")
            if ins[self.rank()].numel() != out.numel():
                raise ValueError(f"input_list[{self.rank()}] has {ins[self.rank()].numel()} "
                                 f"elements but output has {out.numel()}")
            return out, ins, to_reduce_op(opts.reduceOp)

        out, ins, op = self._checked("reduce_scatter", check)
        sizes = [x.numel() for x in ins]
        flat = torch.cat([x.reshape(-1) for x in ins])
        if len(set(sizes)) == 1:
            got = comm.reduce_scatter(flat, 0, op)
        else:
            got = comm.reduce_scatterv(flat, 0, sizes, op)
        out.copy_(got.view(out.shape))
        return self._done([out])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> GroupcoordWork:
        """``dist.reduce_scatter_tensor``: rank ``i`` gets slice ``i`` of the reduced input.

        Plain tensors (:func:`~device_comms.cpu.repeat_calls.plain`) of one dtype,
        the input ``size()`` times the output's elements, skip this group's checks
        (the communicator checks its own arguments) and the contexts of the
        checked path; the flat input's reduced slice is copied into ``output``.
        """
        comm = self._comm
        if (comm is not None and plain(output) and plain(input) and writable(output)
                and output.dtype is input.dtype and input.numel() == output.numel() * self._size
                and opts is not None and apart(output, input)):
            rop = known_reduce_op(opts.reduceOp)
            if rop is not None:
                got = comm.reduce_scatter(input if input.dim() == 1 else input.view(-1), 0, rop)
                got = got if output.dim() == 1 else got.view(output.shape)
                if output.numel() <= GRAIN:  # torch copies this serially anyway
                    output.copy_(got)
                else:  # an OpenMP team per rank would spin on the CPUs the peers need
                    with comm.kernel_threads():
                        output.copy_(got)
                return self._done([output])
        return self._checked_reduce_scatter_base(output, input, opts)

    @_host_kernels
    def _checked_reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                                     opts: Any) -> GroupcoordWork:
        """``_reduce_scatter_base`` with every check of this group (which names torch's
        arguments in its errors and tells the peers)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        comm = self.communicator

        def check() -> ReduceOp:
            check_writable(check_tensor(output, "output", _CPU), "output")
            check_tensor(input, "input", _CPU)
            check_whole_and_piece(input, "input", output, "output", self.size())
            return to_reduce_op(opts.reduceOp)

        op = self._checked("reduce_scatter", check)
        output.copy_(comm.reduce_scatter(input.reshape(-1), 0, op).view(output.shape))
        return self._done([output])

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]  # as above

    @_host_kernels
    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> GroupcoordWork:
        """Functional ``reduce_scatter_tensor``: several pairs in one call.

        Pairs of one dtype travel as one reduce-scatter of their rows side by
        side; otherwise one call per pair.
        """
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[torch.Tensor], list[torch.Tensor], ReduceOp]:
            outs = tensor_list(outputs, "outputs")
            ins = tensor_list(inputs, "inputs", len(outs))
            check_outputs(outs, "outputs")
            check_inputs(ins, "inputs")
            for i, (o, x) in enumerate(zip(outs, ins, strict=True)):
                check_whole_and_piece(x, f"inputs[{i}]", o, f"outputs[{i}]", world)
            return outs, ins, to_reduce_op(opts.reduceOp)

        outs, ins, op = self._checked("reduce_scatter", check)
        if len(outs) > 1:
            self._agree(comm, "reduce_scatter_tensor_coalesced", "outputs (dtype, numel)",
                        [o.reshape(1, -1) for o in outs])
        if outs and len({x.dtype for x in ins}) == 1:
            rows = torch.cat([x.reshape(world, -1) for x in ins], dim=1)
            got = comm.reduce_scatter(rows, 0, op).reshape(-1)
            copy_pieces(got, outs)
        else:
            for o, x in zip(outs, ins, strict=True):
                o.copy_(comm.reduce_scatter(x.reshape(-1), 0, op).view(o.shape))
        return self._done(outs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]  # as above

    # ------------------------------------------------------------------ moves
    @_host_kernels
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupcoordWork:  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
        """``dist.broadcast``: ``tensors[0]`` of the root, into every rank's ``tensors[0]``."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        comm = self.communicator

        def check() -> torch.Tensor:
            if opts.rootTensor != 0:
                raise ValueError(f"rootTensor must be 0 (one tensor per process), "
                                 f"got {opts.rootTensor}")
            return single(tensors, "tensors")

        t = self._checked("broadcast", check)
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            comm.broadcast(t, opts.rootRank)
        else:  # the root only reads its tensor
            receives = self.rank() != opts.rootRank
            if receives:
                self._checked("broadcast", lambda: check_writable(t, "tensors[0]"))
            buf = t.resolve_conj().resolve_neg().contiguous()
            if buf is t:
                buf = t.clone()
            comm.broadcast(buf, opts.rootRank)
            if receives:
                t.copy_(buf)
        return self._done([t])

    @_host_kernels
    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
                  input_tensors: list[torch.Tensor], opts: Any = None) -> GroupcoordWork:
        """``dist.all_gather``: every rank's input into ``output_tensors[0][rank]``.

        Outputs may differ in size between ranks' entries (an uneven all-gather).
        """
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[torch.Tensor], torch.Tensor]:
            x = single(input_tensors, "input_tensors")
            if not isinstance(output_tensors, Sequence) or len(output_tensors) != 1:
                raise ValueError("output_tensors must be a list holding one list of tensors")
            outs = tensor_list(output_tensors[0], "output_tensor_list", world)
            check_inputs([x], "input_tensors")
            check_outputs(outs, "output_tensor_list")
            same_dtype(outs, x.dtype, "output_tensor_list")
            if outs[self.rank()].numel() != x.numel():
                raise ValueError(f"output_tensor_list[{self.rank()}] has "
                                 f"{outs[self.rank()].numel()} elements but the input has "
                                 f"{x.numel()}")
            return outs, x

        outs, x = self._checked("all_gather", check)
        sizes = [o.numel() for o in outs]
        if len(set(sizes)) == 1:
            got = comm.all_gather(x.reshape(-1), 0)
        else:
            got = cast(torch.Tensor, comm.all_gatherv(x.reshape(-1), 0, sizes))  # one in, one out
        copy_pieces(got, outs)
        return self._done(outs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> GroupcoordWork:
        """``dist.all_gather_into_tensor``: every rank's input, in rank order, into ``output``.

        Plain tensors (:func:`~device_comms.cpu.repeat_calls.plain`) of one dtype,
        apart, the output ``size()`` times the input's elements, skip this group's
        checks (the communicator checks its own arguments) and the contexts of the
        checked path: the communicator gathers the flat input straight into the
        flat output.
        """
        comm = self._comm
        if (comm is not None and plain(output) and plain(input) and writable(output)
                and output.dtype is input.dtype and output.numel() == input.numel() * self._size
                and apart(output, input)):
            # flat, as the checked path gathers: the ranks' steps compare the shapes
            comm.all_gather(input if input.dim() == 1 else input.view(-1), 0,
                            out=output if output.dim() == 1 else output.view(-1))
            return self._done([output])
        return self._checked_allgather_base(output, input)

    @_host_kernels
    def _checked_allgather_base(self, output: torch.Tensor,
                                input: torch.Tensor) -> GroupcoordWork:
        """``_allgather_base`` with every check of this group (which names torch's
        arguments in its errors and tells the peers)."""
        comm = self.communicator

        def check() -> None:
            check_writable(check_tensor(output, "output", _CPU), "output")
            check_tensor(input, "input", _CPU)
            check_whole_and_piece(output, "output", input, "input", self.size())

        self._checked("all_gather", check)
        _gather_into(comm, output, input)
        return self._done([output])

    all_gather_single = _allgather_base  # torch's newer name

    @_host_kernels
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> GroupcoordWork:
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` receives rank ``r``'s
        ``input_list[i]``; several all-gathers (any shapes) in one exchange."""
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
            ins = tensor_list(input_list, "input_tensor_list")
            if not isinstance(output_lists, Sequence) or len(output_lists) != world:
                raise ValueError(f"output_tensor_lists must hold one list per rank ({world})")
            outs = [tensor_list(o, f"output_tensor_lists[{r}]", len(ins))
                    for r, o in enumerate(output_lists)]
            check_inputs(ins, "input_tensor_list")
            for r, o in enumerate(outs):
                check_outputs(o, f"output_tensor_lists[{r}]")
            for r, o in enumerate(outs):
                for i, (t, x) in enumerate(zip(o, ins, strict=True)):
                    if t.dtype != x.dtype:
                        raise TypeError(f"output_tensor_lists[{r}][{i}] must have dtype "
                                        f"{x.dtype}, got {t.dtype}")
                    if t.numel() != x.numel():
                        raise ValueError(f"output_tensor_lists[{r}][{i}] must have "
                                         f"{x.numel()} elements, got {t.numel()}")
            return outs, ins

        outs, ins = self._checked("all_gatherv", check)
        if ins:
            got, _ = comm.all_gatherv_rows([x.reshape(1, -1) for x in ins], [1] * world)
            for i, g in enumerate(got):  # g: (world, numel of input i)
                for r in range(world):
                    outs[r][i].copy_(g[r].view(outs[r][i].shape))
        return self._done([t for o in outs for t in o])

    @_host_kernels
    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> GroupcoordWork:
        """Functional ``all_gather_tensor`` and ``all_gather_into_tensor_coalesced``."""
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            outs = tensor_list(outputs, "outputs")
            ins = tensor_list(inputs, "inputs", len(outs))
            check_outputs(outs, "outputs")
            check_inputs(ins, "inputs")
            for i, (o, x) in enumerate(zip(outs, ins, strict=True)):
                check_whole_and_piece(o, f"outputs[{i}]", x, f"inputs[{i}]", world)
            return outs, ins

        outs, ins = self._checked("all_gatherv", check)
        if len(ins) == 1:
            _gather_into(comm, outs[0], ins[0])
        elif ins:
            got, _ = comm.all_gatherv_rows([x.reshape(1, -1) for x in ins], [1] * world)
            for o, g in zip(outs, got, strict=True):
                o.copy_(g.view(o.shape))
        return self._done(outs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]  # as above

    @_host_kernels
    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
               input_tensors: list[torch.Tensor], opts: Any = None) -> GroupcoordWork:
        """``dist.gather``: every rank's input into the root's ``output_tensors[0]``."""
        opts = opts if opts is not None else dist.GatherOptions()
        comm = self.communicator
        root, world = opts.rootRank, self.size()

        def check() -> tuple[list[torch.Tensor], torch.Tensor]:
            x = single(input_tensors, "input_tensors")
            check_inputs([x], "input_tensors")
            if self.rank() != root:
                return [], x
            outs = root_list(output_tensors, "output_tensors", "gather_list", world, x)
            check_outputs(outs, "gather_list")
            return outs, x

        outs, x = self._checked("gather", check)
        got = comm.gather(x.reshape(-1), root, 0)
        if got is not None:
            copy_pieces(got, outs)
        return self._done(outs)

    @_host_kernels
    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]  # torch's stub adds overloads no caller of a group uses
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> GroupcoordWork:
        """``dist.scatter``: the root's ``input_tensors[0][i]`` into rank ``i``'s output."""
        opts = opts if opts is not None else dist.ScatterOptions()
        comm = self.communicator
        root, world = opts.rootRank, self.size()

        def check() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = single(output_tensors, "output_tensors")
            check_outputs([out], "output_tensors")
            if self.rank() != root:
                return out, None
            ins = root_list(input_tensors, "input_tensors", "scatter_list", world, out)
            check_inputs(ins, "scatter_list")
            return out, torch.stack([t.reshape(-1) for t in ins])

        out, rows = self._checked("scatter", check)
        self._agree(comm, "scatter", "outputs (dtype, numel)", [out.reshape(1, -1)])
        got = comm.scatter(rows, root, 0)
        out.copy_(got.view(out.shape))
        return self._done([out])

    @_host_kernels
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> GroupcoordWork:
        """``dist.all_to_all_single``: rows of ``input`` (by split sizes) to each rank."""
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[int], list[int]]:
            check_writable(check_tensor(output, "output", _CPU), "output")
            check_tensor(input, "input", _CPU)
            if output.dtype != input.dtype:
                raise TypeError(f"output must have input's dtype {input.dtype}, "
                                f"got {output.dtype}")
            if input.dim() == 0 or output.dim() == 0:
                raise ValueError("input and output must have at least one dimension")
            if input.shape[1:] != output.shape[1:]:
                raise ValueError(f"output's rows must have input's shape "
                                 f"{tuple(input.shape[1:])}, got {tuple(output.shape[1:])}")
            if not input_split_sizes and not output_split_sizes and input.shape != output.shape:
                raise ValueError(f"output must have input's shape {tuple(input.shape)} "
                                 f"without split sizes, got {tuple(output.shape)}")
            return (split_sizes(input_split_sizes, input.shape[0], world, "input_split_sizes"),
                    split_sizes(output_split_sizes, output.shape[0], world,
                                "output_split_sizes"))

        # equal splits too: all_to_allv runs in shared memory, all_to_all on gloo
        send, recv = self._checked("all_to_allv", check)
        output.copy_(comm.all_to_allv(input, send, recv))
        return self._done([output])

    all_to_all_single = alltoall_base  # type: ignore[assignment]  # as above

    @_host_kernels
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> GroupcoordWork:
        """``dist.all_to_all``: ``input_tensors[j]`` to rank ``j``, whose ``output_tensors[i]``
        receives it from rank ``i`` (sizes may differ)."""
        comm = self.communicator
        world = self.size()

        def check() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            outs = tensor_list(output_tensors, "output_tensor_list", world)
            ins = tensor_list(input_tensors, "input_tensor_list", world)
            check_outputs(outs, "output_tensor_list")
            check_inputs(ins, "input_tensor_list")
            same_dtype(outs, ins[0].dtype, "output_tensor_list")
            same_dtype(ins, ins[0].dtype, "input_tensor_list")
            return outs, ins

        outs, ins = self._checked("all_to_allv", check)
        flat = torch.cat([x.reshape(-1) for x in ins])
        got = comm.all_to_allv(flat, [x.numel() for x in ins], [o.numel() for o in outs])
        copy_pieces(got, outs)
        return self._done(outs)

    # ------------------------------------------------------------------ synchronisation
    def barrier(self, opts: Any = None) -> GroupcoordWork:
        """``dist.barrier``: every rank of the group reached it."""
        self.communicator.barrier()
        return self._done([])

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier (names the ranks that did not arrive in time).

        ``dist.monitored_barrier`` refuses every backend but gloo; call this
        method on the group instead.
        """
        limit = timeout if timeout is not None else datetime.timedelta(seconds=self._timeout_s)
        self.gloo.monitored_barrier(limit, wait_all_ranks)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> GroupcoordWork:
        """``dist.send``/``isend`` (gloo): the work completes once gloo sent it."""
        t = single(tensors, "tensors")
        buf = t.resolve_conj().resolve_neg().contiguous()
        where = self._where(f"send to rank {dstRank}")
        w = self._start(lambda: self.gloo.send([buf], dstRank, tag), where)
        return GroupcoordWork([t], pending=w, timeout=self._timeout_s, where=where)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> GroupcoordWork:
        """``dist.recv``/``irecv`` (gloo): the tensor is filled once the work completed."""
        return self._receive(tensors, lambda bufs: self.gloo.recv(bufs, srcRank, tag),
                             f"recv from rank {srcRank}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> GroupcoordWork:
        """``dist.recv`` without ``src`` (gloo); the work's ``_source_rank()`` names it."""
        return self._receive(tensors, lambda bufs: self.gloo.recv_anysource(bufs, tag),
                             "recv_anysource")

    def _receive(self, tensors: list[torch.Tensor],
                 start: Callable[[list[torch.Tensor]], dist.Work], op: str) -> GroupcoordWork:
        t = single(tensors, "tensors")
        check_outputs([t], "tensors")  # before gloo takes the message
        where = self._where(op)
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):  # raw elements are values
            return GroupcoordWork([t], pending=self._start(lambda: start([t]), where),
                                  timeout=self._timeout_s, where=where)
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return GroupcoordWork([t], pending=self._start(lambda: start([buf]), where),
                              finish=lambda: _no_grad(t.copy_)(buf),
                              timeout=self._timeout_s, where=where)

    @staticmethod
    def _start(start: Callable[[], dist.Work], where: str) -> dist.Work:
        """``start()``'s gloo work; gloo's errors at the start (a pair it closed when an
        earlier wait timed out, a peer that died) as this family's."""
        try:
            return start()
        except RuntimeError as e:
            err = translate_backend_error(e, where)
            if err is e:
                raise
            raise err from e

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Destroy the communicator (frees its shared memory) and leave torch's books.

        ``dist.destroy_process_group`` calls it. Idempotent.
        """
        with self._comm_lock:
            self._shut = True
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
        gloo_group.forget(self._cpu_group)

    def abort(self) -> None:
        """Break the communicator (calls in flight raise), then shut down."""
        comm = self._comm
        if comm is not None:
            comm.abort(CommunicatorClosed(f"process group {self._name!r} (groupcoord) was "
                                          "aborted"))
        self.shutdown()
