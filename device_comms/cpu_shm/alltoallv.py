"""Uneven all-to-all through a node's shared-memory workspace.

Each rank's *stream* is its input's bytes without the rows it sends to
itself (those go straight from input to output): the rows for rank 0, rank 1,
... in order, skipping its own. The stream moves through the rank's slot in
windows; every receiver copies out of every peer's slot the bytes of that
peer's stream meant for it, straight into its place in the result. So each
byte is copied once in (input -> own slot) and once out (peer's slot ->
result), with one step per window::

    step 1 (signed)        my slot: [size record | stream bytes 0 .. S-H)
                           every rank reads every record: the size table,
                           the same on every rank -> verdict, result size
    step 2, 3, ...         my slot: [stream bytes S-H+(k-2)S .. S-H+(k-1)S)
    (only while some rank's stream is longer than what went through so far)

``S`` is the slot size, ``H`` the record's bytes rounded up to a cache line.
The number of steps follows from the size table, so every rank takes the
same steps even when it has nothing left to send. The first step carries the
call's signature (op, dtype, trailing shape), so a rank in another collective,
with another dtype or row shape, or one that rejected its arguments, makes
every rank raise in that step (:mod:`device_comms.cpu_shm.sync`); a size table
whose ``recv_sizes`` disagree makes every rank raise right after it
(:func:`device_comms.alltoallv.settle_sizes`). Either way each rank took
exactly one step, so the communicator stays usable. Slots are double
buffered as for every op of the engine: a rank rewrites a parity only after
every peer has published the next step, i.e. finished reading this one.

Copies up to :data:`_MEMMOVE_MAX` bytes are one ``memmove`` (no torch
dispatch); larger ones are torch copies, run with the engine's thread count
(:mod:`device_comms.cpu_shm.engine_threads`) like the engine's other kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np
import torch

from device_comms.alltoallv import SizeTable, offsets, record_words, row_bytes, settle_sizes
from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.context import EngineContext, shape_key, signature
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.cpu_shm.workspace import ShmWorkspace

__all__ = ["ShmAllToAllv", "fits", "record_bytes"]

_LINE = 64  # the stream starts on a cache line after the size record
_MEMMOVE_MAX = 256 << 10  # larger copies go through torch (parallel with the engine's thread count)
_memmove = ctypes.memmove


def record_bytes(world_size: int) -> int:
    """Bytes the size record takes at the start of a slot (cache-line aligned)."""
    raw = 8 * record_words(world_size)
    return (raw + _LINE - 1) // _LINE * _LINE


def fits(local_size: int, slot_bytes: int) -> bool:
    """Whether slots of ``slot_bytes`` hold the size record of ``local_size`` ranks
    with room to spare.

    The same on every rank of a node (same slot size and rank count), so
    every rank routes a call the same way.
    """
    return 2 * record_bytes(local_size) <= slot_bytes


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of contiguous uint8 tensors of equal length."""
    nbytes = dst.numel()
    if not nbytes:
        return
    if nbytes <= _MEMMOVE_MAX:
        _memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)


