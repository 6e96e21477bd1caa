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
import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from device_comms.alltoallv import SizeTable, offsets, record_words, row_bytes, settle_sizes
from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.engine_threads import GRAIN, KernelThreads
from device_comms.signatures.step_signature import signature

if TYPE_CHECKING:
    from device_comms.cpu_shm.engine import ShmEngine
    from device_comms.cpu_shm.sync import StepSync
    from device_comms.cpu_shm.workspace import ShmWorkspace

__all__ = ["ShmAllToAllvOps", "fits", "record_bytes"]

_LINE = 64  # the stream starts on a cache line after the size record
_MEMMOVE_MAX = 256 << 10  # larger copies go through torch (parallel with the engine's thread count)
_memmove = ctypes.memmove


def record_bytes(world_size: int) -> int:
    """Bytes the size record takes at the start of a slot (cache-line aligned)."""
    raw = 8 * record_words(world_size)
    return (raw + _LINE - 1) // _LINE * _LINE


def fits(eng: ShmEngine) -> bool:
    """Whether the engine's slots hold a size record with room to spare.

    The same on every rank of a node (same slot size and rank count), so
    every rank routes a call the same way.
    """
    return 2 * record_bytes(eng.size) <= eng.ws.slot_bytes


@functools.lru_cache(maxsize=64)
def _signature(dtype: torch.dtype) -> int:
    return signature("all_to_allv", dtype)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of contiguous uint8 tensors of equal length."""
    n = dst.numel()
    if not n:
        return
    if n <= _MEMMOVE_MAX:
        _memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


class ShmAllToAllvOps:
    """The uneven all-to-all of :class:`~device_comms.cpu_shm.engine.ShmEngine` (a mixin:
    the engine provides the workspace, the synchroniser and the caches below)."""

    ws: ShmWorkspace
    sync: StepSync
    size: int
    me: int
    _views: dict[Any, Any]  # the engine's view cache (cleared when it closes)

    @property
    def kernel_threads(self) -> KernelThreads:  # provided by the engine
        raise NotImplementedError

    def shape_key(self, shape: torch.Size) -> int:  # provided by the engine
        raise NotImplementedError

    def all_to_allv(
        self, x: torch.Tensor, send: list[int], recv: list[int] | None,
        name: str = "all_to_allv",
    ) -> torch.Tensor:
        """Uneven all-to-all of contiguous ``x`` among the engine's ranks (group ranks).

        Args:
            x: This rank's rows, at least 1-D and contiguous.
            send: Rows of ``x`` for each rank (sum: ``x.shape[0]``).
            recv: Rows expected from each rank, or None (taken from the senders).
            name: The op named in errors.

        Raises:
            CollectiveMismatch: A peer called something else (another op, dtype or
                row shape), or the size records disagree (every rank raises).
            PeerRejectedError: A peer rejected its arguments.
        """
        with self._threaded(x.nbytes):
            return self._all_to_allv(x, send, recv, name)

    def _threaded(self, nbytes: int) -> Any:
        """The engine's thread count when a copy of ``nbytes`` may run in parallel."""
        return self.kernel_threads if nbytes > GRAIN else contextlib.nullcontext()

    def _words(self, parity: int, rank: int) -> np.ndarray:
        """Local ``rank``'s slot of ``parity`` as int64 words (a cached numpy view)."""
        key = ("all_to_allv", parity)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [self.ws.slot(parity, r, torch.int64).numpy()
                                        for r in range(self.size)]
        return views[rank]

    def _all_to_allv(
        self, x: torch.Tensor, send: list[int], recv: list[int] | None, name: str,
    ) -> torch.Tensor:
        ws, sync, me, n = self.ws, self.sync, self.me, self.size
        slot_b, head = ws.slot_bytes, record_bytes(n)
        row, xb = row_bytes(x), _flat_bytes(x)
        off = offsets(send)
        cut, own = off[me] * row, send[me] * row  # my stream skips [cut, cut + own)
        length = (off[n] - send[me]) * row
        p = sync.next_parity
        words = record_words(n)
        self._words(p, me)[:words] = [1 if recv is not None else 0] + send + (recv or [0] * n)
        _write(ws.slot(p, me, torch.uint8), head, xb, cut, own, length, 0, slot_b - head)
        sync.step(name, _signature(x.dtype), self.shape_key(x.shape[1:]), True)
        table = SizeTable.decode([self._words(p, q)[:words].tolist() for q in range(n)],
                                 sync.name, name)
        settle_sizes(table, sync.name, name, row)
        got = table.received_by(me)
        out = host_alloc.empty((sum(got),) + tuple(x.shape[1:]), x.dtype)
        ob = _flat_bytes(out)
        roff = offsets(got)
        with self._threaded(out.nbytes):
            if own:
                _copy(ob[roff[me] * row : roff[me] * row + own], xb[cut : cut + own])
            pieces, longest = _pieces(table, me, row, roff)
            _read(ws, p, pieces, ob, 0, slot_b - head, head)
            a = slot_b - head
            while a < longest:  # further windows, as long as the longest stream needs
                p = sync.next_parity
                _write(ws.slot(p, me, torch.uint8), 0, xb, cut, own, length, a, a + slot_b)
                sync.step(name)
                _read(ws, p, pieces, ob, a, a + slot_b, 0)
                a += slot_b
        return out


def _pieces(
    table: SizeTable, me: int, row: int, roff: list[int]
) -> tuple[list[tuple[int, int, int, int]], int]:
    """Where this rank's rows sit in each peer's stream, and the longest stream.

    Returns ``([(peer, stream offset, bytes, result offset)], longest stream bytes)``.
    """
    pieces = []
    longest = 0
    for q, sq in enumerate(table.send):
        longest = max(longest, (sum(sq) - sq[q]) * row)
        if q == me or not sq[me] or not row:
            continue
        start = (sum(sq[:me]) - (sq[q] if q < me else 0)) * row
        pieces.append((q, start, sq[me] * row, roff[q] * row))
    return pieces, longest


def _write(
    slot: torch.Tensor, base: int, xb: torch.Tensor, cut: int, own: int, length: int,
    a: int, b: int,
) -> None:
    """Copy my stream's bytes ``[a, b)`` (clipped to its ``length``) to ``slot[base:]``.

    Stream bytes below ``cut`` are input bytes at the same offset; from
    ``cut`` on they are ``own`` bytes further (past the rows kept here).
    """
    b = min(b, length)
    lo, hi = a, min(b, cut)
    if hi > lo:
        _copy(slot[base + lo - a : base + hi - a], xb[lo:hi])
    lo, hi = max(a, cut), b
    if hi > lo:
        _copy(slot[base + lo - a : base + hi - a], xb[lo + own : hi + own])


def _read(
    ws: object, p: int, pieces: list[tuple[int, int, int, int]], ob: torch.Tensor,
    a: int, b: int, base: int,
) -> None:
    """Copy the part of each peer's window ``[a, b)`` (at ``base`` in its slot) meant for me."""
    for q, start, nbytes, dst in pieces:
        lo, hi = max(a, start), min(b, start + nbytes)
        if hi > lo:
            src = ws.slot(p, q, torch.uint8)  # type: ignore[attr-defined]
            _copy(ob[dst + lo - start : dst + hi - start], src[base + lo - a : base + hi - a])
