"""Tensor-dict calls and asynchronous point-to-point of
:class:`~coordinator.group.group_coordinator.GroupCoordinator`.

``broadcast_tensor_dict``, ``send/recv_tensor_dict`` (see
:mod:`coordinator.p2p.tensor_dict` for the wire protocol) and the handles of
``isend``/``irecv``/``isend_tensor_dict``/``irecv_tensor_dict`` (ordering and
closing: :mod:`coordinator.p2p.async_p2p`). A mixin: the coordinator provides the
group state and the call machinery.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from coordinator.group.call_errors import WAIT_ERRORS, CallErrors
from coordinator.p2p import async_p2p
from coordinator.p2p import tensor_dict as tensor_dict_ops
from coordinator.p2p.async_p2p import RECV, SEND, P2PHandle
from device_comms import validation
from shm_broadcast.codec.message_codec import Codec

if TYPE_CHECKING:
    from coordinator.group.group_coordinator import GroupCoordinator

__all__ = ["GroupTensorDictCalls"]


class GroupTensorDictCalls:
    """The tensor-dict and asynchronous point-to-point calls of a group."""

    unique_name: str
    rank_in_group: int
    world_size: int
    ranks: list[int]
    timeout: float
    codec: Codec
    cpu_group: Any
    calls: int
    _errors: CallErrors

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
        try:
            validation.check_rank(src, self.world_size, "src")
        except (TypeError, ValueError) as e:
            if group is None and metadata_group is None:  # plain gloo cannot carry the news
                self._reject_broadcast("broadcast_tensor_dict", e)
            raise
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
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        validation.check_rank(dst, self.world_size, "dst")
        if self.world_size == 1:
            if not isinstance(tensor_dict, Mapping):
                raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
            tensor_dict_ops.check_all_gather_group(all_gather_group)
            return tensor_dict  # type: ignore[return-value]
        self._check_peer(dst, "dst")
        self._run("send_tensor_dict", async_p2p.ordered, self, SEND, dst, "send_tensor_dict",
                  tensor_dict_ops.send_tensor_dict, self, tensor_dict, dst,
                  all_gather_group, all_gather_tensors, partner=dst, p2p=True)
        return None

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
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        validation.check_rank(src, self.world_size, "src")
        if self.world_size == 1:
            tensor_dict_ops.check_all_gather_group(all_gather_group)
            return None
        self._check_peer(src, "src")
        return self._run("recv_tensor_dict", async_p2p.ordered, self, RECV, src,
                         "recv_tensor_dict", tensor_dict_ops.recv_tensor_dict, self, src,
                         all_gather_group, partner=src, p2p=True)

    # ------------------------------------------------------------------ asynchronous p2p
    # Handles with wait(timeout=None) / is_completed(); order, errors and closing:
    # see coordinator.p2p.async_p2p.
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