class ShmAllToAllv:
    """The uneven all-to-all over an engine context.

    Args:
        ctx: The engine's context.

    Attributes:
        fits: Whether the slots hold the size record with room to spare
            (:func:`fits`); the engine runs :meth:`all_to_allv` only then.
    """

    def __init__(self, ctx: EngineContext) -> None:
        self._ws = ctx.ws
        self._sync = ctx.sync
        self._me = ctx.me
        self._size = ctx.size
        self._kernel_threads = ctx.kernel_threads
        self._words_views: dict[int, list[np.ndarray]] = {}
        self.fits = fits(ctx.size, ctx.ws.slot_bytes)

    def close(self) -> None:
        """Drop the cached views (they map the workspace)."""
        self._words_views.clear()

    def all_to_allv(
        self, tensor: torch.Tensor, send: list[int], recv: list[int] | None,
        name: str = "all_to_allv",
    ) -> torch.Tensor:
        """Uneven all-to-all of contiguous ``tensor`` among the engine's ranks (group ranks).

        Args:
            tensor: This rank's rows, at least 1-D and contiguous.
            send: Rows of ``tensor`` for each rank (sum: ``tensor.shape[0]``).
            recv: Rows expected from each rank, or None (taken from the senders).
            name: The op named in errors.

        Raises:
            CollectiveMismatch: A peer called something else (another op, dtype or
                row shape), or the size records disagree (every rank raises).
            PeerRejectedError: A peer rejected its arguments.
        """
        with self._threaded(tensor.nbytes):
            return self._all_to_allv(tensor, send, recv, name)

    def _threaded(self, nbytes: int) -> Any:
        """The engine's thread count when a copy of ``nbytes`` may run in parallel."""
        return self._kernel_threads if nbytes > GRAIN else contextlib.nullcontext()

    def _words(self, parity: int, rank: int) -> np.ndarray:
        """Local ``rank``'s slot of ``parity`` as int64 words (a cached numpy view)."""
        views = self._words_views.get(parity)
        if views is None:
            views = self._words_views[parity] = [
                self._ws.slot(parity, local_rank, torch.int64).numpy()
                for local_rank in range(self._size)
            ]
        return views[rank]

    def _all_to_allv(
        self, tensor: torch.Tensor, send: list[int], recv: list[int] | None, name: str,
    ) -> torch.Tensor:
        ws, sync, me, size = self._ws, self._sync, self._me, self._size
        slot_bytes, head = ws.slot_bytes, record_bytes(size)
        row, in_bytes = row_bytes(tensor), _flat_bytes(tensor)
        send_offsets = offsets(send)
        # my stream skips [cut, cut + own): the rows I keep
        cut, own = send_offsets[me] * row, send[me] * row
        length = (send_offsets[size] - send[me]) * row
        parity = sync.next_parity
        words = record_words(size)
        self._words(parity, me)[:words] = ([1 if recv is not None else 0] + send
                                           + (recv or [0] * size))
        _write(ws.slot(parity, me, torch.uint8), head, in_bytes, cut, own, length, 0,
               slot_bytes - head)
        sync.step(name, signature("all_to_allv", tensor.dtype), shape_key(tensor.shape[1:]),
                  True)
        table = SizeTable.decode([self._words(parity, peer)[:words].tolist()
                                  for peer in range(size)], sync.name, name)
        settle_sizes(table, sync.name, name, row)
        got = table.received_by(me)
        out = host_alloc.empty((sum(got),) + tuple(tensor.shape[1:]), tensor.dtype)
        out_bytes = _flat_bytes(out)
        recv_offsets = offsets(got)
        with self._threaded(out.nbytes):
            if own:
                start = recv_offsets[me] * row
                _copy(out_bytes[start : start + own], in_bytes[cut : cut + own])
            pieces, longest = _pieces(table, me, row, recv_offsets)
            _read(ws, parity, pieces, out_bytes, 0, slot_bytes - head, head)
            window = slot_bytes - head
            while window < longest:  # further windows, as long as the longest stream needs
                parity = sync.next_parity
                _write(ws.slot(parity, me, torch.uint8), 0, in_bytes, cut, own, length, window,
                       window + slot_bytes)
                sync.step(name)
                _read(ws, parity, pieces, out_bytes, window, window + slot_bytes, 0)
                window += slot_bytes
        return out


def _pieces(
    table: SizeTable, me: int, row: int, recv_offsets: list[int]
) -> tuple[list[tuple[int, int, int, int]], int]:
    """Where this rank's rows sit in each peer's stream, and the longest stream.

    Returns ``([(peer, stream offset, bytes, result offset)], longest stream bytes)``.
    """
    pieces = []
    longest = 0
    for peer, sends in enumerate(table.send):
        longest = max(longest, (sum(sends) - sends[peer]) * row)
        if peer == me or not sends[me] or not row:
            continue
        start = (sum(sends[:me]) - (sends[peer] if peer < me else 0)) * row
        pieces.append((peer, start, sends[me] * row, recv_offsets[peer] * row))
    return pieces, longest


def _write(
    slot: torch.Tensor, base: int, in_bytes: torch.Tensor, cut: int, own: int, length: int,
    start: int, end: int,
) -> None:
    """Copy my stream's bytes ``[start, end)`` (clipped to its ``length``) to ``slot[base:]``.

    Stream bytes below ``cut`` are input bytes at the same offset; from
    ``cut`` on they are ``own`` bytes further (past the rows kept here).
    """
    end = min(end, length)
    lo, hi = start, min(end, cut)
    if hi > lo:
        _copy(slot[base + lo - start : base + hi - start], in_bytes[lo:hi])
    lo, hi = max(start, cut), end
    if hi > lo:
        _copy(slot[base + lo - start : base + hi - start], in_bytes[lo + own : hi + own])


def _read(
    ws: ShmWorkspace, parity: int, pieces: list[tuple[int, int, int, int]],
    out_bytes: torch.Tensor, start: int, end: int, base: int,
) -> None:
    """Copy the part of each peer's window ``[start, end)`` (at ``base`` in its slot)
    meant for me."""
    for peer, stream_start, nbytes, dst in pieces:
        lo, hi = max(start, stream_start), min(end, stream_start + nbytes)
        if hi > lo:
            src = ws.slot(parity, peer, torch.uint8)
            _copy(out_bytes[dst + lo - stream_start : dst + hi - stream_start],
                  src[base + lo - start : base + hi - start])
