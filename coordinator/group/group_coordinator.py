"""GroupCoordinator: every collective an engine needs, for one parallel dimension.

A coordinator owns, for the ranks of one group (say one TP group):

* a CPU ``gloo`` group for objects, metadata and barriers;
* a device group (the same gloo group on CPU, NCCL on GPUs);
* a device communicator picked through :mod:`device_comms`'s registry by the
  group's device (the CPU shared-memory one on CPU), which carries tensors;
* optionally a shared-memory message queue that broadcasts objects and tensor
  dict metadata from one writer rank in microseconds.

Ranks in arguments are ranks *within the group*. A group of one answers every
call locally. Tensor results are new tensors; inputs are never modified except
by :meth:`GroupCoordinator.broadcast` (receivers pass the buffer to fill).

One timeout bounds every wait of a group (default 300 s; see
:mod:`shm_broadcast.timeouts`): gloo calls, shared-memory collectives, message
queue broadcasts, barriers and point-to-point calls. Each call has a sequence
number, and a wait that runs out raises ``CommTimeout`` naming the group, the
op, the call number and the ranks that did not arrive
(:mod:`coordinator.calls.call_errors`).

A coordinator is built from parts that own their state, each typed against a
small protocol of what it uses of the group:

* :class:`~coordinator.calls.call_book.CallBook`: call numbers, the closed
  state, the explanation of failed waits;
* :class:`~coordinator.group.object_calls.ObjectCalls`: object broadcasts and
  objects point to point;
* :class:`~coordinator.p2p.point_to_point.PointToPoint`: tensors and objects
  point to point, blocking and asynchronous, in issue order (links, channels,
  a CUDA group's side stream);
* :class:`~coordinator.group.tensor_dict_calls.TensorDictCalls`: tensor dicts,
  broadcast and point to point.

The tensor collectives go straight to the device communicator (``comm``) and
number and record themselves inline (:mod:`coordinator.calls.call_book`).

Every call is written into the process's flight recorder
(:mod:`coordinator.trace`): the op, its call numbers, its tensors' shapes and
dtypes, when it began and completed, or the error it raised. A call that
raises a timeout, a dead peer, a mismatch between ranks or a broken
communicator writes this process's dump (:mod:`coordinator.trace.auto_dump`);
``coordinator.dump_trace()`` and ``GROUPCOORD_TRACE_SIGNAL`` write one on
demand. ``GROUPCOORD_TRACE_BUFFER=0`` turns the recorder off: the busiest
calls (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``) then
pay two attribute loads and one combined test for the recorder and the
device marks together. A group whose device calls are watched
(:mod:`coordinator.trace.watchdog`) marks them whether the recorder is on or
off (its calls then also keep their start, for the explanation of a failed
wait); with both off, nothing is marked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from time import monotonic
from typing import Any, cast, overload

import torch
import torch.distributed as dist

from coordinator import custom_ops
from coordinator.calls.call_book import CallBook
from coordinator.calls.call_errors import WAIT_ERRORS
from coordinator.calls.gloo_break import break_connections
from coordinator.custom_ops import outside_graph as _outside_graph
from coordinator.custom_ops import traced_alone as _traced_alone
from coordinator.custom_ops import tracing as _tracing
from coordinator.custom_ops import untraced as _untraced
from coordinator.errors import NotInitializedError
from coordinator.group import setup as setup
from coordinator.group.moe_calls import MoeCalls
from coordinator.group.monitored_barrier import monitored_barrier
from coordinator.group.object_calls import ObjectCalls
from coordinator.group.registry import REGISTRY
from coordinator.group.tensor_dict_calls import TensorDictCalls
from coordinator.p2p.channels import RECV, SEND
from coordinator.p2p.dict_handles import DictReceive, DictSend
from coordinator.p2p.handle import P2PHandle
from coordinator.p2p.point_to_point import PointToPoint
from coordinator.p2p.shm_links import ShmLinks
from coordinator.trace import signals as trace_signals
from coordinator.trace import watchdog
from coordinator.trace.recorder import OUT_SIZES, GroupTrace, StartOnly, recorder
from coordinator.trace.transports import TransportNamer
from coordinator.wire.object_comm import ObjectCodec
from device_comms import DeviceCommunicator, ReduceOp, TorchDistributedCommunicator, validation
from device_comms.reduce_op import check_reduce_op
from shm_broadcast.checks import check_timeout
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.timeouts import default_timeout

__all__ = ["GroupCoordinator", "GraphCaptureContext", "side_stream"]


@dataclasses.dataclass
class GraphCaptureContext:
    """What :meth:`GroupCoordinator.graph_capture` yields.

    Attributes:
        stream: The CUDA stream captured on, or None on CPU.
    """

    stream: Any = None


class GroupCoordinator:
    """Collectives for one group of ranks (one parallel dimension).

    Every process calls the constructor with the same ``group_ranks`` (all
    groups of this kind, e.g. every TP group); each process keeps the group it
    belongs to.

    Args:
        group_ranks: Lists of global ranks, one list per group.
        local_rank: This process's rank on its node (picks the GPU).
        torch_distributed_backend: Backend of the device group (``"gloo"``, ``"nccl"``).
        use_device_communicator: Use the registry's best communicator for the
            device; else tensors go through plain torch.distributed.
        use_message_queue_broadcaster: Broadcast objects and tensor-dict
            metadata from rank 0 through a shared-memory message queue (the
            TP group's, in ``parallel_state``), whose readers wait
            predictively (:meth:`create_mq_broadcaster`).
        group_name: Base name; the unique name is ``<group_name>:<n>``.
        device_communicator: Registry name to force a specific communicator.
        timeout: Seconds (or a timedelta, ``> 0``) that bound every wait of
            this group: its gloo groups, its device communicator, its message
            queues, barriers and point-to-point calls. None: the
            ``GROUPCOORD_TIMEOUT`` environment variable, else 300 s (the
            communicator may then take ``GROUPCOORD_CPU_SHM_TIMEOUT``; see
            :mod:`shm_broadcast.timeouts`).
        allow_pickle: Opt in to pickle for objects msgspec cannot carry
            (dataclasses, enums, arbitrary classes) in object collectives,
            tensor-dict values and the group's message queues. Off by
            default: such objects raise ``TypeError`` on the sender (its peers
            raise ``CollectiveMismatch``) and nothing received is unpickled.
            Every rank must pass the same value; with it, any process that can
            send to this group can run code in it, so only for trusted peers.

    Attributes:
        rank: Global rank of this process.
        ranks: Global ranks of this group.
        world_size: Size of this group.
        rank_in_group: This process's rank within the group.
        local_rank: Rank on the node.
        cpu_group: The gloo group.
        device_group: The group carrying device tensors.
        device: This rank's device.
        device_communicator: The registry-chosen communicator (None if disabled).
        unique_name: Name unique within the process (``tp:0``).
        allow_pickle: Whether this group opted in to pickle.
        codec: The :class:`shm_broadcast.codec.message_codec.Codec` of the object collectives.
        timeout: Seconds every wait of this group may last.
        calls: Calls made so far on this rank; the next call is number
            ``calls + 1`` (errors name it: ranks making the same calls agree).
        collectives: Collective calls (all but point-to-point ones) made so
            far on this rank: the same on every rank of a correct program,
            so it stamps the message-queue broadcasts
            (:mod:`coordinator.group.broadcast_stamps`).
    """

    def __init__(
        self,
        group_ranks: Sequence[Sequence[int]],
        local_rank: int,
        torch_distributed_backend: str | dist.Backend,
        use_device_communicator: bool,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
        *,
        device_communicator: str | None = None,
        timeout: float | datetime.timedelta | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be a bool, got {type(allow_pickle).__name__}")
        backend = setup.check_backend(torch_distributed_backend, "torch_distributed_backend")
        if not isinstance(local_rank, int) or isinstance(local_rank, bool):
            raise TypeError(f"local_rank must be an int, got {type(local_rank).__name__}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0 (this process's rank on its node), "
                             f"got {local_rank}")
        if group_name is not None and (not isinstance(group_name, str) or not group_name):
            raise TypeError(f"group_name must be a non-empty str or None, got "
                            f"{type(group_name).__name__} {group_name!r:.40}")
        if not dist.is_initialized():
            raise NotInitializedError(
                "torch.distributed is not initialised; call "
                "coordinator.init_distributed_environment(...) first"
            )
        # The settings from the environment, checked before anything is made (a bad
        # value then leaves no process group, communicator or queue behind).
        rec = recorder()  # GROUPCOORD_TRACE_BUFFER / _STACKS
        watch_settings = watchdog.settings_from_env()  # GROUPCOORD_WATCHDOG / _ABORT
        trace_signals.install_from_env()  # GROUPCOORD_TRACE_SIGNAL
        default = default_timeout()
        seconds = check_timeout(timeout, default=default, positive=True)
        self.timeout: float = default if seconds is None else seconds
        self.unique_name = REGISTRY.unique_name(group_name or "anonymous")
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.ranks, cpu_group, device_group = setup.create_process_groups(
            group_ranks, backend, self.rank, datetime.timedelta(seconds=self.timeout),
            self.unique_name,
        )
        self.cpu_group: dist.ProcessGroup | None = cpu_group  # None once destroyed
        self.device_group: dist.ProcessGroup | None = device_group
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.device = setup.pick_device(backend, local_rank)
        self.allow_pickle = allow_pickle
        self.codec: Codec | ObjectCodec = Codec(allow_pickle=allow_pickle)
        self._book = CallBook(self.unique_name, self.rank_in_group, self.world_size,
                              self.timeout)
        if self.world_size > 1:
            self._book.learn_peers(cpu_group)
        self.use_device_communicator = use_device_communicator
        self.device_communicator: DeviceCommunicator | None = None
        if use_device_communicator and self.world_size > 1:
            self.device_communicator = setup.build_communicator(
                device_communicator, cpu_group, self.device, device_group,
                self.unique_name, None if timeout is None else self.timeout,
            )
        self.comm: DeviceCommunicator = self.device_communicator or TorchDistributedCommunicator(
            cpu_group, self.device, device_group, self.unique_name,
            timeout=None if timeout is None else self.timeout,
        )
        book = self._book
        self.comm.number_calls(lambda: book.collectives)  # compared with the peers' numbers
        self._watch: watchdog.GroupWatch | None = None
        self._marks: Callable[[], Any] | None = None  # marks a device call (see below)
        self.mq_broadcaster: Any = None
        self.mq_writer_rank = 0
        self._objects = ObjectCalls(self, book)
        self._p2p = PointToPoint(self, book, self._objects)
        self._dicts = TensorDictCalls(self, book, self._objects, self._p2p, GroupCoordinator)
        self._moe = MoeCalls(self)
        self._trace: GroupTrace | StartOnly | None = rec.group(
            self.unique_name, group_name or "anonymous", self.ranks, self.rank_in_group,
            TransportNamer(self.comm, self.device, _link_lookup(self._p2p.links)),
            timeout=self.timeout)
        book.trace = self._trace
        if use_message_queue_broadcaster and self.world_size > 1 and setup.mq_available():
            self.mq_broadcaster = self.create_mq_broadcaster(writer_rank=0)
        # Device calls are marked where the communicator's work outlives its calls
        # (CUDA) or it tells its own progress, for the recorder and the watchdog
        # (coordinator.trace.watchdog); with neither, nothing is marked.
        traced = self._trace is not None
        marker = (watchdog.device_marker(self.comm, self.device, count_replays=traced)
                  if self.world_size > 1 and (traced or watch_settings.watch) else None)
        if marker is not None:
            self._watch = watchdog.watch_group(
                self.unique_name, self.ranks, self.rank_in_group, self.timeout, self.comm,
                cpu_group, book, marker, watch_settings)
            self._marks = book.marks = marker if self._watch is None else self._watch.marks
            if not traced:  # watched, recorder off: the calls keep their start (StartOnly)
                self._trace = StartOnly()
        REGISTRY.add(self)

    # ------------------------------------------------------------------ state
    @property
    def calls(self) -> int:
        """Calls made so far on this rank; the next call is number ``calls + 1``."""
        return self._book.calls

    @property
    def collectives(self) -> int:
        """Collective calls (all but point-to-point ones) made so far on this rank."""
        return self._book.collectives

    # ------------------------------------------------------------------ topology
    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Whether this process is the group's first member."""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """Whether this process is the group's last member."""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    # ------------------------------------------------------------------ tensors
    def all_reduce(
        self,
        input_: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Element-wise reduction across the group.

        Args:
            input_: Tensor on this group's device; same shape and dtype on every rank.
            op: A :class:`ReduceOp`; bitwise ops need integer dtypes, AVG floating.
            out: Where to write the result instead of a new tensor: contiguous,
                ``input_``'s shape, dtype and device; ``input_`` itself reduces
                in place (what vLLM's CPU path does), saving an allocation and,
                on the shared-memory engine, a pass over the output.

        Returns:
            ``out`` when given, else a new tensor.
        """
        if _tracing():  # a custom op in the graph, or (no op for it) a graph break
            if self.world_size == 1 or op is ReduceOp.SUM:
                return self._traced_all_reduce(input_, op, out)
            return _all_reduce_eagerly(self, input_, op, out)
        book = self._book
        n = book.begin("all_reduce")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            trace, mark = self._trace, self._marks
            if trace is None and mark is None:  # nothing records this call
                started = monotonic()
                try:
                    return self.comm.all_reduce(input_, op, out=out)
                except WAIT_ERRORS as e:
                    book.explain("all_reduce", seq, e, started=started)  # name what went wrong
                    raise
            entry = None if trace is None else trace.begin_tensor(
                "all_reduce", n, book.p2p_calls, input_, -1, None, None, op)  # record it
            marks = None if mark is None else mark()  # follow the device's work
            try:
                result = self.comm.all_reduce(input_, op, out=out)
            except BaseException as e:
                book.failed("all_reduce", seq, e, entry, marks)  # name what went wrong, record it
                raise
            book.finished(entry, marks)
            return result
        finally:
            book.end()

    def _traced_all_reduce(self, input_: torch.Tensor, op: ReduceOp,
                           out: torch.Tensor | None) -> torch.Tensor:
        """:meth:`all_reduce` while torch.compile traces: the custom op (alone: a copy)."""
        if out is not None:  # the result is a fresh tensor: only shape and kind matter
            validation.check_out_meta(out, input_)
        if self.world_size == 1:
            check_reduce_op(op, input_.dtype)
            res = input_.clone()
        else:
            res = custom_ops.traced_all_reduce(self, input_)
        return res if out is None else out.copy_(res)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim`` (negative allowed)."""
        if _tracing():
            return _traced_alone(input_, dim) if self.world_size == 1 else \
                custom_ops.traced_all_gather(self, input_, dim)
        book = self._book
        n = book.begin("all_gather")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            trace, mark = self._trace, self._marks
            if trace is None and mark is None:  # nothing records this call
                started = monotonic()
                try:
                    return self.comm.all_gather(input_, dim)
                except WAIT_ERRORS as e:
                    book.explain("all_gather", seq, e, started=started)  # name what went wrong
                    raise
            entry = None if trace is None else trace.begin_tensor(
                "all_gather", n, book.p2p_calls, input_, -1, dim)  # record it (dim: its output)
            marks = None if mark is None else mark()  # follow the device's work
            try:
                result = self.comm.all_gather(input_, dim)
            except BaseException as e:
                book.failed("all_gather", seq, e, entry, marks)  # name what went wrong, record it
                raise
            if entry is not None:
                entry[OUT_SIZES] = result.shape
            book.finished(entry, marks)
            return result
        finally:
            book.end()

    def all_gatherv(
        self,
        input_: torch.Tensor | Sequence[torch.Tensor],
        dim: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``i`` contributes ``sizes[i]`` rows along ``dim``.

        ``input_`` may be a list of tensors; then a list comes back.
        """
        return self._book.run("all_gatherv", self.comm.all_gatherv, input_, dim, sizes,
                              data=input_, dim=dim)

    def reduce_scatter(
        self, input_: torch.Tensor, dim: int = -1, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce, then keep this rank's equal slice along ``dim``."""
        if _tracing():  # a custom op in the graph, or (no op for it) a graph break
            if self.world_size == 1:
                check_reduce_op(op, input_.dtype)  # as eager mode: refused, not ignored
                return _traced_alone(input_, dim)
            if op is ReduceOp.SUM:
                return custom_ops.traced_reduce_scatter(self, input_, dim)
            return _reduce_scatter_eagerly(self, input_, dim, op)
        book = self._book
        n = book.begin("reduce_scatter")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            trace, mark = self._trace, self._marks
            if trace is None and mark is None:  # nothing records this call
                started = monotonic()
                try:
                    return self.comm.reduce_scatter(input_, dim, op)
                except WAIT_ERRORS as e:
                    book.explain("reduce_scatter", seq, e, started=started)  # name what went wrong
                    raise
            entry = None if trace is None else trace.begin_tensor(
                "reduce_scatter", n, book.p2p_calls, input_, -1, dim, None, op)  # record it
            marks = None if mark is None else mark()  # follow the device's work
            try:
                result = self.comm.reduce_scatter(input_, dim, op)
            except BaseException as e:
                book.failed("reduce_scatter", seq, e, entry, marks)  # name it, record it
                raise
            if entry is not None:
                entry[OUT_SIZES] = result.shape
            book.finished(entry, marks)
            return result
        finally:
            book.end()

    def reduce_scatterv(
        self,
        input_: torch.Tensor,
        dim: int = -1,
        sizes: Sequence[int] | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce, then keep ``sizes[rank]`` entries along ``dim`` (sizes sum to the dim)."""
        return self._book.run("reduce_scatterv", self.comm.reduce_scatterv, input_, dim, sizes,
                              op, data=input_, dim=dim, reduce_op=op)

    def reduce_scatterv_into_output(
        self,
        input_: torch.Tensor,
        output: torch.Tensor,
        dim: int = -1,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce_scatterv` (a sum), its result copied into ``output``, which is
        returned (vLLM's form).

        Raises:
            TypeError: ``output`` is not a tensor.
            ValueError: ``output``'s shape or dtype is not the result's; raised
                after the call, which the peers completed: ``output`` is untouched.
        """
        return _into(self.reduce_scatterv(input_, dim, sizes), output, "reduce_scatterv")

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere."""
        if _tracing() and self.world_size == 1:
            validation.check_rank(dst, 1, "dst")
            return _traced_alone(input_, dim)
        return self._book.run("gather", self.comm.gather, input_, dst, dim, data=input_, dim=dim,
                              root=dst)

    def reduce(
        self, input_: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor | None:
        """Reduce onto ``dst`` (a new tensor there, None elsewhere)."""
        return self._book.run("reduce", self.comm.reduce, input_, dst, op, data=input_, root=dst,
                              reduce_op=op)

    def scatter(self, input_: torch.Tensor | None, src: int = 0, dim: int = 0) -> torch.Tensor:
        """Split ``src``'s tensor into equal slices along ``dim``; rank ``i`` gets slice ``i``."""
        return self._book.run("scatter", self.comm.scatter, input_, src, dim, data=input_,
                              root=src)

    def all_to_all(
        self, input_: torch.Tensor, scatter_dim: int = 0, gather_dim: int = 0
    ) -> torch.Tensor:
        """Slice ``j`` along ``scatter_dim`` goes to rank ``j``; received slices are
        concatenated along ``gather_dim``."""
        return self._book.run("all_to_all", self.comm.all_to_all, input_, scatter_dim,
                              gather_dim, data=input_, dim=(scatter_dim, gather_dim))

    def all_to_allv(
        self,
        input_: torch.Tensor,
        send_sizes: Sequence[int] | torch.Tensor,
        recv_sizes: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``send_sizes[j]`` of ``input_`` (dim 0, rank order) go to rank ``j``; returns
        the rows received, concatenated in rank order (``recv_sizes=None``: exchanged first).

        Mismatched sizes (rank ``i``'s ``recv_sizes[j]`` != rank ``j``'s ``send_sizes[i]``)
        raise ``CollectiveMismatch`` on every rank; see :mod:`device_comms.alltoallv`.
        """
        return self._book.run("all_to_allv", self.comm.all_to_allv, input_, send_sizes,
                              recv_sizes, data=input_)

    def all_gatherv_rows(
        self,
        tensors: Sequence[torch.Tensor],
        sizes: Sequence[int] | None = None,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Gather the rows (dim 0) of several tensors from every rank in one exchange.

        The tensors share this rank's row count (which may differ between
        ranks, and be 0) but not dtype or row shape; the row counts travel
        with the call unless given. See
        :meth:`device_comms.base.DeviceCommunicator.all_gatherv_rows`.

        Returns:
            ``(gathered, sizes)``: one new tensor per input, rank 0's rows
            first; every rank's row count.
        """
        return self._book.run("all_gatherv_rows", self.comm.all_gatherv_rows, tensors, sizes,
                              data=tensors)

    # ------------------------------------------------------------------ MoE (the seed's path)
    @overload
    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: Sequence[torch.Tensor] | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> tuple[Any, ...]: ...

    @overload
    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: Sequence[torch.Tensor] | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> tuple[Any, ...]: ...

    @_outside_graph
    def dispatch(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Gather every token peer's tokens for the experts (the seed's MoE dispatch).

        Two forms, told apart by the third argument (``is_sequence_parallel``
        is a bool, so a tensor there is the routed form's ``topk_ids``):

        * ``dispatch(hidden_states, router_logits, is_sequence_parallel=False,
          extra_tensors=None)``, the seed's (also :meth:`dispatch_router_logits`),
          returns ``(hidden_states, router_logits)``, plus the gathered
          ``extra_tensors`` list when given;
        * ``dispatch(hidden_states, topk_weights, topk_ids,
          is_sequence_parallel=False, extra_tensors=None)``, vLLM's current
          form for routing done before the call, returns ``(hidden_states,
          topk_weights, topk_ids)``, plus the extra list when given.

        Every rank passes its own tokens (rows along dim 0; the counts may
        differ, and be 0). ``is_sequence_parallel=False`` gathers over the
        ranks that hold different tokens from this one's TP group (on the EP
        group of ``parallel_state``: its DP peers), ``True`` over the whole
        group (see :mod:`coordinator.group.moe_calls`). All tensors go in one
        collective call; the row counts travel with it unless ``sizes`` (every
        token peer's count, in rank order) is given. Pair each dispatch with a
        :meth:`combine` (to gather tokens for another use, call
        :meth:`all_gatherv_rows`). A third argument that is neither a bool nor a
        tensor, or arguments that bind to neither form, raise here before any
        collective (the peers wait until the group's timeout).

        Returns:
            New tensors of every token peer's rows concatenated in rank order.

        Raises:
            TypeError: Wrong argument types (names the argument).
            ValueError: The tensors' row counts differ, or ``sizes`` does not fit.
            PeerRejectedError: A peer rejected its arguments.
            CollectiveMismatch: A peer's tensors have other dtypes or row shapes.
        """
        routed = "topk_ids" in kwargs or "topk_weights" in kwargs or (
            len(args) >= 3 and isinstance(args[2], torch.Tensor))
        form = _ROUTED_DISPATCH if routed else _SEED_DISPATCH
        bound = form.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        names = ("hidden_states", "topk_weights", "topk_ids") if routed else \
            ("hidden_states", "router_logits")
        return self._dispatch("dispatch", [(n, a[n]) for n in names], a["is_sequence_parallel"],
                              a["extra_tensors"], a["sizes"])

    @_outside_graph
    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: Sequence[torch.Tensor] | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> tuple[Any, ...]:
        """The seed's :meth:`dispatch` under vLLM's current name."""
        return self._dispatch("dispatch_router_logits",
                              [("hidden_states", hidden_states), ("router_logits", router_logits)],
                              is_sequence_parallel, extra_tensors, sizes)

    def _dispatch(self, op: str, named: list[tuple[str, Any]], is_sequence_parallel: Any,
                  extra_tensors: Any, sizes: Any) -> tuple[Any, ...]:
        """Run a dispatch of the ``named`` tensors; its result as the caller's form returns it:
        the gathered tensors, then the gathered extra list when ``extra_tensors`` was given."""
        self._book.check_live(op)
        gathered, extras = self._moe.dispatch(named, is_sequence_parallel, extra_tensors, sizes)
        return (*gathered, extras) if extras is not None else tuple(gathered)

    @_outside_graph
    def combine(
        self,
        hidden_states: torch.Tensor,
        is_sequence_parallel: bool = False,
        *,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Sum the experts' outputs back onto the ranks whose tokens they are.

        Takes the rows of the matching :meth:`dispatch` (the oldest one not yet
        combined with the same ``is_sequence_parallel``) after the experts ran
        on them, and returns this rank's own rows summed over the token peers:
        a reduce-scatterv with that dispatch's row counts.

        Args:
            hidden_states: ``(sum of the dispatch's row counts, ...)``.
            is_sequence_parallel: As passed to the dispatch.
            sizes: The row counts (checked against the dispatch's; needed only
                for a combine without a dispatch on this group).

        Raises:
            TypeError: ``hidden_states`` is not a tensor, or the flag not a bool.
            ValueError: No dispatch to match, or the row count differs from its
                (on CPU transports the peers raise ``PeerRejectedError``; NCCL's
                peers wait, bounded by the group's timeout).
        """
        self._book.check_live("combine")
        return self._moe.combine(hidden_states, is_sequence_parallel, sizes)

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """A buffer the communicator wants :meth:`combine`'s input in: None here, as
        from vLLM's communicators without one (the caller allocates its own)."""
        return None

    @_outside_graph
    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine`, its result copied into ``output``, which is returned (vLLM's form).

        Raises:
            TypeError: ``output`` is not a tensor (or as :meth:`combine`).
            ValueError: ``output``'s shape or dtype is not the result's (raised
                after the call: ``output`` is untouched), or as :meth:`combine`.
        """
        return _into(self.combine(hidden_states, is_sequence_parallel), output, "combine")

    def set_token_peers(self, group: GroupCoordinator) -> None:
        """Make ``dispatch``/``combine`` with ``is_sequence_parallel=False`` run over
        ``group``: the ranks of this group that hold other tokens than this rank's
        TP peers (``parallel_state`` sets it on the EP group). Not collective:
        every rank sets its own. ``group`` may be this group itself (the default).

        Raises:
            TypeError: ``group`` is not a GroupCoordinator.
            ValueError: ``group`` holds ranks outside this group, or not this rank.
        """
        if not isinstance(group, GroupCoordinator):
            raise TypeError(f"group must be a GroupCoordinator, got {type(group).__name__}")
        self._moe.set_token_peers(group)

    @property
    def token_peers(self) -> GroupCoordinator:
        """The group ``dispatch``/``combine`` with ``is_sequence_parallel=False`` run on."""
        return cast(GroupCoordinator, self._moe.token_peers)  # set_token_peers takes only these

    # ------------------------------------------------------------------ eager, untraced
    def _all_reduce_untraced(self, input_: torch.Tensor, op: ReduceOp,
                             out: torch.Tensor | None) -> torch.Tensor:
        """:meth:`all_reduce` as a recorded call that never asks whether torch.compile
        traces (:data:`_all_reduce_eagerly` runs it outside the graph; asking again
        there would come back here without end while another thread compiles: torch's
        flag is process-wide)."""
        fn = self.comm.all_reduce if out is None else functools.partial(self.comm.all_reduce,
                                                                        out=out)
        return self._book.run_now("all_reduce", fn, input_, op, data=input_, reduce_op=op)

    def _broadcast_untraced(self, input_: torch.Tensor, src: int) -> torch.Tensor:
        """:meth:`broadcast` as a recorded call (see :meth:`_all_reduce_untraced`)."""
        return self._book.run_now("broadcast", self.comm.broadcast, input_, src, data=input_,
                                  root=src)

    def _reduce_scatter_untraced(self, input_: torch.Tensor, dim: int,
                                 op: ReduceOp) -> torch.Tensor:
        """:meth:`reduce_scatter` as a recorded call (see :meth:`_all_reduce_untraced`)."""
        return self._book.run_now("reduce_scatter", self.comm.reduce_scatter, input_, dim, op,
                                  data=input_, dim=dim, reduce_op=op)

    # ------------------------------------------------------------------ the seed's helpers
    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over the group into a new tensor (``input_`` untouched): the eager body
        of the ``groupcoord::all_reduce`` custom op, named as in the seed."""
        return self._book.run("all_reduce", self.comm.all_reduce, input_, data=input_)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather along ``dim`` into a new tensor: the eager body of
        ``groupcoord::all_gather``, named as in the seed."""
        return self._book.run("all_gather", self.comm.all_gather, input_, dim, data=input_,
                              dim=dim)

    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """Reduce-scatter along ``dim`` into a new tensor: the eager body of
        ``groupcoord::reduce_scatter``, named as in the seed."""
        return self._book.run("reduce_scatter", self.comm.reduce_scatter, input_, dim,
                              data=input_, dim=dim)

    @_outside_graph
    def reject_call(self, op: str, error: BaseException, data: Any = None) -> None:
        """Take this rank's part in the peers' collective ``op`` as a rejection of ``error``.

        For code built on this group's collectives that checks its own arguments
        (MoE dispatch/combine): the peers raise ``PeerRejectedError`` naming this
        rank instead of waiting; the caller then raises ``error``. Counts as a call,
        recorded as call ``op`` failed with ``error``.

        Args:
            op: The collective the peers make.
            error: Why this rank rejects its arguments.
            data: The tensor (or list of tensors) this rank would have passed to
                ``op``, whose shapes the recorder keeps as the peers' calls do
                (anything else: none kept).
        """
        book = self._book
        n = book.begin(op)  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            entry = book.record(op, data)
            started = monotonic()
            try:
                self.comm.reject(op, error)
            except BaseException as e:
                book.failed(op, seq, e, entry, started=started)
                raise
            book.completed(entry)
            book.note_failure(op, seq, error, entry)
        finally:
            book.end()

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast in place from ``src``; receivers pass a buffer of the right shape."""
        if _tracing():  # no custom op: the call runs outside the graph
            return _broadcast_eagerly(self, input_, src)
        book = self._book
        n = book.begin("broadcast")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            trace, mark = self._trace, self._marks
            if trace is None and mark is None:  # nothing records this call
                started = monotonic()
                try:
                    return self.comm.broadcast(input_, src)
                except WAIT_ERRORS as e:
                    book.explain("broadcast", seq, e, started=started)  # name what went wrong
                    raise
            entry = None if trace is None else trace.begin_tensor(
                "broadcast", n, book.p2p_calls, input_, -1, None, src)  # record it
            marks = None if mark is None else mark()  # follow the device's work
            try:
                result = self.comm.broadcast(input_, src)
            except BaseException as e:
                book.failed("broadcast", seq, e, entry, marks)  # name what went wrong, record it
                raise
            book.finished(entry, marks)
            return result
        finally:
            book.end()

    @_outside_graph
    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (default: the next rank)."""
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        return self._p2p.send(tensor, dst)

    @_outside_graph
    def recv(
        self, size: torch.Size | Sequence[int], dtype: torch.dtype, src: int | None = None
    ) -> torch.Tensor:
        """Receive a tensor from group rank ``src`` (default: the previous rank)."""
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        return self._p2p.recv(size, dtype, src)

    # ------------------------------------------------------------------ control
    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a CPU ``tensor`` across the group in place and return it, on any group
        (a GPU group's goes over its CPU group): vLLM's small per-step syncs,
        such as the data-parallel padding. Recorded and numbered as an ``all_reduce``.

        Raises:
            TypeError: ``tensor`` is not a tensor.
            ValueError: ``tensor`` is not on the CPU.
        """
        return self._book.run("all_reduce", self._objects.cpu_all_reduce_, tensor, data=tensor,
                              transport=None if self.device.type == "cpu" else "gloo",
                              reduce_op=ReduceOp.SUM)

    @_outside_graph
    def barrier(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Wait for every rank of the group (on the CPU group).

        Args:
            timeout: Seconds (or a ``timedelta``) to wait, ``> 0``: a barrier
                has no poll-once form (every rank must answer rank 0, and an
                answer that comes after rank 0 gave up would break the group's
                connections). ``None`` means the group's timeout. A rank
                missing after that long raises :class:`CommTimeout` naming the ranks.

        Raises:
            TypeError: ``timeout`` is not a number or a timedelta.
            ValueError: ``timeout`` is not positive and finite. Either one is
                raised after this rank took part in the barrier with the
                group's timeout, so that its peers are not left waiting.
        """
        try:
            got = check_timeout(timeout, default=self.timeout, positive=True)
            wait_s, bad = (self.timeout if got is None else got), None
        except (TypeError, ValueError) as e:  # still take part: the peers are not stranded
            wait_s, bad = self.timeout, e
        book = self._book
        n = book.begin("barrier")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            book.check_live("barrier")
            entry = book.record("barrier")
            if self.world_size > 1:
                started = monotonic()
                try:
                    monitored_barrier(self.cpu_group, self.unique_name, wait_s,
                                      book.errors.await_exit)
                except BaseException as e:
                    book.failed("barrier", seq, e, entry, started=started,
                                group_timeout=wait_s == self.timeout)
                    raise
            book.completed(entry)
            if bad is not None:
                book.note_failure("barrier", seq, bad, entry)
                raise bad
        finally:
            book.end()

    @contextlib.contextmanager
    def graph_capture(
        self, graph_capture_context: GraphCaptureContext | None = None
    ) -> Iterator[GraphCaptureContext]:
        """Context for capturing CUDA graphs around this group's collectives.

        On a GPU it makes a side stream current (capture cannot run on the
        default stream; the side stream first waits for the work already queued
        on the current one) and enters the device communicator's capture
        context, which registers what the captured collectives read (the custom
        all-reduce exchanges its captured inputs' IPC handles when the context
        exits: every rank must capture the same collectives). Capture with
        ``torch.cuda.graph(g, stream=ctx.stream)`` inside it.

        On exit the caller's stream waits for the side stream. On CPU the
        context's ``stream`` is None. Nests: pass the outer context to reuse it.
        """
        ctx = graph_capture_context
        if ctx is not None and not isinstance(ctx, GraphCaptureContext):
            raise TypeError(f"graph_capture_context must be a GraphCaptureContext or None, "
                            f"got {type(ctx).__name__}")
        owner = ctx is None
        if ctx is None:
            ctx = GraphCaptureContext(side_stream(self.device))
        caller = torch.cuda.current_stream(self.device) if ctx.stream is not None else None
        with contextlib.ExitStack() as stack:
            if ctx.stream is not None:
                stack.enter_context(torch.cuda.stream(ctx.stream))
            stack.enter_context(self.comm.graph_capture())
            yield ctx
        if owner and caller is not None:
            caller.wait_stream(ctx.stream)  # work queued inside lands before the caller's next

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Let the device communicator register buffers for ``model``."""
        if self.device_communicator is not None:
            self.device_communicator.prepare_communication_buffer_for_model(model)

    def create_mq_broadcaster(
        self,
        writer_rank: int = 0,
        external_writer_handle: Any = None,
        blocking: bool = True,
        **queue_options: Any,
    ) -> Any:
        """Create a message queue from group rank ``writer_rank`` to all others.

        Collective over the CPU group (every rank calls it).

        Args:
            writer_rank: Group rank of the writer.
            external_writer_handle: On ``writer_rank``: a
                :class:`shm_broadcast.Handle` (or its bytes) of an existing
                queue whose writer lives outside the group, as vLLM's keyword:
                nothing is created; the writer rank broadcasts the handle and
                every rank, ``writer_rank`` included, connects to that queue as
                the reader of its group rank (the queue must have readers
                ``0 .. world_size - 1``). Other ranks may pass the same
                handle or None; theirs is not used.
            blocking: Wait until every reader is connected. With False, call
                ``wait_until_ready()`` on the queue before its first message.
            **queue_options: Passed on to the queue: ``max_chunk_bytes``,
                ``max_chunks``, ``connect_ip``, ``wait_policy`` (a
                :class:`shm_broadcast.WaitPolicy`; default
                ``WaitPolicy.predictive()``: readers learn the step period and
                sleep until shortly before each message, see
                :mod:`shm_broadcast.waiting.predictive`), ``warn_interval``
                (seconds a wait lasts before it logs who is behind; default 10,
                or ``GROUPCOORD_MQ_WARN_INTERVAL``); for an external handle only
                ``wait_policy`` and ``warn_interval``.

        Returns:
            The writer's queue on ``writer_rank``, a reader's queue elsewhere
            (on every rank with an external writer's handle).
        """
        from coordinator.group.mq_broadcasters import create_mq_broadcaster

        self._book.check_live("create_mq_broadcaster")
        return create_mq_broadcaster(self, writer_rank, external_writer_handle, blocking,
                                     **queue_options)

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False
    ) -> tuple[Any, list[Any]]:
        """Give every other rank a queue to ``reader_rank_in_group`` (e.g. results
        from workers back to the driver). Collective.

        Returns:
            ``(my_writer, readers)``: a writer rank gets its queue and ``[]``; the
            reader gets ``None`` and the queues indexed by group rank (``None`` at
            its own index). With ``blocking=False`` call ``wait_until_ready()`` on
            each queue, on both sides, before the first message.
        """
        from coordinator.group.mq_broadcasters import create_single_reader_mq_broadcasters

        self._book.check_live("create_single_reader_mq_broadcasters")
        return create_single_reader_mq_broadcasters(self, reader_rank_in_group, blocking)

    def destroy(self) -> None:
        """Release communicators, queues and process groups. Idempotent.

        Its process groups are released before it returns (nothing of the
        group keeps them alive in a reference cycle), and torch then ends their
        gloo threads and sockets: a gloo event-loop thread can still be listed
        in ``/proc`` for a few milliseconds after, as with plain torch.
        """
        if self._book.closed:
            return
        self._book.close()  # calls still running on other threads: ClosedError
        trace = self._book.trace
        if trace is not None:
            trace.closed = True
        REGISTRY.remove(self)
        watch, self._watch, self._marks, self._trace = self._watch, None, None, trace
        self._book.marks = None
        if watch is not None:  # before the communicator goes: no abort during its destroy
            watch.close()
        self._p2p.close()  # links and outstanding handles end (ClosedError), threads joined
        if self.world_size > 1 and not self._book.one_call.wait_idle(0):
            # A collective runs on another thread: end its gloo waits now (it raises
            # ClosedError), not at its timeout; the communicator's own waits end
            # when it is destroyed below.
            break_connections(self.cpu_group, (self.rank_in_group + 1) % self.world_size)
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.close()
            self.mq_broadcaster = None
        # Later calls must fail loudly: with cpu_group None, torch.distributed
        # would silently fall back to the *world* group.
        comm, self.comm = self.comm, setup.DestroyedComm(self.unique_name)  # type: ignore[assignment]
        self.device_communicator = None
        comm.destroy()
        self._objects.close()
        groups = {id(self.cpu_group): self.cpu_group, id(self.device_group): self.device_group}
        for pg in groups.values():
            if pg is not None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(pg)
        self.cpu_group = self.device_group = None
        # The communicator goes now, and with it the process groups it holds (a
        # gloo group's sockets and threads end with its last reference). A call
        # that failed (one blocked on another thread when the group was destroyed,
        # say) may have left its error in a reference cycle with the frames that
        # raised it, a frame holding the error its traceback holds; those frames
        # hold the communicator, which only the garbage collector would free. So
        # when it outlives the last reference this method had, collect now.
        alive = weakref.ref(comm)
        del comm, groups, pg
        if alive() is not None:
            gc.collect()

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name!r}, ranks={self.ranks}, "
            f"rank_in_group={self.rank_in_group}, comm={type(self.comm).__name__})"
        )

    # ------------------------------------------------------------------ objects
    @_outside_graph
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Broadcast a Python object from ``src``; returns it on every rank.

        Uses the message queue when the group has one and ``src`` is its
        writer, else broadcasts of the group's CPU communicator (signed calls:
        a rank making another call there raises ``CollectiveMismatch`` on
        every rank). Either way the object travels as msgspec
        msgpack with tensors and arrays out of band (see
        :mod:`shm_broadcast.codec.message_codec` for what is carried exactly); nothing is
        pickled unless the group was created with ``allow_pickle=True``.

        Raises:
            TypeError: On ``src``: ``obj`` cannot be encoded (the message names
                the type and the ``allow_pickle`` opt-in). The other ranks are
                told and raise ``CollectiveMismatch`` instead of waiting forever.
            DecodeError: On a receiver: the bytes received are malformed.
        """
        return self._objects.broadcast_object(obj, src)

    @_outside_graph
    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: dist.ProcessGroup | None = None
    ) -> list[Any]:
        """Broadcast a list of objects in place (like ``torch.distributed``, without pickle).

        The list travels as one message through the group's CPU communicator
        (signed calls, as :meth:`broadcast_object`), or as plain gloo
        broadcasts over ``group`` when given; receivers pass a list of the
        same length, whose items are replaced.

        Raises:
            TypeError: On ``src``: an entry cannot be encoded (receivers raise
                ``CollectiveMismatch``); ``obj_list`` is not a list.
            CollectiveMismatch: On a receiver: the source failed, or sent a
                list of another length.
        """
        return self._objects.broadcast_object_list(obj_list, src, group)

    @_outside_graph
    def send_object(self, obj: Any, dst: int) -> None:
        """Send a Python object to group rank ``dst`` over the CPU group (no pickle
        unless the group opted in; see :meth:`broadcast_object`).

        Raises:
            TypeError: ``obj`` cannot be encoded; the receiver is told and raises
                ``CollectiveMismatch``.
        """
        self._p2p.send_object(obj, dst)

    @_outside_graph
    def recv_object(self, src: int) -> Any:
        """Receive a Python object from group rank ``src``.

        Raises:
            CollectiveMismatch: The sender could not encode its object.
            DecodeError: The bytes received are malformed.
        """
        return self._p2p.recv_object(src)

    # ------------------------------------------------------------------ tensor dicts
    @_outside_graph
    def broadcast_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any] | None = None,
        src: int = 0,
        group: dist.ProcessGroup | None = None,
        metadata_group: dist.ProcessGroup | None = None,
    ) -> dict[Any, Any] | None:
        """Broadcast a dict of tensors / None / plain data from ``src``.

        Metadata travels once (message queue or CPU group); tensors follow over
        the device communicator (CPU tensors of a GPU group over the CPU group).
        Receivers allocate and get a new dict.
        """
        return self._dicts.broadcast_tensor_dict(tensor_dict, src, group, metadata_group)

    @_outside_graph
    def send_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> dict[Any, Any] | None:
        """Send a tensor dict to group rank ``dst`` (default: next rank).

        With ``all_gather_group`` (n ranks holding the same tensors), each rank
        sends only its 1/n slice of every tensor whose numel divides by n; the
        receivers rebuild it with an all-gather. ``all_gather_tensors`` maps keys
        to True/False to force or disable that per key.

        Returns:
            None; in a group of one rank, ``tensor_dict`` itself (as vLLM).
        """
        return self._dicts.send_tensor_dict(tensor_dict, dst, all_gather_group,
                                            all_gather_tensors)

    @_outside_graph
    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> dict[Any, Any] | None:
        """Receive a dict sent by :meth:`send_tensor_dict` from group rank ``src``.

        Slicing is decided by the sender (recorded in the metadata);
        ``all_gather_tensors`` is accepted for symmetry with the sender.
        """
        return self._dicts.recv_tensor_dict(src, all_gather_group)

    # ------------------------------------------------------------------ asynchronous p2p
    # Handles with wait(timeout=None) / is_completed(); order, errors and closing:
    # see coordinator.p2p.point_to_point.
    @_outside_graph
    def isend(self, tensor: torch.Tensor, dst: int | None = None) -> P2PHandle:
        """Start sending ``tensor`` to group rank ``dst`` (default: the next rank)."""
        return self._p2p.isend(tensor, dst)

    @_outside_graph
    def irecv(self, tensor_or_spec: torch.Tensor | tuple[Sequence[int], torch.dtype],
              src: int | None = None) -> P2PHandle:
        """Start receiving from ``src`` (default: the previous rank) into a tensor, or
        a new one of ``(shape, dtype)``; ``wait()`` returns it."""
        return self._p2p.irecv(tensor_or_spec, src)

    @_outside_graph
    def isend_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> DictSend:
        """Start :meth:`send_tensor_dict` to ``dst`` (default: the next rank), with the
        same slicing for ``all_gather_group``.

        The dict's values travel as they are at the call: the dict and its nested
        lists, dicts, sets, bytearrays and numpy arrays are copied before this
        returns, so the caller may change them at once. Tensors are not copied:
        as with :meth:`isend`, do not write to them before the send's ``wait()``.

        Returns:
            The send's handle in vLLM's form, a list of handles whose ``[1:]``
            covers the whole send, with ``wait()`` (returns None) and
            ``is_completed()`` of its own (:class:`~coordinator.p2p.dict_handles.DictSend`).
        """
        return DictSend(self._dicts.isend_tensor_dict(tensor_dict, dst, all_gather_group,
                                                      all_gather_tensors))

    @_outside_graph
    def irecv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> DictReceive:
        """Start :meth:`recv_tensor_dict` from ``src`` (default: the previous rank).

        Returns the receive in vLLM's form, ``(tensor_dict, handles,
        postprocess)``, whose dict holds what arrived once each handle was
        waited and each postprocess step run; the triple's own ``wait()``
        does both and returns the dict, and ``is_completed()`` polls
        (:class:`~coordinator.p2p.dict_handles.DictReceive`; in a group of
        one rank the dict is None).

        With ``all_gather_group``, the tensors the sender sliced arrive as this
        rank's slices, and are rebuilt from the slices of the group's other
        ranks. On a CPU group that happens in the background, point to point
        over ``all_gather_group`` (its ranks trade slices in the order their
        receives finish, which is the order of the dicts): ``wait()`` only
        waits, and no call of that group between the receive and the wait can
        pair with it. On a CUDA group the first ``wait()`` that finds the
        transfer done rebuilds them with all-gathers over that group (vLLM's
        ``postprocess`` step), so there each of its ranks must make that wait
        at the same point among its calls of that group: poll with
        ``is_completed()``, not with ``wait(0)``. ``all_gather_tensors`` is
        accepted for symmetry with the sender.
        """
        return DictReceive(self._dicts.irecv_tensor_dict(src, all_gather_group),
                           alone=self.world_size == 1)


#: Collectives with no custom op, run outside torch.compile's graph when traced
#: (a graph break; as :func:`coordinator.calls.call_book.run_eagerly`).
_all_reduce_eagerly: Callable[..., torch.Tensor] = _untraced(
    GroupCoordinator._all_reduce_untraced)  # noqa: SLF001 - the class's own eager body
_broadcast_eagerly: Callable[..., torch.Tensor] = _untraced(
    GroupCoordinator._broadcast_untraced)  # noqa: SLF001
_reduce_scatter_eagerly: Callable[..., torch.Tensor] = _untraced(
    GroupCoordinator._reduce_scatter_untraced)  # noqa: SLF001


def _into(result: torch.Tensor, output: Any, op: str) -> torch.Tensor:
    """``output`` holding ``result``, the result of call ``op``.

    Raises:
        TypeError: ``output`` is not a tensor.
        ValueError: ``output``'s shape or dtype differs from ``result``'s (a copy
            would broadcast or convert it).
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"output must be a torch.Tensor, got {type(output).__name__}")
    if output.shape != result.shape or output.dtype != result.dtype:
        raise ValueError(
            f"output must be a {result.dtype} tensor of shape {tuple(result.shape)} (the "
            f"result of {op} on this rank), got {output.dtype} {tuple(output.shape)}")
    output.copy_(result)
    return output


def _dispatch_form(third: str) -> inspect.Signature:
    """The call form of :meth:`GroupCoordinator.dispatch` whose third argument is ``third``."""
    kind, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    second = "router_logits" if third == "is_sequence_parallel" else "topk_weights"
    params = [inspect.Parameter("hidden_states", kind), inspect.Parameter(second, kind)]
    if third != "is_sequence_parallel":
        params.append(inspect.Parameter(third, kind))
    params += [inspect.Parameter("is_sequence_parallel", kind, default=False),
               inspect.Parameter("extra_tensors", kind, default=None),
               inspect.Parameter("sizes", keyword, default=None)]
    return inspect.Signature(params)


_SEED_DISPATCH = _dispatch_form("is_sequence_parallel")
_ROUTED_DISPATCH = _dispatch_form("topk_ids")
# inspect.signature(GroupCoordinator.dispatch) shows the seed's form
GroupCoordinator.dispatch.__signature__ = _SEED_DISPATCH.replace(  # type: ignore[attr-defined]
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                *_SEED_DISPATCH.parameters.values()])


def _link_lookup(links: ShmLinks) -> Callable[[str, int], bool]:
    """``linked(op, peer)`` of the group's :class:`TransportNamer`: whether the
    direction of point-to-point call ``op`` with ``peer`` settled on a link.

    The recorder keeps a group's namer for the process's life: it holds the
    links weakly, so that a destroyed group can go (its later dumps then name
    its point-to-point calls by the communicator)."""
    ref = weakref.ref(links)

    def linked(op: str, peer: int) -> bool:
        got = ref()
        return got is not None and got.settled(SEND if "send" in op else RECV, peer) is not None

    return linked


def side_stream(device: torch.device) -> Any:
    """A new CUDA stream on ``device`` ordered after its current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream

