"""The pipelined all-reduce of two ranks: reduce-scatter and all-gather fused.

With two local ranks, an all_reduce beyond one small step (the engine decides;
the one-step scheme of two ranks is in :mod:`device_comms.cpu_shm.small`) goes
in pieces of :data:`DEFAULT_PAIR_PIECE_BYTES`, ``K`` pieces in ``K+1`` steps
(:meth:`PairAllReduce.all_reduce`): each rank reduces half of every piece, so
per element of the message it copies half an element in, reduces half and
copies one out, against one in, one reduced and one out when both ranks reduce
everything.

Each rank writes its own slot only in the parity of the step it is about to
publish, or, after step ``s``, in the parity of step ``s+1`` (whose previous
use, step ``s-1``, the peer finished before publishing ``s``): the
double-buffer argument of :mod:`device_comms.cpu_shm.sync`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.context import EngineContext
from device_comms.cpu_shm.host_arrays import array_of
from device_comms.fixed_reduce import NUMPY_ERRORS, NUMPY_SUM, binary_fn
from device_comms.reduce_op import ReduceOp

__all__ = ["PairAllReduce", "DEFAULT_PAIR_PIECE_BYTES", "DEFAULT_PAIR_TORCH_PIECE_BYTES"]

#: Bytes of a piece of the pipelined all_reduce (both halves). Larger pieces mean
#: fewer steps, each a synchronisation; a piece must stay in a core's L2 cache from
#: its copy in to its reduction and leave room there for the caller's data. The
#: sizes compared are in docs/performance.md.
DEFAULT_PAIR_PIECE_BYTES = 1 << 20
#: The same for reductions torch runs (bfloat16, float16, every op but a ``numpy.add``
#: sum): larger pieces measured faster for those (docs/performance.md).
DEFAULT_PAIR_TORCH_PIECE_BYTES = 2 << 20

_HALF_ALIGN_BYTES = 64  # halves start on cache lines
_PLAN_CACHE_MAX = 512
_memmove = ctypes.memmove

#: A step of the pipelined all_reduce (see :meth:`PairAllReduce._plan`).
_Step = tuple[tuple[int, int] | None, tuple[int, int] | None, int, int]


def _pair_pieces(count: int, itemsize: int, slot_bytes: int) -> list[tuple[int, int, int, int]]:
    """Pieces ``(start, split, end, half)`` of ``count`` elements for the two-rank all_reduce.

    Rank 0 reduces ``[start, split)``, rank 1 ``[split, end)``; each half is at
    most ``half`` elements (a multiple of a cache line), so a slot holds two.
    """
    align = max(1, _HALF_ALIGN_BYTES // itemsize)
    half = max(align, slot_bytes // itemsize // (2 * align) * align)
    pieces = []
    for start in range(0, count, 2 * half):
        length = min(2 * half, count - start)
        first_half = min(length, -(-length // (2 * align)) * align)
        pieces.append((start, start + first_half, start + length, half))
    return pieces


def _half(piece: tuple[int, int, int, int], rank: int) -> tuple[int, int]:
    """The element range of ``piece`` that local ``rank`` reduces."""
    return (piece[0], piece[1]) if rank == 0 else (piece[1], piece[2])


class PairAllReduce:
    """The pipelined all_reduce of two local ranks over an engine context.

    Args:
        ctx: The engine's context (two local ranks).
        piece_bytes: Bytes of a piece (both halves; at most a slot is used) of
            a ``numpy.add`` sum.
        torch_piece_bytes: The same for a reduction torch runs.

    Attributes:
        piece_bytes: As the argument (read at every call; the engine leaves
            this part unused while it is 0).
        torch_piece_bytes: As the argument (read at every call).

    Raises:
        ValueError: ``ctx`` has another number of local ranks.
    """

    def __init__(
        self,
        ctx: EngineContext,
        piece_bytes: int = DEFAULT_PAIR_PIECE_BYTES,
        torch_piece_bytes: int = DEFAULT_PAIR_TORCH_PIECE_BYTES,
    ) -> None:
        if ctx.size != 2:
            raise ValueError(f"PairAllReduce needs 2 local ranks, got ctx with {ctx.size}")
        self._ws = ctx.ws
        self._sync = ctx.sync
        self._me = ctx.me
        self._slot_addresses = ctx.slot_addresses
        self.piece_bytes = piece_bytes
        self.torch_piece_bytes = torch_piece_bytes
        self._plans: dict[tuple[int, int, int], tuple[int, list[_Step]]] = {}
        self._slots: dict[tuple[torch.dtype, bool], list[list[Any]]] = {}

    def close(self) -> None:
        """Drop the cached slot views (they map the workspace)."""
        self._slots.clear()

    def _plan(self, count: int, itemsize: int, piece_bytes: int) -> tuple[int, list[_Step]]:
        """``(half, steps)`` of :meth:`all_reduce` for ``count`` elements of ``itemsize``
        bytes in pieces of ``piece_bytes``.

        Step ``s`` is ``(send, recv, lo, hi)``: the (byte offset, bytes) of the
        input copied into this rank's slot before the step, those of the output
        filled from the peer's reduced half after it (None where nothing moves),
        and the elements this rank reduces after it (``hi < 0``: none). Cached.
        """
        key = (count, itemsize, piece_bytes)
        got = self._plans.get(key)
        if got is not None:
            return got
        me, peer = self._me, 1 - self._me
        pieces = _pair_pieces(count, itemsize, min(self._ws.slot_bytes, piece_bytes))
        steps: list[_Step] = []
        for step in range(len(pieces) + 1):
            send = recv = None
            lo = hi = -1
            if step < len(pieces):
                start, end = _half(pieces[step], peer)
                send = (start * itemsize, (end - start) * itemsize)
                lo, hi = _half(pieces[step], me)
            if step > 0:
                start, end = _half(pieces[step - 1], peer)
                recv = (start * itemsize, (end - start) * itemsize)
            steps.append((send, recv, lo, hi))
        if len(self._plans) >= _PLAN_CACHE_MAX:
            self._plans.clear()
        got = self._plans[key] = (pieces[0][3] if pieces else 0, steps)
        return got

    def _slot_arrays(self, dtype: torch.dtype, as_numpy: bool) -> list[list[Any]]:
        """Both ranks' slots of both parities (``[parity][rank]``), flat ``dtype``
        tensors or numpy arrays (cached)."""
        key = (dtype, as_numpy)
        got = self._slots.get(key)
        if got is None:
            got = [[self._ws.slot(parity, rank, dtype) for rank in (0, 1)] for parity in (0, 1)]
            if as_numpy:
                got = [[slot.numpy() for slot in row] for row in got]
            self._slots[key] = got
        return got

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        signed: tuple[int, int],
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """All-reduce contiguous ``tensor``: reduce-scatter and all-gather fused, a step a piece.

        Piece ``k`` (at most half a slot per rank) is cut in two halves; rank
        ``i`` reduces half ``i``. Before step ``s`` a rank writes into its slot
        of that step's parity the half of piece ``s`` the *peer* reduces
        (region ``IN``; its own reduced half of piece ``s-1``, region ``RED``,
        went there after step ``s-1``). After the step it copies the peer's
        reduced half of piece ``s-1`` into the output and reduces its half of
        piece ``s`` (its input and the peer's ``IN``, in rank order) into its
        slot of the *next* parity's ``RED``, from where it copies it into the
        output; a reduction torch runs, and a ``numpy.add`` sum of one piece,
        are reduced into the output and copied into ``RED`` instead, so the
        rank never reads its slot back (on a machine where writing lines the
        peer process also holds costs a round trip per line, reading them back
        too made a 1 MiB call about 1.5x slower; a ``numpy.add`` sum of several
        pieces measured slower in that order: docs/performance.md, "The slow
        mode on the AMD VM"). So ``K`` pieces
        take ``K+1`` steps, every element is reduced by exactly one rank (both
        ranks get the same bits) and a rank moves half the bytes that reducing
        everything would take: per element of the message, half an element
        in, half reduced, one out.

        Slots are written only in the parity of the step about to be
        published or, after step ``s``, of step ``s+1``, whose previous use
        (step ``s-1``) the peer finished before publishing step ``s``: the
        double-buffer argument of :mod:`device_comms.cpu_shm.sync`.

        Args:
            tensor: This rank's operand (contiguous).
            op: The reduction.
            signed: The first step's signature and size key.
            out: Where the result goes (contiguous, ``tensor``'s shape and dtype),
                or None for a new tensor. It may be ``tensor``: an element of
                ``tensor`` is read (copied in, or reduced) at the step that writes
                its output element or one step before.

        Returns:
            ``out``, or the new tensor.
        """
        sync, me, peer = self._sync, self._me, 1 - self._me
        count, dtype, itemsize = tensor.numel(), tensor.dtype, tensor.element_size()
        if out is None:
            out = host_alloc.empty(count, dtype)
        numpy_sum = op is ReduceOp.SUM and dtype in NUMPY_SUM
        if numpy_sum:  # bitwise torch's sum, less dispatch
            src: Any = array_of(tensor).reshape(-1)
            fn: Any = np.add
            slots = self._slot_arrays(dtype, True)
            piece_bytes = self.piece_bytes
        else:
            src, fn, slots = tensor.view(-1), binary_fn(op, dtype), self._slot_arrays(dtype, False)
            piece_bytes = self.torch_piece_bytes
        half, plan = self._plan(count, itemsize, piece_bytes)
        # Reduced into the output, then copied into RED (the docstring says why) for
        # torch's reductions and for a numpy sum of one piece (two steps); a numpy sum
        # of several pieces is reduced into RED, then copied out.
        via_out = not numpy_sum or len(plan) <= 2
        dst_all: Any = None
        if via_out:  # the output as the reduction's type (numpy or torch, as ``src``)
            dst_all = (array_of(out) if isinstance(src, np.ndarray) else out).reshape(-1)
        avg = op is ReduceOp.AVG
        src_address, out_address = tensor.data_ptr(), out.data_ptr()
        addresses = self._slot_addresses
        red_offset = half * itemsize  # where RED starts in a slot
        for step, (send, recv, lo, hi) in enumerate(plan):
            parity = (sync.gen + 1) & 1
            if send is not None:  # IN: the half of this piece the peer reduces
                _memmove(addresses[parity][me], src_address + send[0], send[1])
            sync.step("all_reduce", signed[0], signed[1], step == 0)
            if recv is not None:  # the peer's reduced half of the previous piece
                _memmove(out_address + recv[0], addresses[parity][peer] + red_offset, recv[1])
            if hi >= 0:  # my half, reduced for RED of the next step's slot and the output
                length = hi - lo
                dst = dst_all[lo:hi] if via_out else slots[1 - parity][me][half : half + length]
                try:
                    if me == 0:
                        fn(src[lo:hi], slots[parity][peer][:length], out=dst)
                    else:
                        fn(slots[parity][peer][:length], src[lo:hi], out=dst)
                except NUMPY_ERRORS:  # reported after dst was written: the IEEE result stands
                    pass
                if avg:
                    dst.div_(2)
                red, mine = addresses[1 - parity][me] + red_offset, out_address + lo * itemsize
                if via_out:
                    _memmove(red, mine, length * itemsize)
                else:
                    _memmove(mine, red, length * itemsize)
        return out.view(tensor.shape)
