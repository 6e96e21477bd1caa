"""Signed calls: one rank's side of the envelope protocol over a gloo group (CPU tensors).

A :class:`SignedCalls` belongs to one communicator
(:class:`~device_comms.torch_dist.torch_communicator.TorchDistributedCommunicator`
holds one) and owns the state of its signed calls: the group's call counter,
a cache of call headers, the collective
:class:`~device_comms.signatures.envelopes.Blocks` and the point-to-point
:class:`~device_comms.signatures.p2p_envelopes.P2PSides` (one call counter, buffer set
and lock per peer and direction, so a send and a receive with the same peer
may run at the same time on two threads). It offers the three things an op
needs:

* :meth:`SignedCalls.call`: agree on a collective with every peer (the
  owner's *prologue* first, then one all-gather of blocks), raising on every
  rank unless every rank made this very call; small payloads ride along;
* :meth:`SignedCalls.p2p_call`: the same for one send/recv pair, on the
  :class:`~device_comms.signatures.p2p_envelopes.P2PSide` that
  :meth:`SignedCalls.p2p_side` holds for the call;
* :meth:`SignedCalls.reject`: take part in a collective as a rank that
  rejected its own arguments (any op, any argument), so the peers raise
  :class:`~device_comms.errors.PeerRejectedError` naming it (a send/recv
  rejects through :meth:`SignedCalls.p2p_call` with no header).

What it needs from its owner comes in as callables: the *prologue*, which
agrees on a collective by a cheaper or wider means first (the owner's ranks
may also meet elsewhere: the shared-memory engine, the node leaders), and the
*call-number source* (:meth:`SignedCalls.number_calls`), the group's counter
that numbers every call whichever transport carries it.

The counters count calls, not successes: every rank that enters a call bumps
them, including a rejecting rank and ranks that raise on a mismatch, so they
stay equal across ranks after any of those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from device_comms.errors import ClosedError
from device_comms.reduce_op import ReduceOp
from device_comms.signatures.call_signature import REJECTED, group_id, layout_key, settle, template
from device_comms.signatures.envelopes import Blocks, failure_header, reason_bytes
from device_comms.signatures.p2p_envelopes import RECV, SEND, P2PSide, P2PSides

__all__ = ["SignedCalls", "Prologue", "no_prologue"]

#: ``prologue(op, header, reason) -> told``: agree on collective ``op`` before its
#: envelopes (``header`` None and ``reason`` set on a rank that rejected its
#: arguments); True when it already told the peers of that rejection.
Prologue = Callable[[str, np.ndarray | None, str | None], bool]

_HEADER_CACHE_MAX = 1024
_KIND = {"send": "send/recv", "recv": "send/recv"}


def no_prologue(op: str, header: np.ndarray | None, reason: str | None) -> bool:
    """The prologue of a group whose ranks meet nowhere else: nothing to agree on first."""
    return False


def _closed_prologue(name: str, op: str, header: np.ndarray | None, reason: str | None) -> bool:
    """The prologue of a released :class:`SignedCalls`: every collective is refused."""
    raise ClosedError(f"communicator of group {name!r} was destroyed during {op}; create a "
                      f"new one to communicate again")


class SignedCalls:
    """Signed collective and point-to-point calls of one rank over a gloo group.

    Args:
        group: The gloo process group that carries the envelopes.
        unique_name: The owning group's name (in errors; hashed into every header).
        rank: This rank's group rank.
        world_size: The group's size.
        prologue: Called first in every collective (see :data:`Prologue`).
        call_number: The group's call-number source (None: this object numbers
            its own collectives); see :meth:`number_calls`.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``world_size`` is below 1 or ``rank`` outside the group.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        unique_name: str,
        rank: int,
        world_size: int,
        *,
        prologue: Prologue = no_prologue,
        call_number: Callable[[], int] | None = None,
    ) -> None:
        if not isinstance(unique_name, str):
            raise TypeError(f"unique_name must be a str, got {type(unique_name).__name__}")
        for arg, value in (("rank", rank), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not callable(prologue):
            raise TypeError(f"prologue must be callable, got {type(prologue).__name__}")
        if call_number is not None and not callable(call_number):
            raise TypeError(
                f"call_number must be callable or None, got {type(call_number).__name__}")
        self.group = group
        self.unique_name = unique_name
        self.rank = rank
        self.world_size = world_size
        self._prologue = prologue
        self._number = call_number
        self._blocks: Blocks | None = None
        self._p2p_sides = P2PSides(group)
        self._headers: dict[tuple[Any, ...], np.ndarray] = {}
        self._seq = 0
        self._gid = group_id(unique_name)

    def number_calls(self, source: Callable[[], int] | None) -> None:
        """Number the collectives by ``source()`` (the group's call counter; see
        :meth:`~device_comms.base.DeviceCommunicator.number_calls`); None: count here.

        Raises:
            TypeError: ``source`` is neither callable nor None.
        """
        if source is not None and not callable(source):
            raise TypeError(f"source must be callable or None, got {type(source).__name__}")
        self._number = source

    def release(self) -> None:
        """Drop the prologue (the owning communicator is destroyed).

        The prologue is usually a bound method of the owning communicator,
        which holds this object: a reference cycle that would keep the
        communicator, and the process group it holds with its threads and
        sockets, alive until the next cyclic garbage collection. A collective
        that still gets here afterwards (another thread's call racing the
        destroy) raises :class:`~device_comms.errors.ClosedError`.
        """
        self._prologue = functools.partial(_closed_prologue, self.unique_name)

    # ------------------------------------------------------------------ headers
    def header(
        self,
        kind: str,
        dtype: torch.dtype | None,
        op: ReduceOp | None,
        root: int,
        layout: object,
        shape: Sequence[int] | None,
        data_dtype: torch.dtype | None = None,
        extra: int = 0,
    ) -> np.ndarray:
        """The (cached) header template of a call; see :func:`call_signature.template`.

        The template is shared: :meth:`call` writes the call number into it,
        :meth:`p2p_call` into a copy.
        """
        k = (kind, dtype, op, root, layout, shape, data_dtype, extra)
        h = self._headers.get(k)
        if h is None:
            if len(self._headers) >= _HEADER_CACHE_MAX:
                self._headers.clear()
            h = self._headers[k] = template(
                self._gid, kind, dtype, op, root, layout_key(layout), shape, data_dtype, extra
            )
        return h

    def blocks(self) -> Blocks:
        """The collective exchange (built at the first signed collective): after
        :meth:`call`, every rank's header words and payload of that call."""
        b = self._blocks
        if b is None:
            b = self._blocks = Blocks(self.group, self.world_size, self.rank)
        return b

    def p2p_side(self, op: str, peer: int) -> AbstractContextManager[P2PSide]:
        """This rank's side of ``op`` (``"send"`` or ``"recv"``) with ``peer``, its lock
        held for the ``with`` block (the whole call: envelopes and payload)."""
        return self._p2p_sides.hold(peer, SEND if op == "send" else RECV)

    # ------------------------------------------------------------------ calls
    def call(self, op: str, header: np.ndarray, payload: torch.Tensor | None = None) -> None:
        """Agree on collective ``op`` with every peer; a small payload travels along.

        ``payload`` (a contiguous tensor of at most
        :data:`~device_comms.signatures.envelopes.BLOCK_INLINE` bytes) reaches every peer;
        afterwards :meth:`received` / :meth:`payload` hold what each rank sent.

        Raises:
            PeerRejectedError: A peer rejected its arguments.
            CollectiveMismatch: A peer made another call.
        """
        self._prologue(op, header, None)
        env = self.blocks()
        header[2] = self._next_seq()
        env.exchange(header, payload)
        self._settle(op, env, header, env.peers)

    def reject(self, op: str, reason: str) -> None:
        """Take part in collective ``op`` as a rank that rejected its arguments
        (``reason`` says why; the peers raise ``PeerRejectedError`` with it)."""
        if self._prologue(op, None, reason):
            return
        env = self.blocks()
        h = self._failure(op, self._next_seq())
        env.exchange(h, reason_bytes(reason))
        self._settle(op, env, h, env.peers)

    def _next_seq(self) -> int:
        """The number of the next collective: the source's, when there is one."""
        self._seq += 1
        number = self._number
        return self._seq if number is None else number()

    def p2p_call(
        self,
        op: str,
        side: P2PSide,
        header: np.ndarray | None,
        payload: torch.Tensor | None = None,
        reason: str | None = None,
    ) -> bool:
        """Agree on one send/recv on ``side`` (held by the caller; ``header`` None:
        this rank rejected, ``reason`` says why).

        Returns True on a rejecting rank (it raises its own error).

        Raises:
            PeerRejectedError: The peer rejected its arguments.
            CollectiveMismatch: The peer's call differs.
        """
        side.seq += 1
        if header is None:
            header = self._failure(op, side.seq)
            payload = reason_bytes(reason or "")
        else:
            header = header.copy()  # the cached template may be in use on another thread
            header[2] = side.seq
        side.exchange(header, payload)
        return self._settle(op, side, header, [side.peer])

    def _failure(self, op: str, seq: int) -> np.ndarray:
        h = self.header(_KIND.get(op, op), None, None, 0, (), None)
        h = failure_header(h, REJECTED, self.rank)
        h[2] = seq
        return h

    def _settle(
        self, op: str, env: Blocks | P2PSide, header: np.ndarray, peers: list[int]
    ) -> bool:
        """Raise unless every peer's header agrees with ``header`` (see ``settle``)."""
        mine = header[:6].tobytes()
        words = env.words
        for p in peers:
            if words[p][:6].tobytes() != mine:
                break
        else:
            return False
        heads = {p: words[p] for p in peers}
        heads[self.rank] = header
        return settle(self.unique_name, op, self.rank, heads, env.reason)

    # ------------------------------------------------------------------ payloads
    def payload(self, rank: int) -> torch.Tensor:
        """The bytes ``rank`` sent with its header in the last collective exchange."""
        return self.blocks().payload(rank)

    def received(
        self,
        mine: torch.Tensor,
        shapes: Sequence[torch.Size] | None = None,
        at: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Every rank's piece of the last exchange in rank order (``mine`` for this rank).

        Rank ``r``'s piece has ``shapes[r]`` (default: ``mine``'s shape) and
        starts ``at[r]`` elements into its payload (default: 0). The pieces
        alias the receive buffer until the next exchange.
        """
        env = self.blocks()
        dt = mine.dtype
        if shapes is None and at is None:
            out = list(env.views(dt, mine.shape))
        else:
            out = [
                env.views(dt, torch.Size(mine.shape if shapes is None else shapes[r]),
                          0 if at is None else at[r])[r]
                for r in range(self.world_size)
            ]
        out[self.rank] = mine
        return out
