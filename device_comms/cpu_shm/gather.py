"""Gathers of the shared-memory engine: all_gather(v), gather, and the rows of
several tensors with their row counts in one step.

Every rank copies its tensor into its slot of the next parity; after the step
(:class:`~device_comms.cpu_shm.sync.StepSync`) the readers copy every rank's slot
out: ``torch.cat`` straight from the slots when every piece fits a slot, else
blocks of whole rows (or, for rows wider than a slot, a row in column pieces)
written into the output's final layout, one step per block. A root that
gathers reads its own part from its input, so it writes nothing. The slot
double buffer makes the next op's writes safe (see :mod:`device_comms.cpu_shm.sync`).

A small all_gather or gather whose pieces are blocks of the result (the
dimensions before the gathered one all of length 1) runs with no torch call but
the result's wrapping (:meth:`ShmGathers.cat`): a kept
:class:`CatEntry` per layout holds numpy views of every slot, the input goes
in through a view of its address, and the result is one ``numpy.concatenate``
of the slots.

:meth:`ShmGathers.rows_exchange` gathers several tensors' rows when no rank
knows the others' row counts: each rank writes a header (its row count, and
whether its rows follow) and, when they fit its slot, its rows, each
tensor's rows as one block::

    slot of rank r:  | n_r | fits | sizes | pad | tensor 0 rows | pad | tensor 1 rows | ...
                       (64-byte header; every block starts on a 64-byte boundary)

After the one step every rank reads every header; if every rank's rows were
there, each output tensor is the concatenation of that tensor's block from
every slot (one copy per tensor), else the caller gathers again with the
counts it now knows. The decision is the same on every rank, since every
rank reads the same headers.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from device_comms.cpu_shm.address_views import NULL_PAGE, AddressViews
from device_comms.cpu_shm.context import EngineContext, signature
from device_comms.cpu_shm.engine_threads import threaded
from device_comms.cpu_shm.host_arrays import bytes_at, mark_written, numpy_dtype
from device_comms.cpu_shm.seen_once import SeenOnce
from device_comms.errors import CollectiveMismatch

__all__ = ["ShmGathers", "CatEntry", "ROWS_HEADER", "CAT_ENTRIES"]

#: Bytes before a rank's rows in :meth:`ShmGathers.rows_exchange` (and the alignment
#: of each tensor's block after it).
ROWS_HEADER = 64
#: Largest piece all_gather_cat copies with ``memmove`` (larger ones: torch copies,
#: parallel with the engine's thread count).
_MEMMOVE_MAX = 256 << 10
_memmove = ctypes.memmove
_from_numpy = torch.from_numpy
_concatenate = np.concatenate
#: Layouts whose by-address all_gather a :class:`ShmGathers` keeps (oldest out first).
CAT_ENTRIES = 64
#: numpy's integer of each item size: the elements of a dtype numpy lacks (signed:
#: ``torch.from_numpy`` before torch 2.3 refuses numpy's unsigned 16-64-bit integers).
_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _GatherStep(NamedTuple):
    """What every piece of one gather_rows call shares."""

    x2: torch.Tensor
    out2: torch.Tensor | None
    widths: Sequence[int]
    offsets: list[int]
    writes: bool
    kind: str
    sig: int
    size_key: int


class CatEntry:
    """What a one-step all_gather (or gather) by address of one (dtype, shape, ``dim``)
    needs, kept for the next call: every rank's piece is one block of the result, in rank order
    (the dimensions before ``dim`` are all of length 1), so the result is numpy's
    concatenation of every rank's slot viewed as an array of the piece's shape.

    Args:
        gathers: The gathers whose slots are viewed.
        tensor: A contiguous tensor of the shape and dtype, of at least one
            dimension, with memory, that fits a slot.
        dim: The dimension gathered (non-negative).
        dst: A gather's local root; None: an all_gather.

    Attributes:
        kind: ``"all_gather"`` or ``"gather"`` (signed into the step, named in its errors).
        sig: The step's signature word (as :meth:`ShmGathers.all_gather_cat` signs).
        reads: This rank gets the result (every rank of an all_gather, a gather's root).
        nbytes: Bytes of one piece.
        mine: Per parity, this rank's slot as ``nbytes`` numpy bytes.
        parts: Per parity, every rank's slot as an array of the piece's shape.
        axis: ``dim``.
        wrap: The torch dtype the result's bytes are viewed as, where numpy lacks
            it (bfloat16 and the like: the arrays hold integers of its size);
            None: numpy's dtype is torch's.
        by_address: Views of caller memory by address (the input).
    """

    __slots__ = ("kind", "sig", "reads", "nbytes", "mine", "parts", "axis", "wrap",
                 "by_address")

    def __init__(self, gathers: ShmGathers, tensor: torch.Tensor, dim: int,
                 dst: int | None = None) -> None:
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        self.kind = "all_gather" if dst is None else "gather"
        self.sig = signature(self.kind, dtype, None, 0 if dst is None else dst)
        self.reads = dst is None or dst == gathers.me
        self.nbytes = nbytes = tensor.nbytes
        self.axis = dim
        self.wrap: torch.dtype | None = None
        try:
            elems = numpy_dtype(dtype)
        except TypeError:  # a dtype numpy lacks: its bytes as integers of its size
            elems, self.wrap = _INTS[tensor.element_size()], dtype
        addresses = gathers.slot_addresses
        self.mine = tuple(bytes_at(row[gathers.me], nbytes) for row in addresses)
        self.parts = tuple([bytes_at(address, nbytes).view(elems).reshape(shape)
                            for address in row] for row in addresses)
        self.by_address = AddressViews(tensor)


class ShmGathers:
    """all_gather(v) and gather over an engine context.

    Args:
        ctx: The engine's context.

    Attributes:
        size: Number of local ranks.
        me: This rank's local index.
        slot_addresses: ``slot_addresses[parity][rank]``: every slot's address.
        kernel_threads: The context's thread cap (kernels over more than
            :data:`~device_comms.cpu_shm.engine_threads.GRAIN` elements run under it).
    """

    def __init__(self, ctx: EngineContext) -> None:
        self._ws = ctx.ws
        self._sync = ctx.sync
        self.me = ctx.me
        self._shaped = ctx.shaped
        self.size = ctx.size
        self.kernel_threads = ctx.kernel_threads
        self.slot_addresses = ctx.slot_addresses
        #: The kept entries by (dtype, shape, dim, root or -1), oldest first.
        self._cat: dict[tuple[torch.dtype, torch.Size, int, int], CatEntry] = {}
        self._cat_seen = SeenOnce(CAT_ENTRIES)  # layouts without an entry, seen once
        # rows_exchange's headers (three int64 words at the start of each slot), by parity
        self._heads = [[bytes_at(addr, 24).view(np.int64) for addr in row]
                       for row in ctx.slot_addresses]

    def cat_entry(self, tensor: torch.Tensor, dim: int, dst: int | None = None) -> CatEntry | None:
        """The kept (or a new) :class:`CatEntry` for an all_gather (``dst`` None) or a
        gather onto local rank ``dst`` of ``tensor`` along non-negative ``dim``, when
        one serves the call: a contiguous piece with memory, of at most
        :data:`_MEMMOVE_MAX` bytes and a slot, whose dimensions before ``dim`` are all
        of length 1. None: the caller takes :meth:`all_gather_cat`, which signs its
        step as the entry does."""
        if tensor.data_ptr() < NULL_PAGE or not tensor.is_contiguous():
            return None
        key = (tensor.dtype, tensor.shape, dim, -1 if dst is None else dst)
        entry = self._cat.get(key)
        if entry is None:
            if not self._cat_seen.again(key):  # a layout seen once may not come back
                return None
            if not (0 < tensor.nbytes <= min(_MEMMOVE_MAX, self._ws.slot_bytes)
                    and math.prod(tensor.shape[:dim]) == 1):
                return None
            if len(self._cat) >= CAT_ENTRIES:
                del self._cat[next(iter(self._cat))]
            entry = self._cat[key] = CatEntry(self, tensor, dim, dst)
        return entry

    def cat(self, tensor: torch.Tensor, entry: CatEntry, size_key: int) -> torch.Tensor | None:
        """:meth:`all_gather_cat` by address with ``entry`` (from :meth:`cat_entry` for
        ``tensor``'s layout; ``size_key`` as there): the input goes into the slot
        through a numpy view of its address (a ``memmove`` the first time), and the
        result is one numpy concatenation of the slots, a new tensor on every rank
        for an all_gather, on the root only for a gather (None elsewhere)."""
        sync = self._sync
        parity = (sync.gen + 1) & 1  # sync.next_parity, without the property call
        src = tensor.data_ptr()
        held = entry.by_address.get(src)
        if held is not None:
            entry.mine[parity][...] = held[0]
        else:
            _memmove(self.slot_addresses[parity][self.me], src, entry.nbytes)
            entry.by_address.sight(tensor, src)
        sync.step(entry.kind, entry.sig, size_key, True, True)  # glibc / numpy stores
        if not entry.reads:
            return None
        result = _from_numpy(_concatenate(entry.parts[parity], axis=entry.axis))
        return result if entry.wrap is None else result.view(entry.wrap)

    def close(self) -> None:
        """Drop the kept entries (their views map the workspace)."""
        self._cat.clear()
        self._cat_seen.clear()

    @threaded(lambda self, tensor, *_: tensor.numel() * self.size)
    def all_gather_cat(
        self,
        tensor: torch.Tensor,
        dim: int,
        kind: str = "all_gather",
        dst: int | None = None,
        size_key: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Every rank's ``tensor`` (same shape, fits a slot) concatenated along ``dim``.

        Every rank gets it when ``dst`` is None, else only local rank ``dst``.
        ``size_key`` (default: the element count) must agree on every rank.
        ``out`` (contiguous, the concatenated shape): written instead of a new tensor.
        """
        sync = self._sync
        parity = (sync.gen + 1) & 1  # sync.next_parity, without the property call
        nbytes = tensor.nbytes
        # small and contiguous: this thread's memmove, no torch dispatch (plain stores)
        by_address = nbytes <= _MEMMOVE_MAX and tensor.is_contiguous() and (
            tensor.data_ptr() >= NULL_PAGE)
        if by_address:
            _memmove(self.slot_addresses[parity][self.me], tensor.data_ptr(), nbytes)
        else:
            self._shaped(parity, tensor)[self.me].copy_(tensor)
        sig = signature(kind, tensor.dtype, None, 0 if dst is None else dst)
        sync.step(kind, sig, tensor.numel() if size_key is None else size_key, True, by_address)
        if dst is not None and dst != self.me:
            return None
        if by_address and math.prod(tensor.shape[:dim]) == 1:
            # each rank's piece is one block of the result, in rank order
            return self._blocks_into(tensor, dim, parity, nbytes, out)
        views = self._shaped(parity, tensor)
        return torch.cat(views, dim) if out is None else torch.cat(views, dim, out=out)

    def _blocks_into(self, tensor: torch.Tensor, dim: int, parity: int, nbytes: int,
                     out: torch.Tensor | None) -> torch.Tensor:
        """Every rank's slot of ``parity`` (``nbytes`` each), back to back into ``out`` (a
        new tensor when None): the all-gather along ``dim`` of pieces shaped like
        ``tensor`` when no dimension before ``dim`` is longer than 1."""
        if out is None:
            shape = list(tensor.shape)
            shape[dim] *= self.size
            out = tensor.new_empty(*shape)  # ints, not a tuple: torch parses them faster
        else:
            mark_written(out)  # torch did not see the write
        address = out.data_ptr()
        for slot in self.slot_addresses[parity]:
            _memmove(address, slot, nbytes)
            address += nbytes
        return out

    @threaded(lambda self, tensor, shapes, *_: sum(math.prod(shape) for shape in shapes))
    def gatherv_cat(
        self, tensor: torch.Tensor, shapes: Sequence[torch.Size], dim: int, size_key: int
    ) -> torch.Tensor:
        """All-gather of per-rank shapes ``shapes`` (each fits a slot), concatenated along
        ``dim``."""
        sync, dtype = self._sync, tensor.dtype
        slots = self._ws.slots(sync.next_parity, dtype)
        views = [slot[: math.prod(shape)].view(shape)
                 for slot, shape in zip(slots, shapes, strict=True)]
        views[self.me].copy_(tensor)
        sync.step("all_gatherv", signature("all_gatherv", dtype), size_key, True)
        return torch.cat(views, dim)

    @threaded(lambda self, x2, widths, *_: x2.shape[0] * sum(widths))
    def gather_rows(
        self,
        x2: torch.Tensor,
        widths: Sequence[int],
        out2: torch.Tensor | None,
        kind: str,
        size_key: int,
        dst: int | None = None,
    ) -> None:
        """Gather 2-D pieces side by side: ``out2[:, c_r : c_r + widths[r]] = x2`` of rank ``r``.

        ``x2`` is this rank's ``(A, widths[me])`` contiguous input; ``out2`` the
        ``(A, sum(widths))`` output on readers (every rank when ``dst`` is None,
        else only local rank ``dst``; None elsewhere). Pieces go through the
        slots a block of whole rows at a time, or a row in column pieces when a
        row is larger than a slot, so the output is written in its final layout.
        """
        me, dtype = self.me, x2.dtype
        sig = signature(kind, dtype, None, 0 if dst is None else dst)
        rows = x2.shape[0]
        offsets = [0]
        for width in widths:
            offsets.append(offsets[-1] + width)
        writes = dst is None or dst != me  # a root reads its own part from x2
        chunk = self._ws.slot_elems(dtype)
        widest = max(widths) if widths else 0
        if widest == 0 or rows == 0:
            self._sync.step(kind, sig, size_key, True)  # nothing to move; still agree on the call
            return
        step = _GatherStep(x2, out2, widths, offsets, writes, kind, sig, size_key)
        if widest <= chunk:  # blocks of whole rows
            per_block = max(1, chunk // widest)
            for first_row in range(0, rows, per_block):
                self._gather_row_block(step, first_row, min(per_block, rows - first_row),
                                       first=first_row == 0)
        else:  # each row in column pieces
            for row in range(rows):
                for column in range(0, widest, chunk):
                    self._gather_column_piece(step, row, column, chunk,
                                              first=row == 0 and column == 0)

    def _gather_row_block(self, step: _GatherStep, first_row: int, rows: int,
                          first: bool) -> None:
        """Rows ``first_row : first_row + rows`` of every rank's piece through one round of
        slots."""
        ws, me, dtype, widths = self._ws, self.me, step.x2.dtype, step.widths
        end = first_row + rows
        parity = self._sync.next_parity
        if step.writes and widths[me]:
            mine = ws.slot(parity, me, dtype)[: rows * widths[me]]
            mine.copy_(step.x2[first_row:end].reshape(-1))
        self._sync.step(step.kind, step.sig, step.size_key, first)
        if step.out2 is None:
            return
        for rank in range(self.size):
            width = widths[rank]
            if width:
                src = (step.x2[first_row:end] if rank == me
                       else ws.slot(parity, rank, dtype)[: rows * width].view(rows, width))
                step.out2[first_row:end, step.offsets[rank] : step.offsets[rank] + width].copy_(src)

    def _gather_column_piece(self, step: _GatherStep, row: int, column: int, chunk: int,
                             first: bool) -> None:
        """Columns ``column : column + chunk`` of row ``row`` of every rank's piece (rows
        wider than a slot)."""
        ws, me, dtype, widths = self._ws, self.me, step.x2.dtype, step.widths
        parity = self._sync.next_parity
        length = max(0, min(chunk, widths[me] - column))
        if step.writes and length:
            ws.slot(parity, me, dtype)[:length].copy_(step.x2[row, column : column + length])
        self._sync.step(step.kind, step.sig, step.size_key, first)
        if step.out2 is None:
            return
        for rank in range(self.size):
            rank_length = max(0, min(chunk, widths[rank] - column))
            if rank_length:
                src = (step.x2[row, column : column + rank_length] if rank == me
                       else ws.slot(parity, rank, dtype)[:rank_length])
                start = step.offsets[rank] + column
                step.out2[row, start : start + rank_length].copy_(src)

    def rows_exchange(self, tensors: Sequence[torch.Tensor], widths: Sequence[int],
                      size_key: int, claimed: Sequence[int] | None = None
                      ) -> tuple[list[int], list[torch.Tensor] | None]:
        """One step: every rank's row count and, when every rank's rows fit its
        slot, every tensor's rows gathered in rank order (see the module docstring).

        Args:
            tensors: This rank's contiguous tensors (the same row count).
            widths: Bytes per row of each tensor (the same on every rank).
            size_key: Signs the tensors' layout (must agree on every rank).
            claimed: The row counts this rank's caller passed, if any: every
                rank checks every rank's claim against the counts.

        Returns:
            ``(counts, gathered)``; ``gathered`` is None when some rank's rows
            did not fit its slot (the counts are known all the same).

        Raises:
            CollectiveMismatch: On every rank: a rank claimed other row counts
                than the ranks have, or a header is malformed.
        """
        sync, me, ws = self._sync, self.me, self._ws
        n = tensors[0].shape[0]
        slots = ws.slots(sync.next_parity, torch.uint8)  # the parity this step writes
        offsets = _block_offsets(n, widths)
        fits = offsets[-1] <= ws.slot_bytes
        mine = slots[me]
        parity = sync.next_parity
        head = self._heads[parity][me]
        head[0], head[1] = n, fits
        head[2] = -1 if claimed is None else _counts_digest(claimed)
        plain_stores = True  # every copy in is this thread's memmove (or none)
        if fits:
            base = self.slot_addresses[parity][me]
            for t, at, width in zip(tensors, offsets, widths, strict=False):
                nbytes = n * width
                if (nbytes <= _MEMMOVE_MAX and t.data_ptr() >= NULL_PAGE  # no torch dispatch
                        and t.is_contiguous()):
                    _memmove(base + at, t.data_ptr(), nbytes)
                elif nbytes:
                    mine[at:at + nbytes].copy_(t.reshape(-1).view(torch.uint8))
                    plain_stores = False
        sync.step("all_gatherv_rows", signature("all_gatherv_rows", torch.uint8), size_key, True,
                  plain_stores)  # the header's numpy stores, glibc's memmove
        heads = [h.tolist() for h in self._heads[parity]]
        counts = [int(h[0]) for h in heads]
        if any(c < 0 for c in counts):
            raise CollectiveMismatch(
                f"op all_gatherv_rows: rank {next(r for r, c in enumerate(counts) if c < 0)} "
                f"wrote a negative row count ({counts})", peers=tuple(
                    r for r, c in enumerate(counts) if c < 0))
        wrong = [r for r, h in enumerate(heads) if h[2] not in (-1, _counts_digest(counts))]
        if wrong:
            raise CollectiveMismatch(
                f"op all_gatherv: ranks {wrong} passed sizes that are not the ranks' row "
                f"counts {counts}; every rank passes the same sizes list", peers=tuple(wrong))
        if not all(h[1] for h in heads):
            return counts, None
        blocks = [_block_offsets(c, widths) for c in counts]
        over = [r for r, b in enumerate(blocks) if b[-1] > ws.slot_bytes]
        if over:
            raise CollectiveMismatch(
                f"op all_gatherv_rows: ranks {over} claim rows that do not fit a slot "
                f"(row counts {counts})", peers=tuple(over))
        if (sum(counts) * max(widths, default=0) <= _MEMMOVE_MAX
                and all(t.is_contiguous() for t in tensors)):  # its own rows by address too
            return counts, self._rows_by_address(tensors, widths, parity, counts, blocks)
        return counts, self._rows_out(tensors, widths, slots, counts, blocks)

    def _rows_by_address(self, tensors: Sequence[torch.Tensor], widths: Sequence[int],
                         parity: int, counts: list[int],
                         blocks: list[list[int]]) -> list[torch.Tensor]:
        """:meth:`_rows_out` for at most :data:`_MEMMOVE_MAX` bytes a tensor: each
        result allocated once and every rank's block copied into it with ``memmove``
        (this rank's from its own tensor): no torch call but the allocation."""
        out = []
        total = sum(counts)
        addresses = self.slot_addresses[parity]
        for j, (t, width) in enumerate(zip(tensors, widths, strict=True)):
            result = torch.empty((total, *t.shape[1:]), dtype=t.dtype, device="cpu")
            at = result.data_ptr()
            for rank, c in enumerate(counts):
                nbytes = c * width
                if nbytes:
                    src = t.data_ptr() if rank == self.me else addresses[rank] + blocks[rank][j]
                    _memmove(at, src, nbytes)
                    at += nbytes
            out.append(result)
        return out

    @threaded(lambda self, tensors, widths, slots, counts, blocks: sum(counts) * sum(widths))
    def _rows_out(self, tensors: Sequence[torch.Tensor], widths: Sequence[int],
                  slots: list[torch.Tensor], counts: list[int],
                  blocks: list[list[int]]) -> list[torch.Tensor]:
        """Each tensor's block (at ``blocks[rank][j]``) from every slot, concatenated
        in rank order."""
        out = []
        for j, (t, width) in enumerate(zip(tensors, widths, strict=True)):
            row_shape = tuple(t.shape[1:])
            pieces = []
            for rank, (slot, c) in enumerate(zip(slots, counts, strict=True)):
                if rank == self.me:
                    pieces.append(t)
                    continue
                at = blocks[rank][j]
                pieces.append(slot[at:at + c * width].view(t.dtype).view((c, *row_shape)))
            out.append(torch.cat(pieces))
        return out


def _counts_digest(counts: Sequence[int]) -> int:
    """A non-negative int64 of a row-count list (the same in every process)."""
    return hash(tuple(counts)) & 0x7FFF_FFFF_FFFF_FFFF


def _block_offsets(n: int, widths: Sequence[int]) -> list[int]:
    """Where each tensor's ``n`` rows start in a slot, and (last) the end of the last."""
    offsets, at = [], ROWS_HEADER
    for width in widths:
        offsets.append(at)
        at += -(-n * width // ROWS_HEADER) * ROWS_HEADER
    return [*offsets, at]
