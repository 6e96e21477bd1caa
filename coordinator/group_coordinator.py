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
(:mod:`coordinator.call_errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
import time
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from coordinator import async_p2p, custom_ops
from coordinator import broadcast_stamps as stamps
from coordinator.call_errors import WAIT_ERRORS, CallErrors
from coordinator import group_setup as setup
from coordinator import tensor_dict as tensor_dict_ops
from coordinator.async_p2p import RECV, SEND, P2PHandle
from coordinator.errors import CollectiveMismatch, CommTimeout, NotInitializedError
from coordinator.group_registry import REGISTRY
from coordinator import object_comm
from coordinator.object_comm import SERIALIZE_ERRORS, SourceFailure
from device_comms import DeviceCommunicator, ReduceOp, TorchDistributedCommunicator
from device_comms import validation
from shm_broadcast.checks import check_timeout
from shm_broadcast.timeouts import default_timeout
from shm_broadcast.codec import Codec

__all__ = ["GroupCoordinator", "GraphCaptureContext", "side_stream"]


@dataclasses.dataclass
class GraphCaptureContext:
    """What :meth:`GroupCoordinator.graph_capture` yields.

    Attributes:
        stream: The CUDA stream captured on, or None on CPU.
    """

    stream: Any = None


_MONITORED_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")

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
        codec: The :class:`shm_broadcast.codec.Codec` of the object collectives.
        timeout: Seconds every wait of this group may last.
        calls: Calls made so far on this rank; the next call is number
            ``calls + 1`` (errors name it: ranks making the same calls agree).
        collectives: Collective calls (all but point-to-point ones) made so
            far on this rank: the same on every rank of a correct program,
            so it stamps the message-queue broadcasts
            (:mod:`coordinator.broadcast_stamps`).
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
        if not dist.is_initialized():
            raise NotInitializedError(
                "torch.distributed is not initialised; call "
                "coordinator.init_distributed_environment(...) first"
            )
        self.timeout: float = check_timeout(timeout, default=default_timeout(), positive=True)
        self.calls = 0
        self.collectives = 0
        self.unique_name = REGISTRY.unique_name(group_name or "anonymous")
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        backend = str(torch_distributed_backend)
        self.ranks, self.cpu_group, self.device_group = setup.create_process_groups(
            group_ranks, backend, self.rank, datetime.timedelta(seconds=self.timeout)
        )
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.device = setup.pick_device(backend, local_rank)
        self.allow_pickle = allow_pickle
        self.codec = Codec(allow_pickle=allow_pickle)
        self._destroyed = False
        self._p2p_channels: Any = None  # async point-to-point threads (coordinator.async_p2p)
        self._p2p_cuda: Any = None
        self._errors = CallErrors(self.unique_name, self.rank_in_group, self.world_size,
                                  self.timeout)
        if self.world_size > 1:
            self._errors.learn_peers(self.cpu_group)
        self.device_communicator: DeviceCommunicator | None = None
        if use_device_communicator and self.world_size > 1:
            self.device_communicator = setup.build_communicator(
                device_communicator, self.cpu_group, self.device, self.device_group,
                self.unique_name, None if timeout is None else self.timeout,
            )
        self.comm: DeviceCommunicator = self.device_communicator or TorchDistributedCommunicator(
            self.cpu_group, self.device, self.device_group, self.unique_name,
            timeout=None if timeout is None else self.timeout,
        )
        self._cpu_side: DeviceCommunicator | None = None
        self.mq_broadcaster: Any = None
        self.mq_writer_rank = 0
        if use_message_queue_broadcaster and self.world_size > 1 and setup.mq_available():
            self.mq_broadcaster = self.create_mq_broadcaster(writer_rank=0)
        REGISTRY.add(self)

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
    def all_reduce(self, input_: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Element-wise reduction across the group; returns a new tensor.

        Args:
            input_: Tensor on this group's device; same shape and dtype on every rank.
            op: A :class:`ReduceOp`; bitwise ops need integer dtypes, AVG floating.
        """
        if _tracing() and self.world_size > 1 and op is ReduceOp.SUM:
            return custom_ops.traced_all_reduce(self, input_)
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self.comm.all_reduce(input_, op)
        except WAIT_ERRORS as e:
            self._errors.explain("all_reduce", seq, e, started=started)
            raise

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim`` (negative allowed)."""
        if _tracing() and self.world_size > 1:
            return custom_ops.traced_all_gather(self, input_, dim)
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self.comm.all_gather(input_, dim)
        except WAIT_ERRORS as e:
            self._errors.explain("all_gather", seq, e, started=started)
            raise

    def all_gatherv(
        self,
        input_: torch.Tensor | Sequence[torch.Tensor],
        dim: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``i`` contributes ``sizes[i]`` rows along ``dim``.

        ``input_`` may be a list of tensors; then a list comes back.
        """
        return self._run("all_gatherv", self.comm.all_gatherv, input_, dim, sizes)

    def reduce_scatter(
        self, input_: torch.Tensor, dim: int = -1, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce, then keep this rank's equal slice along ``dim``."""
        if _tracing() and self.world_size > 1 and op is ReduceOp.SUM:
            return custom_ops.traced_reduce_scatter(self, input_, dim)
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self.comm.reduce_scatter(input_, dim, op)
        except WAIT_ERRORS as e:
            self._errors.explain("reduce_scatter", seq, e, started=started)
            raise

    def reduce_scatterv(
        self,
        input_: torch.Tensor,
        dim: int = -1,
        sizes: Sequence[int] | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce, then keep ``sizes[rank]`` entries along ``dim`` (sizes sum to the dim)."""
        return self._run("reduce_scatterv", self.comm.reduce_scatterv, input_, dim, sizes, op)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere."""
        return self._run("gather", self.comm.gather, input_, dst, dim)

    def reduce(
        self, input_: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor | None:
        """Reduce onto ``dst`` (a new tensor there, None elsewhere)."""
        return self._run("reduce", self.comm.reduce, input_, dst, op)

    def scatter(self, input_: torch.Tensor | None, src: int = 0, dim: int = 0) -> torch.Tensor:
        """Split ``src``'s tensor into equal slices along ``dim``; rank ``i`` gets slice ``i``."""
        return self._run("scatter", self.comm.scatter, input_, src, dim)

    def all_to_all(
        self, input_: torch.Tensor, scatter_dim: int = 0, gather_dim: int = 0
    ) -> torch.Tensor:
        """Slice ``j`` along ``scatter_dim`` goes to rank ``j``; received slices are
        concatenated along ``gather_dim``."""
        return self._run("all_to_all", self.comm.all_to_all, input_, scatter_dim, gather_dim)

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
        return self._run("all_to_allv", self.comm.all_to_allv, input_, send_sizes, recv_sizes)

    def reject_call(self, op: str, error: BaseException) -> None:
        """Take this rank's part in the peers' collective ``op`` as a rejection of ``error``.

        For code built on this group's collectives that checks its own arguments
        (MoE dispatch/combine): the peers raise ``PeerRejectedError`` naming this
        rank instead of waiting; the caller then raises ``error``. Counts as a call.
        """
        self._run(op, self.comm.reject, op, error)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast in place from ``src``; receivers pass a buffer of the right shape."""
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self.comm.broadcast(input_, src)
        except WAIT_ERRORS as e:
            self._errors.explain("broadcast", seq, e, started=started)
            raise

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (default: the next rank)."""
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        try:
            return async_p2p.ordered(self, SEND, dst, "send", self.comm.send, tensor, dst)
        except WAIT_ERRORS as e:
            self._errors.explain("send", seq, e, partner=_peer(dst), started=started)
            raise

    def recv(
        self, size: torch.Size | Sequence[int], dtype: torch.dtype, src: int | None = None
    ) -> torch.Tensor:
        """Receive a tensor from group rank ``src`` (default: the previous rank)."""
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        try:
            return async_p2p.ordered(self, RECV, src, "recv", self.comm.recv, size, dtype, src)
        except WAIT_ERRORS as e:
            self._errors.explain("recv", seq, e, partner=_peer(src), started=started)
            raise

    # ------------------------------------------------------------------ objects
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Broadcast a Python object from ``src``; returns it on every rank.

        Uses the message queue when the group has one and ``src`` is its
        writer, else broadcasts of the group's CPU communicator (signed calls:
        a rank making another call there raises ``CollectiveMismatch`` on
        every rank). Either way the object travels as msgspec
        msgpack with tensors and arrays out of band (see
        :mod:`shm_broadcast.codec` for what is carried exactly); nothing is
        pickled unless the group was created with ``allow_pickle=True``.

        Raises:
            TypeError: On ``src``: ``obj`` cannot be encoded (the message names
                the type and the ``allow_pickle`` opt-in). The other ranks are
                told and raise ``CollectiveMismatch`` instead of waiting forever.
            DecodeError: On a receiver: the bytes received are malformed.
        """
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self._broadcast_object(obj, src)
        except WAIT_ERRORS as e:
            self._errors.explain("broadcast_object", seq, e, writer=self.mq_writer_rank,
                                 started=started)
            raise

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        validation.check_rank(src, self.world_size, "src")
        if self.world_size == 1:
            return obj
        if self.rank_in_group == src:
            try:
                return self._broadcast_raw(obj, src)
            except SERIALIZE_ERRORS as e:
                self._broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src)
                raise TypeError(
                    f"broadcast_object on group {self.unique_name!r}: obj of type "
                    f"{type(obj).__name__} cannot be serialised ({type(e).__name__}: {e})"
                ) from e
        got = self._broadcast_raw(None, src)
        if isinstance(got, SourceFailure):
            raise CollectiveMismatch(
                f"broadcast_object on group {self.unique_name!r}: the source rank {src} could "
                f"not send its object ({got.message}); fix the call on rank {src}",
                queue=self.unique_name, peers=(src,),
            )
        return got

    def _broadcast_raw(self, obj: Any, src: int, group: dist.ProcessGroup | None = None,
                       op: str = "broadcast_object", queue: bool = True) -> Any:
        """One object from ``src`` to all, unchecked.

        Through the message queue when ``queue``, ``group`` is None and ``src``
        is its writer (the message carries this collective call's number, see
        :mod:`coordinator.broadcast_stamps`); else as bytes through this
        group's signed CPU communicator (``group`` None), or as plain gloo
        broadcasts over ``group``.
        """
        if (queue and group is None and self.mq_broadcaster is not None
                and src == self.mq_writer_rank):
            self._check_live(op)
            mq = self.mq_broadcaster  # the group's timeout is its default
            if self.rank_in_group == src:
                mq.broadcast_object(stamps.stamp(obj, self.collectives, op))
                return obj
            return stamps.unstamp(mq.broadcast_object(None), self.collectives, op,
                                  self.unique_name, src, self.calls)
        self._check_live(op)
        if group is None:
            bcast = object_comm.comm_broadcast(self._cpu_comm(), src)
        else:
            bcast = object_comm.gloo_broadcast(self.ranks[src], group)
        is_src = self.rank_in_group == src
        return object_comm.broadcast_object(obj if is_src else None, self.ranks[src], bcast,
                                            self.codec, is_src)

    def _cpu_comm(self) -> DeviceCommunicator:
        """The communicator that carries this group's CPU bytes (objects, metadata):
        the device communicator on a CPU group, else a signed gloo one over
        ``cpu_group``, built at first use."""
        if self.device.type == "cpu":
            return self.comm
        if self._cpu_side is None:
            self._cpu_side = TorchDistributedCommunicator(
                self.cpu_group, torch.device("cpu"), self.cpu_group, self.unique_name,
                timeout=self.timeout)
        return self._cpu_side

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
        return self._run("broadcast_object_list", self._broadcast_object_list, obj_list, src,
                         group)

    def _broadcast_object_list(self, obj_list: list[Any], src: int,
                               group: dist.ProcessGroup | None) -> list[Any]:
        if not isinstance(obj_list, list):
            raise TypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
        validation.check_rank(src, self.world_size, "src")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch ProcessGroup or None, got {type(group).__name__}")
        if self.world_size == 1:
            return obj_list
        op = "broadcast_object_list"
        if self.rank_in_group == src:
            try:
                self._broadcast_raw(list(obj_list), src, group, op, queue=False)
            except SERIALIZE_ERRORS as e:  # nothing was sent: tell the receivers instead
                self._broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src, group, op,
                                    queue=False)
                raise TypeError(
                    f"broadcast_object_list on group {self.unique_name!r}: an entry of "
                    f"obj_list cannot be serialised ({type(e).__name__}: {e})"
                ) from e
            return obj_list
        got = self._broadcast_raw(None, src, group, op, queue=False)
        why = _list_mismatch(got, len(obj_list))
        if why is not None:
            raise CollectiveMismatch(
                f"broadcast_object_list on group {self.unique_name!r}: the source rank {src} "
                f"could not send its objects ({why}); fix the call on rank {src}",
                queue=self.unique_name, peers=(src,),
            )
        obj_list[:] = got
        return obj_list

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a Python object to group rank ``dst`` over the CPU group (no pickle
        unless the group opted in; see :meth:`broadcast_object`).

        Raises:
            TypeError: ``obj`` cannot be encoded; the receiver is told and raises
                ``CollectiveMismatch``.
        """
        self._run("send_object", async_p2p.ordered, self, SEND, dst, "send_object",
                  self._send_object, obj, dst, partner=_peer(dst), p2p=True)

    def _send_object(self, obj: Any, dst: int) -> None:
        """:meth:`send_object` without counting a call (for calls built on it)."""
        self._check_peer(dst, "dst")
        self._cpu_call("send_object", object_comm.send_object, obj, self.ranks[dst],
                       self.cpu_group, self.codec)

    def recv_object(self, src: int) -> Any:
        """Receive a Python object from group rank ``src``.

        Raises:
            CollectiveMismatch: The sender could not encode its object.
            DecodeError: The bytes received are malformed.
        """
        return self._run("recv_object", async_p2p.ordered, self, RECV, src, "recv_object",
                         self._recv_object, src, partner=_peer(src), p2p=True)

    def _recv_object(self, src: int) -> Any:
        """:meth:`recv_object` without counting a call (for calls built on it)."""
        self._check_peer(src, "src")
        return self._cpu_call("recv_object", object_comm.recv_object, self.ranks[src],
                              self.cpu_group, self.codec)

    # ------------------------------------------------------------------ tensor dicts
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
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self._broadcast_tensor_dict(tensor_dict, src, group, metadata_group)
        except WAIT_ERRORS as e:
            self._errors.explain("broadcast_tensor_dict", seq, e, writer=self.mq_writer_rank,
                                 started=started)
            raise

    def _broadcast_tensor_dict(self, tensor_dict: Mapping[Any, Any] | None, src: int,
                               group: dist.ProcessGroup | None,
                               metadata_group: dist.ProcessGroup | None) -> dict[Any, Any] | None:
        validation.check_rank(src, self.world_size, "src")
        if self.rank_in_group == src and not isinstance(tensor_dict, Mapping):
            err = TypeError(f"tensor_dict must be a dict on src, got {type(tensor_dict).__name__}")
            if self.world_size > 1:  # the receivers are waiting: make them raise too
                tensor_dict_ops.abort_broadcast(self, src, group, metadata_group, str(err))
            raise err
        if self.world_size == 1:
            return dict(tensor_dict)  # type: ignore[arg-type]
        return tensor_dict_ops.broadcast_tensor_dict(self, tensor_dict, src, group, metadata_group)

    def send_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any],
        dst: int | None = None,
        all_gather_group: "GroupCoordinator | None" = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> None:
        """Send a tensor dict to group rank ``dst`` (default: next rank).

        With ``all_gather_group`` (n ranks holding the same tensors), each rank
        sends only its 1/n slice of every tensor whose numel divides by n; the
        receivers rebuild it with an all-gather. ``all_gather_tensors`` maps keys
        to True/False to force or disable that per key.
        """
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        validation.check_rank(dst, self.world_size, "dst")
        if not isinstance(tensor_dict, Mapping):
            raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
        if self.world_size == 1:
            return
        self._check_peer(dst, "dst")
        self._run("send_tensor_dict", async_p2p.ordered, self, SEND, dst, "send_tensor_dict",
                  tensor_dict_ops.send_tensor_dict, self, tensor_dict, dst,
                  _ag(all_gather_group), all_gather_tensors, partner=dst, p2p=True)

    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: "GroupCoordinator | None" = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> dict[Any, Any] | None:
        """Receive a dict sent by :meth:`send_tensor_dict` from group rank ``src``.

        Slicing is decided by the sender (recorded in the metadata);
        ``all_gather_tensors`` is accepted for symmetry with the sender.
        """
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        validation.check_rank(src, self.world_size, "src")
        if self.world_size == 1:
            return None
        self._check_peer(src, "src")
        return self._run("recv_tensor_dict", async_p2p.ordered, self, RECV, src,
                         "recv_tensor_dict", tensor_dict_ops.recv_tensor_dict, self, src,
                         _ag(all_gather_group), partner=src, p2p=True)

    # ------------------------------------------------------------------ asynchronous p2p
    # Handles with wait(timeout=None) / is_completed(); order, errors and closing:
    # see coordinator.async_p2p.
    def isend(self, tensor: torch.Tensor, dst: int | None = None) -> P2PHandle:
        """Start sending ``tensor`` to group rank ``dst`` (default: the next rank)."""
        return async_p2p.isend(self, tensor, dst)

    def irecv(self, tensor_or_spec: torch.Tensor | tuple[Sequence[int], torch.dtype],
              src: int | None = None) -> P2PHandle:
        """Start receiving from ``src`` (default: the previous rank) into a tensor, or
        a new one of ``(shape, dtype)``; ``wait()`` returns it."""
        return async_p2p.irecv(self, tensor_or_spec, src)

    def isend_tensor_dict(self, tensor_dict: Mapping[Any, Any],
                          dst: int | None = None) -> P2PHandle:
        """Start :meth:`send_tensor_dict` to ``dst`` (default: the next rank)."""
        return async_p2p.isend_tensor_dict(self, tensor_dict, dst)

    def irecv_tensor_dict(self, src: int | None = None) -> P2PHandle:
        """Start :meth:`recv_tensor_dict` from ``src`` (default: the previous rank);
        ``wait()`` returns the dict."""
        return async_p2p.irecv_tensor_dict(self, src)

    # ------------------------------------------------------------------ control
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
            ValueError: ``timeout`` is not positive and finite.
        """
        wait_s = check_timeout(timeout, default=self.timeout, positive=True)
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        if self.world_size == 1:
            return
        self._check_live("barrier")
        try:
            self._monitored_barrier(wait_s)
        except WAIT_ERRORS as e:
            self._errors.explain("barrier", seq, e,
                                 started=started if wait_s == self.timeout else None)
            raise

    def _monitored_barrier(self, wait_s: float) -> None:
        """gloo's monitored barrier: group rank 0 collects every rank and names the
        missing ones; the others wait for rank 0's release."""
        start = time.monotonic()
        try:
            dist.monitored_barrier(group=self.cpu_group,
                                   timeout=datetime.timedelta(seconds=wait_s),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            found = _MONITORED_MISSING.search(str(e))
            if found is None:
                raise
            missing = [int(r) for r in found.group(1).replace(",", " ").split()]
            if time.monotonic() - start < 0.9 * wait_s:
                # Failed before the timeout: their connection broke, so they are
                # probably exiting; let the explanation see them gone.
                self._errors.await_exit(missing)
            raise CommTimeout(
                f"group {self.unique_name!r}, op barrier: rank(s) {missing} did not arrive "
                f"within {wait_s:g}s ({str(e).splitlines()[0]})",
                queue=self.unique_name, peers=missing) from e

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

        On exit the caller's stream waits for the side stream. On CPU it
        yields a context whose ``stream`` is None. Nests: pass the outer
        context to reuse its stream.
        """
        ctx = graph_capture_context
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

        Collective over the CPU group (every rank calls it), unless
        ``external_writer_handle`` is given: then this rank only connects, as a
        reader, to a queue whose writer lives elsewhere.

        Args:
            writer_rank: Group rank of the writer.
            external_writer_handle: A :class:`shm_broadcast.Handle` (or its bytes)
                of an existing queue to read from.
            blocking: Wait until every reader is connected (always done for
                collective creation, so no message can be lost).
            **queue_options: Passed on to the queue: ``max_chunk_bytes``,
                ``max_chunks``, ``connect_ip``, ``wait_policy`` (a
                :class:`shm_broadcast.WaitPolicy`; default
                ``WaitPolicy.predictive()``: readers learn the step period and
                sleep until shortly before each message, see
                :mod:`shm_broadcast.predictive`); for an external handle only
                ``wait_policy``.

        Returns:
            The writer's queue on ``writer_rank``, a reader's queue elsewhere.
        """
        from coordinator.mq_broadcasters import create_mq_broadcaster

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
        from coordinator.mq_broadcasters import create_single_reader_mq_broadcasters

        return create_single_reader_mq_broadcasters(self, reader_rank_in_group, blocking)

    def destroy(self) -> None:
        """Release communicators, queues and process groups. Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        REGISTRY.remove(self)
        async_p2p.close(self)  # outstanding handles end (ClosedError), threads are joined
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.close()
            self.mq_broadcaster = None
        # Later calls must fail loudly: with cpu_group None, torch.distributed
        # would silently fall back to the *world* group.
        comm, self.comm = self.comm, setup.DestroyedComm(self.unique_name)  # type: ignore[assignment]
        self.device_communicator = None
        comm.destroy()
        if self._cpu_side is not None:
            self._cpu_side.destroy()
            self._cpu_side = None
        for pg in {id(self.cpu_group): self.cpu_group, id(self.device_group): self.device_group}.values():
            if pg is not None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(pg)
        self.cpu_group = self.device_group = None

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name!r}, ranks={self.ranks}, "
            f"rank_in_group={self.rank_in_group}, comm={type(self.comm).__name__})"
        )

    # ------------------------------------------------------------------ helpers
    def _check_peer(self, r: Any, arg: str) -> None:
        validation.check_rank(r, self.world_size, arg)
        if r == self.rank_in_group:
            raise ValueError(f"{arg}={r} is this rank; point-to-point needs another rank")

    def _check_live(self, op: str) -> None:
        if self._destroyed:
            raise NotInitializedError(setup.destroyed_msg(self.unique_name, op))

    def _run(self, op: str, fn: Any, *args: Any, partner: int | None = None,
             p2p: bool = False) -> Any:
        """Run ``fn(*args)`` as call ``op`` of this group: numbered (a collective
        call, unless ``p2p``), and a failed wait explained (see
        :mod:`coordinator.call_errors`). The busiest calls inline this."""
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        if not p2p:
            self.collectives += 1
        try:
            return fn(*args)
        except WAIT_ERRORS as e:
            self._errors.explain(op, seq, e, partner=partner, started=started)
            raise

    def _cpu_call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a gloo call of this group (backend errors are translated by the
        public method's :class:`~coordinator.call_errors.CallErrors`)."""
        self._check_live(op)
        return fn(*args, **kwargs)


def side_stream(device: torch.device) -> Any:
    """A new CUDA stream on ``device`` ordered after its current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _tracing() -> bool:
    """True while torch.compile traces: collectives become ``groupcoord::`` custom ops,
    opaque graph nodes whose implementation calls back into the eager path."""
    return torch.compiler.is_compiling()


def _list_mismatch(got: Any, n: int) -> str | None:
    """Why a received object list cannot fill a receiver's list of ``n`` (None: it can)."""
    if isinstance(got, SourceFailure):
        return got.message
    if type(got) is not list:
        return f"it sent a {type(got).__name__}, not a list"
    if len(got) != n:
        return f"it sent {len(got)} objects, this rank's obj_list has {n}"
    return None


def _peer(rank: Any) -> int | None:
    """A point-to-point call's peer rank, when it is one (for error messages)."""
    return rank if type(rank) is int else None


def _ag(group: Any) -> "GroupCoordinator | None":
    if group is None or isinstance(group, GroupCoordinator):
        return group
    raise TypeError(f"all_gather_group must be a GroupCoordinator, got {type(group).__name__}")
