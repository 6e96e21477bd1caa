"""The two-rank all-reduce of the shared-memory engine (a mixin of
:class:`~device_comms.cpu_shm.engine.ShmEngine`).

Two schemes, chosen by size (the engine decides):

* **one step, into the peer's slot** (:meth:`ShmPairOps._pair_small`, from
  :data:`PAIR_SMALL_MIN_BYTES` up to a slot, the engine's ``oneshot_bytes`` and
  :data:`~device_comms.cpu_shm.engine_threads.GRAIN` elements): each rank copies its
  tensor into its slot, steps, reduces into the *peer's* slot in rank order
  (``fn(x0, x1)`` on both, so the bits agree) and copies that out. A shared
  line is then written by its owner and read-and-written by the peer, so it
  moves between the caches in the modified state (when the peer only reads
  it, the owner's next write must first invalidate the peer's copy). The
  rank's own slot belongs to the peer from the step until the next one.
* **pipelined reduce-scatter + all-gather** (:meth:`ShmPairOps._pair_all_reduce`,
  pieces of :data:`DEFAULT_PAIR_PIECE_BYTES`, ``K`` pieces in ``K+1`` steps):
  each rank reduces half of every piece, so per element of the message it
  copies half an element in, reduces half and copies one out, against one in,
  one reduced and one out when both ranks reduce everything.

Each rank writes its own slot only in the parity of the step it is about to
publish, or, after step ``s``, in the parity of step ``s+1`` (whose previous
use, step ``s-1``, the peer finished before publishing ``s``); the peer writes
a rank's slot (one-step scheme) only between the step and its next one. Both
are covered by the double-buffer argument of :mod:`device_comms.cpu_shm.sync`.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.host_arrays import array_of
from device_comms.fixed_reduce import NUMPY_ERRORS, NUMPY_SUM, binary_fn
from device_comms.reduce_op import ReduceOp

if TYPE_CHECKING:
    from device_comms.cpu_shm.sync import StepSync
    from device_comms.cpu_shm.workspace import ShmWorkspace

__all__ = ["ShmPairOps", "DEFAULT_PAIR_PIECE_BYTES", "PAIR_SMALL_MIN_BYTES"]

# Bytes of a piece of the pipelined all_reduce (ShmPairOps._pair_all_reduce, both
# halves), and the smallest one-step all_reduce that reduces into the peer's slot.
# Measured on the development VM (2 vCPUs, separate L2 caches of
# 2 MiB), float32, interleaved: 1 MiB pieces beat 256/512 KiB by 2-4% (fewer steps)
# and match 2 MiB, which leaves less of L2 for the caller's data. From 32 KiB the
# one-step reduction into the peer's slot wins (64 KiB: 8.2 vs 10.0 us), below it
# its extra copy costs more than it saves (16 KiB: 4.6 vs 4.2 us).
DEFAULT_PAIR_PIECE_BYTES = 1 << 20
PAIR_SMALL_MIN_BYTES = 32 << 10

_HALF_ALIGN_BYTES = 64  # halves start on cache lines
_PLAN_CACHE_MAX = 512
_memmove = ctypes.memmove
_from_numpy = torch.from_numpy


def _pair_pieces(n: int, isz: int, slot_bytes: int) -> list[tuple[int, int, int, int]]:
    """Pieces ``(start, split, end, half)`` of ``n`` elements for the two-rank all_reduce.

    Rank 0 reduces ``[start, split)``, rank 1 ``[split, end)``; each half is at
    most ``half`` elements (a multiple of a cache line), so a slot holds two.
    """
    align = max(1, _HALF_ALIGN_BYTES // isz)
    half = max(align, slot_bytes // isz // (2 * align) * align)
    out = []
    for a in range(0, n, 2 * half):
        ln = min(2 * half, n - a)
        m = min(ln, -(-ln // (2 * align)) * align)
        out.append((a, a + m, a + ln, half))
    return out


def _half(piece: tuple[int, int, int, int], rank: int) -> tuple[int, int]:
    """The element range of ``piece`` that local ``rank`` reduces."""
    return (piece[0], piece[1]) if rank == 0 else (piece[1], piece[2])


class ShmPairOps:
    """The two-rank all-reduce of :class:`~device_comms.cpu_shm.engine.ShmEngine` (a
    mixin: the engine provides the workspace, the synchroniser and the state below)."""

    ws: ShmWorkspace
    sync: StepSync
    size: int
    me: int
    pair_piece_bytes: int
    _slot_addr: list[list[int]]
    _plans: dict[tuple[int, int, int], tuple[int, list[tuple[Any, Any, int, int]]]]
    _slot_views: dict[tuple[torch.dtype, bool], list[list[Any]]]

    def _pair_plan(self, n: int, isz: int) -> tuple[int, list[tuple[Any, Any, int, int]]]:
        """``(half, steps)`` of :meth:`_pair_all_reduce` for ``n`` elements of ``isz`` bytes.

        Step ``s`` is ``(send, recv, lo, hi)``: the (byte offset, bytes) of the
        input copied into this rank's slot before the step, those of the output
        filled from the peer's reduced half after it (None where nothing moves),
        and the elements this rank reduces after it (``hi < 0``: none). Cached.
        """
        key = (n, isz, self.pair_piece_bytes)
        got = self._plans.get(key)
        if got is not None:
            return got
        pieces = _pair_pieces(n, isz, min(self.ws.slot_bytes, self.pair_piece_bytes))
        steps: list[tuple[Any, Any, int, int]] = []
        for s in range(len(pieces) + 1):
            send = recv = None
            lo = hi = -1
            if s < len(pieces):
                a, b = _half(pieces[s], 1 - self.me)
                send = (a * isz, (b - a) * isz)
                lo, hi = _half(pieces[s], self.me)
            if s > 0:
                a, b = _half(pieces[s - 1], 1 - self.me)
                recv = (a * isz, (b - a) * isz)
            steps.append((send, recv, lo, hi))
        if len(self._plans) >= _PLAN_CACHE_MAX:
            self._plans.clear()
        got = self._plans[key] = (pieces[0][3] if pieces else 0, steps)
        return got

    def _pair_slots(self, dt: torch.dtype, as_numpy: bool) -> list[list[Any]]:
        """Both ranks' slots of both parities (``[parity][rank]``), flat ``dt`` tensors or arrays."""
        key = (dt, as_numpy)
        got = self._slot_views.get(key)
        if got is None:
            got = [[self.ws.slot(p, r, dt) for r in range(self.size)] for p in (0, 1)]
            if as_numpy:
                got = [[v.numpy() for v in row] for row in got]
            self._slot_views[key] = got
        return got

    def _pair_small(
        self, t: torch.Tensor, peer: Any, c: Any, held: tuple[Any, Any] | None = None
    ) -> torch.Tensor:
        """The one-step all_reduce of two ranks from :data:`PAIR_SMALL_MIN_BYTES` on: reduce
        into the peer's slot view ``peer`` in rank order and copy it out (the module
        docstring says why); this rank's own slot is the peer's to modify. ``held``:
        numpy views of ``t``'s bytes (raw, typed), if the caller has them."""
        fn = c.fn
        x: Any = t
        if c.numpy:
            x = held[1] if held is not None else array_of(t)
        try:
            if self.me == 0:
                fn(x, peer, out=peer)
            else:
                fn(peer, x, out=peer)
        except NUMPY_ERRORS:  # reported after peer was written: the IEEE result stands
            pass
        if c.numpy:
            return _from_numpy(peer.copy())
        return torch.div(peer, 2) if c.avg else peer.clone()

    def _pair_all_reduce(
        self, t: torch.Tensor, op: ReduceOp, sig: tuple[int, int], out: torch.Tensor | None
    ) -> torch.Tensor:
        """Two ranks: reduce-scatter and all-gather fused, one step per piece.

        Piece ``k`` (at most half a slot per rank) is cut in two halves; rank
        ``i`` reduces half ``i``. Before step ``s`` a rank writes into its slot
        of that step's parity the half of piece ``s`` the *peer* reduces
        (region ``IN``; its own reduced half of piece ``s-1``, region ``RED``,
        went there after step ``s-1``). After the step it copies the peer's
        reduced half of piece ``s-1`` into the output and reduces its half of
        piece ``s`` (its input and the peer's ``IN``, in rank order) into its
        slot of the *next* parity's ``RED``, from where it copies it into the
        output. So ``K``
        pieces take ``K+1`` steps, every element is reduced by exactly one rank
        (both ranks get the same bits) and a rank moves half the bytes that
        reducing everything would take: per element of the message, half an
        element in, half reduced, one out.

        Slots are written only in the parity of the step about to be
        published or, after step ``s``, of step ``s+1``, whose previous use
        (step ``s-1``) the peer finished before publishing step ``s``: the
        double-buffer argument of :mod:`device_comms.cpu_shm.sync`.

        ``out`` may be ``t``: an element of ``t`` is read (copied in, or
        reduced) at the step that writes its output element or one step before.
        """
        sync, me, peer = self.sync, self.me, 1 - self.me
        n, dt, isz = t.numel(), t.dtype, t.element_size()
        if out is None:
            out = host_alloc.empty(n, dt)
        half, plan = self._pair_plan(n, isz)
        if op is ReduceOp.SUM and dt in NUMPY_SUM:  # bitwise torch's sum, less dispatch
            x: Any = array_of(t).reshape(-1)
            fn: Any = np.add
            slots = self._pair_slots(dt, True)
        else:
            x, fn, slots = t.view(-1), binary_fn(op, dt), self._pair_slots(dt, False)
        avg = op is ReduceOp.AVG
        x_addr, out_addr, addr = t.data_ptr(), out.data_ptr(), self._slot_addr
        red = half * isz
        for s, (send, recv, lo, hi) in enumerate(plan):
            p = (sync.gen + 1) & 1
            if send is not None:  # IN: the half of this piece the peer reduces
                _memmove(addr[p][me], x_addr + send[0], send[1])
            sync.step("all_reduce", sig[0], sig[1], s == 0)
            if recv is not None:  # the peer's reduced half of the previous piece
                _memmove(out_addr + recv[0], addr[p][peer] + red, recv[1])
            if hi >= 0:  # my half, reduced into RED of the next step's slot
                m = hi - lo
                dst = slots[1 - p][me][half : half + m]
                try:
                    if me == 0:
                        fn(x[lo:hi], slots[p][peer][:m], out=dst)
                    else:
                        fn(slots[p][peer][:m], x[lo:hi], out=dst)
                except NUMPY_ERRORS:  # reported after dst was written: the IEEE result stands
                    pass
                if avg:
                    dst.div_(2)
                _memmove(out_addr + lo * isz, addr[1 - p][me] + red, m * isz)
        return out.view(t.shape)
