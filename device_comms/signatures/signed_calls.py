"""Signed calls: a communicator's side of the envelope protocol (CPU tensors over gloo).

:class:`SignedCalls` is mixed into
:class:`~device_comms.torch_dist.torch_communicator.TorchDistributedCommunicator`. It
keeps the per-group call counter, a cache of call headers, the collective
:class:`~device_comms.signatures.envelopes.Blocks` and the point-to-point
:class:`~device_comms.signatures.p2p_envelopes.P2PSides` (one call counter, buffer set
and lock per peer and direction, so a send and a receive with the same peer
may run at the same time on two threads), and offers the three things an op
needs:

* :meth:`SignedCalls._call`: agree on a collective with every peer (the
  :meth:`_prologue` first, then one all-gather of blocks), raising on every
  rank unless every rank made this very call; small payloads ride along;
* :meth:`SignedCalls._p2p_call`: the same for one send/recv pair, on the
  :class:`~device_comms.signatures.p2p_envelopes.P2PSide` that :meth:`SignedCalls._p2p_side`
  holds for the call;
* :meth:`SignedCalls._reject_call`: take part in a call as a rank that
  rejected its own arguments (any op, any argument), so the peers raise
  :class:`~device_comms.errors.PeerRejectedError` naming it.

The counters count calls, not successes: every rank that enters a call bumps
them, including a rejecting rank and ranks that raise on a mismatch, so they
stay equal across ranks after any of those.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from device_comms.reduce_op import ReduceOp
from device_comms.signatures.call_signature import REJECTED, group_id, layout_key, settle, template
from device_comms.signatures.envelopes import Blocks, failure_header, reason_bytes
from device_comms.signatures.p2p_envelopes import RECV, SEND, P2PSide, P2PSides

__all__ = ["SignedCalls"]

_HEADER_CACHE_MAX = 1024
_KIND = {"send": "send/recv", "recv": "send/recv"}


class SignedCalls:
    """Mixin: signed collective and point-to-point calls over ``device_group``.

    Expects ``device_group``, ``unique_name``, ``rank_in_group`` and
    ``world_size`` (a :class:`~device_comms.base.DeviceCommunicator`).
    """

    device_group: dist.ProcessGroup
    _call_number: Any
    unique_name: str
    rank_in_group: int
    world_size: int

    def _init_signed_calls(self) -> None:
        self._blocks: Blocks | None = None
        self._p2p_sides = P2PSides(self.device_group)
        self._headers: dict[tuple[Any, ...], np.ndarray] = {}
        self._seq = 0
        self._gid = group_id(self.unique_name)

    # ------------------------------------------------------------------ headers
    def _header(
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
        """The (cached) header template of a call; see :func:`call_signature.template`."""
        k = (kind, dtype, op, root, layout, shape, data_dtype, extra)
        h = self._headers.get(k)
        if h is None:
            if len(self._headers) >= _HEADER_CACHE_MAX:
                self._headers.clear()
            h = self._headers[k] = template(
                self._gid, kind, dtype, op, root, layout_key(layout), shape, data_dtype, extra
            )
        return h

    def _envelopes(self) -> Blocks:
        """The collective exchange (built at the first signed call)."""
        b = self._blocks
        if b is None:
            b = self._blocks = Blocks(self.device_group, self.world_size, self.rank_in_group)
        return b

    def _p2p_side(self, op: str, peer: int) -> AbstractContextManager[P2PSide]:
        """This rank's side of ``op`` (``"send"`` or ``"recv"``) with ``peer``, its lock
        held for the ``with`` block (the whole call: envelopes and payload)."""
        return self._p2p_sides.hold(peer, SEND if op == "send" else RECV)

    # ------------------------------------------------------------------ calls
    def _prologue(self, op: str, header: np.ndarray | None, reason: str | None) -> bool:
        """Agree on a collective by a cheaper or wider means first (none here).

        Subclasses whose ranks also meet elsewhere (the shared-memory engine,
        the hierarchical leaders) override this so that a call there and a
        call here are compared too. Returns True when it already told the
        peers about this rank's rejection (``reason``).
        """
        return False

    def _call(self, op: str, header: np.ndarray, payload: torch.Tensor | None = None) -> None:
        """Agree on collective ``op`` with every peer; a small payload travels along.

        ``payload`` (a contiguous tensor of at most
        :data:`~device_comms.signatures.envelopes.BLOCK_INLINE` bytes) reaches every peer;
        afterwards :meth:`_received` / :meth:`_payload` hold what each rank sent.

        Raises:
            PeerRejectedError: A peer rejected its arguments.
            CollectiveMismatch: A peer made another call.
        """
        self._prologue(op, header, None)
        env = self._envelopes()
        header[2] = self._next_seq()
        env.exchange(header, payload)
        self._settle(op, env, header, env.peers)

    def _reject_call(self, op: str, reason: str) -> None:
        """Take part in collective ``op`` as a rank that rejected its arguments."""
        if self._prologue(op, None, reason):
            return
        env = self._envelopes()
        h = self._failure(op, self._next_seq())
        env.exchange(h, reason_bytes(reason))
        self._settle(op, env, h, env.peers)

    def _next_seq(self) -> int:
        """The number of the next collective: the group's, when the group numbers
        its calls (:meth:`~device_comms.base.DeviceCommunicator.number_calls`)."""
        self._seq += 1
        number = self._call_number
        return self._seq if number is None else number()

    def _p2p_call(
        self,
        op: str,
        side: P2PSide,
        header: np.ndarray | None,
        payload: torch.Tensor | None = None,
        reason: str | None = None,
    ) -> bool:
        """Agree on one send/recv on ``side`` (held by the caller; ``header`` None:
        this rank rejected).

        Returns True on a rejecting rank (it raises its own error).
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
        h = self._header(_KIND.get(op, op), None, None, 0, (), None)
        h = failure_header(h, REJECTED, self.rank_in_group)
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
        heads[self.rank_in_group] = header
        return settle(self.unique_name, op, self.rank_in_group, heads, env.reason)

    # ------------------------------------------------------------------ payloads
    def _payload(self, rank: int) -> torch.Tensor:
        """The bytes ``rank`` sent with its header in the last collective exchange."""
        return self._envelopes().payload(rank)

    def _received(
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
        env = self._envelopes()
        dt = mine.dtype
        if shapes is None and at is None:
            out = list(env.views(dt, mine.shape))
        else:
            out = [
                env.views(dt, torch.Size(mine.shape if shapes is None else shapes[r]),
                          0 if at is None else at[r])[r]
                for r in range(self.world_size)
            ]
        out[self.rank_in_group] = mine
        return out
