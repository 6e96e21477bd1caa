"""The abstract device communicator that every transport implements.

A communicator moves tensors among the ranks of one group on one kind of device.
:class:`DeviceCommunicator` fixes the public surface; its public methods check
arguments (``TypeError``/``ValueError`` naming the argument), answer a group of
one without communicating, normalise ``dim``, and translate backend failures
into this package's errors. Subclasses implement the protected ``_hooks``,
which receive validated, contiguous tensors, non-negative dims and group-local
ranks.

Conventions for every operation:

* ranks are ranks *within the group* (``0 .. world_size-1``);
* results are new tensors; inputs are never modified, except by
  :meth:`broadcast`, whose receivers pass the buffer to fill (as in
  ``torch.distributed``) and by :meth:`recv` callers' nothing (it allocates);
* every rank gets a bitwise identical result from reductions.

**Device marks and aborts.** A group that watches its device calls (the
watchdog of :mod:`coordinator.trace.watchdog`) asks :meth:`DeviceCommunicator.device_marks`
before each call for an object that tells, when asked later, whether the call's
device work started and completed; the base has none (its calls are complete
when they return). :meth:`DeviceCommunicator.abort` breaks a communicator from
any thread: calls blocked inside it raise the error given, later calls raise
:class:`~device_comms.errors.BrokenCommunicator` saying why.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar, cast

import torch
import torch.distributed as dist

from device_comms import alltoallv, row_gather, validation
from device_comms.errors import (
    BrokenCommunicator,
    CollectiveMismatch,
    CommunicatorClosed,
    DeviceCommError,
    add_note,
    translate_backend_error,
    with_own_arguments,
)
from device_comms.reduce_op import ReduceOp, check_reduce_op
from shm_broadcast import checks
from shm_broadcast.checks import check_timeout
from shm_broadcast.codec.tensor_layout import clone

__all__ = ["DeviceCommunicator"]

#: The collectives a rank may reject (:meth:`DeviceCommunicator.reject`), and the
#: point-to-point ops, which need the peer.
_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
    "gather", "reduce", "broadcast", "scatter", "all_to_all", "all_to_allv", "all_gatherv_rows",
})
_P2P_OPS = frozenset({"send", "recv"})
_R = TypeVar("_R")  # what a guarded hook returns


class DeviceCommunicator(abc.ABC):
    """Abstract base of all device communicators.

    Class attributes:
        name: Registry name (``"cpu"``, ``"torch"``, later ``"pynccl"``...).
        device_types: Device types served (``{"cpu"}``, ``{"cuda"}``).
        priority: Higher wins when several available communicators serve a device.
        provides_device_marks: Whether :meth:`device_marks` returns marks (the
            base returns None).

    Args:
        cpu_group: A gloo group over the same ranks (handshakes, metadata).
        device: The device this rank's tensors live on.
        device_group: The group that carries tensor payloads (defaults to
            ``cpu_group``; a NCCL group for CUDA communicators).
        unique_name: The owning group's unique name (used in errors and names).
        timeout: Seconds any wait of this communicator may last (``0`` polls
            once; None: the communicator's own default). A communicator that
            a ``GroupCoordinator`` builds gets the group's timeout.
    """

    name: ClassVar[str] = ""
    device_types: ClassVar[frozenset[str]] = frozenset()
    priority: ClassVar[int] = 0
    provides_device_marks: ClassVar[bool] = False

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        device: torch.device,
        device_group: dist.ProcessGroup | None = None,
        unique_name: str = "",
        *,
        timeout: float | None = None,
    ) -> None:
        self.timeout: float | None = check_timeout(timeout)
        self.cpu_group = validation.check_group(cpu_group, "cpu_group")
        self.device_group = (cpu_group if device_group is None
                             else validation.check_group(device_group, "device_group"))
        self.device = validation.check_device(device)
        self.unique_name = checks.check_str(unique_name, "unique_name") or f"{self.name}-group"
        self.rank_in_group: int = dist.get_rank(cpu_group)
        self.world_size: int = dist.get_world_size(cpu_group)
        self.ranks: list[int] = dist.get_process_group_ranks(cpu_group)
        self.rank: int = self.ranks[self.rank_in_group]
        self._closed = False  # calls refused: destroyed, or aborted (_check_open says which)
        self._destroyed = False
        self._broken: BaseException | None = None  # why abort() broke it
        self._call_number: Callable[[], int] | None = None

    # ------------------------------------------------------------------ registry
    @classmethod
    def is_available(cls) -> bool:
        """Whether this communicator can run in this process (libraries, hardware)."""
        return True

    @classmethod
    def serves(cls, device: torch.device) -> bool:
        """Whether this communicator handles tensors on ``device``."""
        return torch.device(device).type in cls.device_types

    # ------------------------------------------------------------------ public API
    def all_reduce(
        self,
        input_: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reduce ``input_`` element-wise across ranks.

        Args:
            input_: The local operand (same shape and dtype on every rank).
            op: The reduction.
            out: Where to write the result: a contiguous tensor of ``input_``'s
                shape, dtype and device, which may be ``input_`` itself (in
                place) but must not otherwise overlap it. None: a new tensor.

        Returns:
            ``out`` when given, else a new tensor.
        """
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device)
            rop = check_reduce_op(op, t.dtype)
            if out is not None:
                validation.check_out(out, t, self.device)
        except (TypeError, ValueError) as e:
            self._reject("all_reduce", e)
            raise
        t = validation.dense(t)  # transports move raw elements
        if self.world_size == 1:
            with torch.no_grad():
                return t.clone() if out is None else out.copy_(t)
        if out is None:
            return self._guard("all_reduce", self._all_reduce, t, rop)
        return self._guard("all_reduce", self._all_reduce_into, t, rop, out)

    def all_gather(self, input_: torch.Tensor, dim: int = -1, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim`` (same shape on all ranks).

        Args:
            input_: The local piece.
            dim: The dimension to concatenate along (negative allowed).
            out: Where to write the result instead of a new tensor: contiguous,
                ``input_``'s dtype and device, ``input_``'s shape with ``dim``
                world-size times as long, sharing no memory with ``input_``.

        Returns:
            ``out`` when given, else a new tensor.
        """
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device, copied=True)
            d = validation.gather_dim(t, dim, self.world_size)
            if out is not None:
                validation.check_gather_out(out, t, d, self.world_size, self.device)
        except (TypeError, ValueError) as e:
            self._reject("all_gather", e)
            raise
        if self.world_size == 1:
            return t.clone() if out is None else out.copy_(t)
        if out is None:
            return self._guard("all_gather", self._all_gather, validation.dense(t), d)
        return self._guard("all_gather", self._all_gather_into, validation.dense(t), d, out)

    def all_gatherv(
        self,
        input_: torch.Tensor | Sequence[torch.Tensor],
        dim: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``i`` contributes ``sizes[i]`` along ``dim``.

        ``input_`` may be a list of tensors (each gathered the same way; a list
        comes back). ``sizes=None`` means equal sizes (plain all-gather).
        """
        self._check_open()
        if isinstance(input_, (list, tuple)):
            # Validate every tensor before the first collective, so a bad one
            # raises here (and makes the peers, already inside the collective
            # of the first tensor, raise too) instead of leaving them waiting.
            try:
                for i, x in enumerate(input_):
                    self._check_gatherv(x, dim, sizes, f"input_[{i}]")
            except (TypeError, ValueError) as e:
                self._reject("all_gatherv" if sizes is not None else "all_gather", e)
                raise
            self._same_count(len(input_))
            # one tensor in, one out (a subclass's own all_gatherv serves each tensor)
            return [cast(torch.Tensor, self.all_gatherv(x, dim, sizes)) for x in input_]
        try:
            t, d, sz = self._check_gatherv(input_, dim, sizes, "input_")
        except (TypeError, ValueError) as e:
            self._reject("all_gatherv" if sizes is not None else "all_gather", e)
            raise
        if sz is None:
            return self.all_gather(t, d)
        if self.world_size == 1:
            return t.clone()
        return self._guard("all_gatherv", self._all_gatherv, validation.dense(t), d, sz)

    def all_gatherv_rows(
        self,
        tensors: Sequence[torch.Tensor],
        sizes: Sequence[int] | None = None,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Gather the rows (dim 0) of several tensors from every rank in one exchange.

        The tensors share this rank's row count (any count, also 0, and it may
        differ between ranks) but not their dtypes or row shapes; every rank
        passes tensors of the same dtypes and row shapes in the same order.
        They travel side by side as one byte matrix (:mod:`device_comms.row_gather`),
        so the whole call is one exchange of data, preceded by one exchange of
        the row counts when ``sizes`` is not given (the shared-memory engine
        carries counts and rows in one step, and checks given ``sizes``
        against the counts). The transports that sign their calls sign the
        tensors' layout too.

        Args:
            tensors: This rank's tensors (at least 1-D, the same row count).
            sizes: Every rank's row count, in group rank order (the same list on
                every rank), when the caller knows them; None: exchanged first.

        Returns:
            ``(gathered, sizes)``: for each tensor a new one of ``sum(sizes)``
            rows, rank 0's first; and the row counts.

        Raises:
            TypeError: ``tensors`` is not a non-empty list of tensors, or
                ``sizes`` not a list of ints.
            ValueError: The tensors' row counts differ, ``sizes`` has the wrong
                length, or its entry for this rank is not this rank's row count.
            PeerRejectedError: A peer rejected its arguments (on CUDA only
                without ``sizes``: the counts' exchange carries the rejection).
            CollectiveMismatch: The ranks' layouts or ``sizes`` lists differ (on
                the CPU transports, which sign their calls; CUDA signs nothing),
                or their row counts make a result too large to hold.
        """
        self._check_open()
        op = "all_gatherv_rows" if sizes is None else "all_gatherv"
        try:
            ts = row_gather.check_row_tensors(tensors, self.device)
            n = ts[0].shape[0]
            sz = None
            if sizes is not None:
                sz = validation.check_sizes(sizes, self.world_size)
                if sz[self.rank_in_group] != n:
                    raise ValueError(
                        f"sizes[{self.rank_in_group}] is {sz[self.rank_in_group]} but this "
                        f"rank's tensors have {n} rows; every rank passes the same sizes "
                        f"list, with its own entry matching its row count")
                validation.check_fits((sum(sz), sum(row_gather.row_bytes(t) for t in ts)),
                                      torch.uint8, self.device, "sizes")
        except (TypeError, ValueError) as e:
            self._reject(op, e)
            raise
        if self.world_size == 1:
            return [t.clone() for t in ts], [n]
        return self._guard(op, self._all_gatherv_rows, [validation.dense(t) for t in ts], sz)

    def _same_count(self, n: int) -> None:
        """Agree that every rank passed a list of ``n`` tensors (one all_gather),
        so that no rank makes more per-tensor calls than another."""
        if self.world_size == 1:
            return
        counts = self.all_gather(torch.tensor([n], dtype=torch.int64, device=self.device), 0)
        got = [int(c) for c in counts.tolist()]
        if len(set(got)) > 1:
            odd = [r for r, c in enumerate(got) if c != n]
            raise CollectiveMismatch(
                f"group {self.unique_name!r}, op all_gatherv: ranks passed lists of {got} "
                f"tensors (by rank); every rank must pass the same number",
                queue=self.unique_name, peers=tuple(odd))

    def _check_gatherv(
        self, input_: Any, dim: int, sizes: Sequence[int] | None, arg: str
    ) -> tuple[torch.Tensor, int, list[int] | None]:
        t = validation.check_tensor(input_, arg, self.device, copied=True)
        d = validation.norm_dim(dim, t.dim())
        if sizes is None:
            return t, d, None
        sz = validation.check_sizes(sizes, self.world_size)
        validation.check_fits([*t.shape[:d], sum(sz), *t.shape[d + 1:]], t.dtype, t.device, "sizes")
        if t.shape[d] != sz[self.rank_in_group]:
            raise ValueError(
                f"{arg}.shape[{dim}] is {t.shape[d]} on rank {self.rank_in_group} but "
                f"sizes[{self.rank_in_group}] is {sz[self.rank_in_group]}; every rank must "
                f"pass the same sizes list, with its own entry matching its input"
            )
        return t, d, sz

    def reduce_scatter(
        self, input_: torch.Tensor, dim: int = -1, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce across ranks, then give rank ``i`` the ``i``-th equal slice along ``dim``."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device)
            d = validation.norm_dim(dim, t.dim())
            rop = check_reduce_op(op, t.dtype)
            validation.check_divisible(t.shape[d], self.world_size, f"input_.shape[{dim}]")
        except (TypeError, ValueError) as e:
            self._reject("reduce_scatter", e)
            raise
        if self.world_size == 1:
            return t.clone()
        return self._guard("reduce_scatter", self._reduce_scatter, validation.dense(t), d, rop)

    def reduce_scatterv(
        self,
        input_: torch.Tensor,
        dim: int = -1,
        sizes: Sequence[int] | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce-scatter where rank ``i`` receives ``sizes[i]`` entries along ``dim``."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device)
            d = validation.norm_dim(dim, t.dim())
            if sizes is not None:
                rop = check_reduce_op(op, t.dtype)
                sz = validation.check_sizes(sizes, self.world_size, total=t.shape[d])
        except (TypeError, ValueError) as e:
            self._reject("reduce_scatter" if sizes is None else "reduce_scatterv", e)
            raise
        if sizes is None:
            return self.reduce_scatter(t, d, op)
        if self.world_size == 1:
            return t.clone()
        return self._guard(
            "reduce_scatterv", self._reduce_scatterv, validation.dense(t), d, sz, rop)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device, copied=True)
            dst = validation.check_rank(dst, self.world_size, "dst")
            d = validation.gather_dim(t, dim, self.world_size)
        except (TypeError, ValueError) as e:
            self._reject("gather", e)
            raise
        if self.world_size == 1:
            return t.clone()
        return self._guard("gather", self._gather, validation.dense(t), dst, d)

    def reduce(
        self, input_: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor | None:
        """Reduce onto ``dst`` (new tensor there, None elsewhere)."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device)
            dst = validation.check_rank(dst, self.world_size, "dst")
            rop = check_reduce_op(op, t.dtype)
        except (TypeError, ValueError) as e:
            self._reject("reduce", e)
            raise
        if self.world_size == 1:
            return t.clone()
        return self._guard("reduce", self._reduce, validation.dense(t), dst, rop)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``input_`` from ``src`` in place; receivers pass the buffer to fill."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device, copied=True)
            src = validation.check_rank(src, self.world_size, "src")
            if self.rank_in_group != src:  # the source only reads its tensor
                validation.check_writable(t, "input_")
            if not t.is_contiguous():
                raise ValueError("input_ must be contiguous for an in-place broadcast")
            if t.is_conj() or t.is_neg():
                raise ValueError(
                    f"input_ must not be a lazy view for an in-place broadcast (is_conj()="
                    f"{t.is_conj()}, is_neg()={t.is_neg()}): its raw elements are not its "
                    "values; pass input_.resolve_conj().resolve_neg()")
        except (TypeError, ValueError) as e:
            self._reject("broadcast", e)
            raise
        if self.world_size == 1:
            return t
        return self._guard("broadcast", self._broadcast, t, src)

    def scatter(self, input_: torch.Tensor | None, src: int = 0, dim: int = 0) -> torch.Tensor:
        """Split ``src``'s ``input_`` into equal slices along ``dim``; rank ``i`` gets slice ``i``.

        Non-source ranks may pass ``None``; shape and dtype come from ``src``.
        """
        self._check_open()
        try:
            src = validation.check_rank(src, self.world_size, "src")
            checked_dim = checks.as_int(dim)
            if checked_dim is None:
                raise TypeError(f"dim must be an int, got {type(dim).__name__}")
            dim = checked_dim
        except (TypeError, ValueError) as e:
            self._reject("scatter", e)
            raise
        if self.rank_in_group == src:
            try:
                t = validation.check_tensor(input_, "input_", self.device, copied=True)
                d = validation.norm_dim(dim, t.dim())
                validation.check_divisible(t.shape[d], self.world_size, f"input_.shape[{dim}]")
            except (TypeError, ValueError) as e:
                if self.world_size > 1:  # receivers wait for src: make them raise too
                    self._guard("scatter", self._scatter_abort, src, str(e))
                raise
            if self.world_size == 1:
                return t.clone()
            t = validation.dense(t)
        else:
            t, d = None, dim
        return self._guard("scatter", self._scatter, t, src, d)

    def all_to_all(
        self, input_: torch.Tensor, scatter_dim: int = 0, gather_dim: int = 0
    ) -> torch.Tensor:
        """Send slice ``j`` of ``input_`` (split along ``scatter_dim``) to rank ``j``,
        and concatenate the slices received from every rank along ``gather_dim``."""
        self._check_open()
        try:
            t = validation.check_tensor(input_, "input_", self.device, copied=True)
            sd = validation.norm_dim(scatter_dim, t.dim(), "scatter_dim")
            gd = validation.norm_dim(gather_dim, t.dim(), "gather_dim")
            validation.check_divisible(t.shape[sd], self.world_size, f"input_.shape[{scatter_dim}]")
        except (TypeError, ValueError) as e:
            self._reject("all_to_all", e)
            raise
        if self.world_size == 1:
            return t.clone()
        return self._guard("all_to_all", self._all_to_all, validation.dense(t), sd, gd)

    def all_to_allv(
        self,
        input_: torch.Tensor,
        send_sizes: Sequence[int] | torch.Tensor,
        recv_sizes: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Uneven all-to-all along dim 0 (see :mod:`device_comms.alltoallv`).

        Rows ``send_sizes[j]`` of ``input_`` (in rank order) go to rank ``j``;
        returns the rows received from every rank, concatenated in rank order.
        ``recv_sizes=None`` takes them from the senders; given, they must
        match (else every rank raises ``CollectiveMismatch``).
        """
        self._check_open()
        try:
            t, send, recv = alltoallv.check_input(
                input_, send_sizes, recv_sizes, self.world_size, self.device)
        except (TypeError, ValueError) as e:
            self._reject("all_to_allv", e)
            raise
        if self.world_size == 1:
            if recv is not None and recv != send:
                raise CollectiveMismatch(
                    f"group {self.unique_name!r}, op all_to_allv: recv_sizes {recv} do not "
                    f"match send_sizes {send} (a group of one sends to itself)",
                    queue=self.unique_name, peers=(0,))
            copied: torch.Tensor = clone(t)  # sub-byte dtypes travel here: t.clone() fails
            return copied
        return self._guard("all_to_allv", self._all_to_allv, validation.dense(t), send, recv)

    def reject(self, op: str, error: BaseException, peer: int | None = None) -> None:
        """Take part in ``op`` as a rank whose caller rejected its arguments.

        For layers built on an op that check more than the op can (MoE
        dispatch/combine over a collective, point-to-point layers over
        ``send``/``recv``): the peers, already in ``op``, raise
        :class:`~device_comms.errors.PeerRejectedError` naming this rank and
        ``error`` instead of waiting. The caller raises ``error`` itself; if
        telling the peers fails (a dead peer, a timeout), that is noted on
        ``error``. A collective tells every rank of the group; ``"send"`` /
        ``"recv"`` tell ``peer`` only, the rank this rank's send would go to
        (whose ``recv`` raises) or its receive would come from (whose ``send``
        raises). Transports whose ops carry no "rejected" mark (GPU ones) tell
        nobody; see their docstrings.

        Args:
            op: The op the peers are in: a collective's name (``"all_reduce"``,
                ``"broadcast"``...), ``"send"`` or ``"recv"``.
            error: Why this rank rejected its arguments (its type and text
                reach the peers).
            peer: For ``"send"``/``"recv"`` only: the other side's group rank.

        Raises:
            TypeError: ``op`` is not a str, ``error`` not an exception, or
                ``peer`` not an int.
            ValueError: ``op`` is not an op of a communicator, ``peer`` is
                missing for ``"send"``/``"recv"``, given for a collective, or
                not another rank of the group.
            CommunicatorClosed: The communicator was destroyed.
        """
        self._check_open()
        checks.check_str(op, "op")
        if not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception, got {type(error).__name__}")
        if op in _P2P_OPS:
            if peer is None:
                raise ValueError(f"peer is required for op {op!r}: the group rank that "
                                 f"this rank's {op} would pair with")
            peer = validation.check_rank(peer, self.world_size, "peer")
            if peer == self.rank_in_group:
                raise ValueError(f"peer={peer} is this rank; {op} pairs with another rank "
                                 f"of the group")
            self._reject(op, error, peer)
            return
        if op not in _COLLECTIVES:
            raise ValueError(f"op must be a collective ({', '.join(sorted(_COLLECTIVES))}), "
                             f"'send' or 'recv', got {op!r}")
        if peer is not None:
            raise ValueError(f"peer is only for 'send'/'recv'; collective {op!r} tells "
                             f"every rank of the group, got peer={peer!r}")
        self._reject(op, error)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst`` (blocking)."""
        self._check_open()
        try:
            t = validation.check_tensor(tensor, "tensor", self.device)
        except (TypeError, ValueError) as e:
            if self._is_peer(dst):  # the receiver can be told
                self._reject("send", e, operator.index(dst))
            raise
        dst = validation.check_rank(dst, self.world_size, "dst")
        if dst == self.rank_in_group:
            raise ValueError(f"dst={dst} is this rank; send needs another rank of the group")
        self._guard("send", self._send, validation.dense(t), dst)

    def recv(self, size: torch.Size | Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from group rank ``src``."""
        self._check_open()
        try:
            shape = validation.check_spec(size, dtype, self.device)
        except (TypeError, ValueError) as e:
            if self._is_peer(src):  # the sender can be told
                self._reject("recv", e, operator.index(src))
            raise
        src = validation.check_rank(src, self.world_size, "src")
        if src == self.rank_in_group:
            raise ValueError(f"src={src} is this rank; recv needs another rank of the group")
        return self._guard("recv", self._recv, shape, dtype, src)

    def _is_peer(self, r: Any) -> bool:
        """Whether ``r`` is another rank of this group (a valid send/recv peer)."""
        r = checks.as_int(r)
        return (r is not None and 0 <= r < self.world_size
                and r != self.rank_in_group)

    # ------------------------------------------------------------------ lifecycle
    def shares_memory_with(self, peer: int) -> bool:
        """Whether this rank and group rank ``peer`` map the same shared memory.

        True only where the communicator proved it (a shared-memory workspace
        that both ranks opened); point-to-point layers above may then move
        data through shared memory instead of the CPU group.
        """
        return False

    def prepare_communication_buffer_for_model(  # noqa: B027 - optional hook, a no-op here
        self, model: torch.nn.Module
    ) -> None:
        """Register model buffers with the transport (no-op unless overridden)."""

    def number_calls(self, source: Callable[[], int] | None) -> None:
        """Number this communicator's collectives by ``source()``.

        ``source`` is the owning group's call counter: the same on every rank
        for the same call of the group, whichever transport carries it (a
        queue broadcast counts too). Transports that compare calls compare
        the numbers as well, so ranks that got out of step (one rank's call
        never reached this communicator) raise
        :class:`~device_comms.errors.CollectiveMismatch` instead of pairing
        one rank's call ``#n`` with another's ``#n+1`` of the same kind.
        None: the communicator numbers its own calls.

        Raises:
            TypeError: ``source`` is neither callable nor None.
        """
        if source is not None and not callable(source):
            raise TypeError(f"source must be callable or None, got {type(source).__name__}")
        self._call_number = source

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Context entered around CUDA graph capture (no-op unless overridden)."""
        yield

    def device_marks(self) -> Any:
        """Marks of the device call about to be issued, or None (the base: none).

        The owning group calls it after numbering a device call and before
        issuing it, and calls the marks' ``finish()`` once the call returned
        or raised (the work is then enqueued, or nothing more will be); the
        marks then tell, lazily and from any thread, when the work started
        and completed (:class:`coordinator.trace.recorder.DeviceMarks`). They
        must complete once the work ended however it ended: a watchdog takes
        marks that never complete for a call that is stuck.
        Communicators whose calls return before their device work completes,
        or that know better than the host when it did, set
        ``provides_device_marks`` and override this; the base's calls are
        complete when they return. (A group on a CUDA device that gets None
        here marks its calls with CUDA events itself.)
        """
        return None

    def abort(self, error: BaseException) -> None:
        """Break this communicator because of ``error``; callable from any thread.

        A call blocked inside the communicator when it is aborted raises
        ``error`` (a copy of it), once the transport's :meth:`_abort` hook has
        ended its wait; every later call raises
        :class:`~device_comms.errors.BrokenCommunicator` saying why, until
        :meth:`destroy`. The first abort's error is kept; later aborts, and
        aborts after :meth:`destroy`, do nothing.

        Args:
            error: Why (a watchdog passes the ``CommTimeout`` naming the call
                that did not complete and the ranks behind).

        Raises:
            TypeError: ``error`` is not an exception.
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception, got {type(error).__name__}")
        if self._broken is not None or self._destroyed:
            return
        self._broken = error
        self._closed = True  # the one flag every call checks; _check_open tells why
        self._abort()

    @property
    def broken(self) -> BaseException | None:
        """Why :meth:`abort` broke this communicator (None while it is not broken)."""
        return self._broken

    def destroy(self) -> None:
        """Release every resource; idempotent. Subclasses extend and call super().

        Afterwards every collective raises :class:`~device_comms.errors.CommunicatorClosed`.
        """
        self._destroyed = True
        self._closed = True

    def close(self) -> None:
        """Same as :meth:`destroy`."""
        self.destroy()

    @property
    def closed(self) -> bool:
        """Whether :meth:`destroy`/:meth:`close` was called."""
        return self._destroyed

    def __enter__(self) -> DeviceCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _check_open(self) -> None:
        if self._closed:
            why = self._broken
            if why is not None and not self._destroyed:
                raise BrokenCommunicator(
                    f"communicator of group {self.unique_name!r} (rank {self.rank_in_group}/"
                    f"{self.world_size}) was aborted and cannot be used: {type(why).__name__}: "
                    f"{why}. Destroy the group and create it again",
                    queue=self.unique_name, side=f"rank {self.rank_in_group}",
                    peers=getattr(why, "peers", None))
            raise CommunicatorClosed(
                f"communicator of group {self.unique_name!r} (rank {self.rank_in_group}/"
                f"{self.world_size}) was destroyed; create a new one to communicate again"
            )

    def _abort(self) -> None:  # noqa: B027 - optional hook, a no-op here
        """End what this communicator waits for, after :meth:`abort` marked it broken
        (on the aborting thread; two threads aborting at once may both run it, so
        it must be idempotent).

        Transports that can stop their work in flight override this (NCCL:
        ``ncclCommAbort``); a call blocked in a hook then fails and raises the
        abort's error. The base stops nothing: work in flight runs on, and a
        call blocked inside waits as before (bounded by its own timeout).
        """

    def _reject(self, op: str, e: BaseException, *meta: Any) -> None:
        """This rank's arguments of ``op`` failed validation (``e`` is re-raised by the caller).

        Contract: every rank calls the same collectives. A rank whose own
        arguments are bad still *takes part* in ``op`` through
        :meth:`_abort_collective`, so peers whose call was valid raise
        :class:`~device_comms.errors.PeerRejectedError` (naming this rank and
        ``e``) promptly instead of waiting for the timeout, and every rank stays
        in step for the next collective. When every rank rejects (arguments the
        ranks agree on), each raises its own error. If telling the peers fails
        (a dead peer, a timeout), that is noted on ``e``, which still raises.
        """
        if self.world_size > 1:
            try:
                self._abort_collective(op, f"{type(e).__name__}: {e}", *meta)
            except (DeviceCommError, RuntimeError) as notify:
                add_note(e, f"telling the peers of group {self.unique_name!r} failed: {notify}")

    def _abort_collective(  # noqa: B027 - optional hook, a no-op here
        self, op: str, message: str, *meta: Any
    ) -> None:
        """Take part in ``op`` as a rank that rejected its arguments (``message`` says why).

        Transports whose ``op`` can carry a "rejected" mark override this; the
        base does nothing (peers of such a transport wait as before: see the
        transport's docstring for which ops are covered).

        ``meta`` is ``(peer,)`` for ``send``/``recv``, else empty.
        """

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...

    def _all_reduce_into(self, t: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> torch.Tensor:
        """All-reduce contiguous ``t`` into ``out`` (validated: ``t`` itself or disjoint).

        The base reduces into a new tensor and copies it; transports that can
        write the result in place override this.
        """
        return out.copy_(self._all_reduce(t, op))

    @abc.abstractmethod
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...

    def _all_gather_into(self, t: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor:
        """All-gather contiguous ``t`` into ``out`` (validated: the gathered shape,
        contiguous, disjoint from ``t``).

        The base gathers into a new tensor and copies it; transports that can
        write the result in place override this.
        """
        return out.copy_(self._all_gather(t, dim))

    @abc.abstractmethod
    def _all_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor: ...

    def _all_gatherv_rows(
        self, ts: list[torch.Tensor], sizes: list[int] | None
    ) -> tuple[list[torch.Tensor], list[int]]:
        """:meth:`all_gatherv_rows` of contiguous ``ts`` (``sizes`` None: not given).

        The base agrees on the row counts (:meth:`_row_counts`) when not given,
        then gathers the tensors packed side by side as bytes
        (:meth:`_all_gatherv_packed`); a lone tensor goes as itself.
        Transports that can move several buffers in one call override this.
        """
        if sizes is None:
            sizes = self._row_counts(ts[0].shape[0])
            row_gather.check_counts_fit(sizes, ts, self.unique_name)
        if len(ts) == 1:
            return [self._all_gatherv(ts[0], 0, sizes)], sizes
        packed = row_gather.pack_rows(ts)
        gathered = self._all_gatherv_packed(packed, sizes, row_gather.layout_key(ts))
        return row_gather.unpack_rows(gathered, ts), sizes

    def _row_counts(self, n: int) -> list[int]:
        """Every rank's row count, from each rank's ``n`` (one all-gather of an int64)."""
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        return [int(c) for c in self._all_gather(mine, 0).tolist()]

    def _all_gatherv_packed(self, packed: torch.Tensor, sizes: list[int],
                            layout: int) -> torch.Tensor:
        """All-gather of packed rows (a ``(rows, width)`` uint8 matrix) whose tensors'
        layout digests to ``layout`` (:func:`~device_comms.row_gather.layout_key`).

        The base gathers the bytes as they are; transports that sign their
        calls override this to sign ``layout`` too.
        """
        return self._all_gatherv(packed, 0, sizes)

    @abc.abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatterv(
        self, t: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _gather(self, t: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None: ...

    @abc.abstractmethod
    def _reduce(self, t: torch.Tensor, dst: int, op: ReduceOp) -> torch.Tensor | None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _scatter(self, t: torch.Tensor | None, src: int, dim: int) -> torch.Tensor: ...

    def _scatter_abort(  # noqa: B027 - optional hook, a no-op here
        self, src: int, message: str
    ) -> None:
        """On ``src`` after its input failed validation: tell the receivers of
        :meth:`_scatter` to raise. Override when ``_scatter`` sends metadata first."""

    @abc.abstractmethod
    def _all_to_all(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor: ...

    def _all_to_allv(
        self, t: torch.Tensor, send: list[int], recv: list[int] | None
    ) -> torch.Tensor:
        """Uneven all-to-all of contiguous ``t`` (at least 1-D); ``recv`` None: not given.

        Not abstract, so that transports written before it still construct;
        they raise here until they implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement all_to_allv")

    @abc.abstractmethod
    def _send(self, t: torch.Tensor, dst: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, size: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor: ...

    # ------------------------------------------------------------------ errors
    def _guard(self, op: str, fn: Callable[..., _R], *args: Any) -> _R:
        """Run a hook, turning backend failures into this package's errors."""
        try:
            with torch.no_grad():  # collectives are not autograd ops (as in torch.distributed)
                return fn(*args)
        except BaseException as e:
            why = self._broken
            if why is not None:  # aborted (abort(), another thread) while this call ran
                raise copy.copy(why) from e
            if isinstance(e, CollectiveMismatch):  # the message names what this rank passed
                with_own_arguments(e, args)
                raise
            if isinstance(e, DeviceCommError):
                raise  # raised at a point the transport defines (a step, a header)
            if isinstance(e, RuntimeError):  # a backend's failure: translated, nothing broken
                raise self._translate(op, e) from e
            self._interrupted(op, e)  # KeyboardInterrupt, a signal handler's exception...
            raise

    def _interrupted(  # noqa: B027 - optional hook, a no-op here
        self, op: str, e: BaseException
    ) -> None:
        """``op`` stopped partway: ``e`` (not a backend's error) escaped its hook.
        Transports whose peers could otherwise take this rank's next call for
        the rest of this one override this to break the communicator and tell
        the peers."""

    def _translate(self, op: str, e: RuntimeError) -> BaseException:
        where = f"group {self.unique_name!r} (rank {self.rank_in_group}/{self.world_size}), op {op}"
        return translate_backend_error(e, where)
