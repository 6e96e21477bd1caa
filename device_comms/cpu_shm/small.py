"""The one-step all_reduce of the shared-memory engine: the latency-bound case.

An all_reduce of at most a slot and :data:`~device_comms.cpu_shm.engine_threads.GRAIN`
elements (two ranks that both run their kernels on one thread: up to
:data:`~device_comms.cpu_shm.engine.PAIR_ONE_STEP_MAX_BYTES`, as
:meth:`~device_comms.cpu_shm.engine.ShmEngine.agree_pair_one_step` sets it) is one step of
:class:`~device_comms.cpu_shm.sync.StepSync`: every rank copies its input into
its slot, publishes, and reduces all slots in rank order. Past the grain torch
would run a kernel on its own thread count, so such an entry's call runs under
the engine's thread limit (:attr:`SmallEntry.threaded`).
For such a call the collective's own work is a few small copies and one
element-wise op, so the Python calls around it decide its speed, and
:class:`SmallAllReduce` keeps them few:

* a :class:`SmallEntry` holds what one (op, dtype, shape) needs -- the step's
  signature, the slot views, the reduction -- and :attr:`SmallAllReduce.last`
  is the last one used, matched by identity (hashing a ``ReduceOp`` runs Python
  code); a caller that checked a tensor against it may call
  :meth:`SmallAllReduce.run` directly. Up to :data:`KEPT_ENTRIES` entries are
  kept (:meth:`SmallAllReduce.find`), so layers that alternate between layouts
  do not make an entry per call;
* the input goes into the slot with one ``ctypes.memmove`` the first time an
  address is seen and, from its second call on, through a numpy view of that
  address (an in-place result is written through it too): one numpy copy has
  no foreign-call overhead (:class:`~device_comms.cpu_shm.address_views.AddressViews`
  says when such a view is right);
* the step skips the ordering fences a TSO machine does not need
  (``StepSync.step(plain_stores=True)``; the argument is in
  :mod:`device_comms.cpu_shm.sync`);
* float32/float64/int32/int64 sums are ``numpy.add`` (bitwise the same sum with
  less dispatch than ``torch.add``; :data:`~device_comms.fixed_reduce.NUMPY_SUM`),
  wrapped with ``torch.from_numpy``.

**Two ranks, into the peer's slot** (from :data:`PAIR_SMALL_MIN_BYTES`; a
reduction torch runs, not a ``numpy.add`` sum, only from
:data:`PAIR_TORCH_INTO_PEER_MIN_BYTES` to :data:`PAIR_TORCH_INTO_PEER_MAX_BYTES`:
outside that window reading both slots measured faster): each
rank copies its tensor into its slot, steps, reduces into the *peer's* slot in
rank order (``fn(x0, x1)`` on both, so the bits agree) and copies that out
(into ``out`` when given). A shared line is then written by its owner and
read-and-written by the peer, so it moves between the caches in the modified
state (when the peer only reads it, the owner's next write must first
invalidate the peer's copy: docs/performance.md, "Lines the peer has read").
The rank's own slot belongs to the peer from the step until the next one: the
peer writes a rank's slot only between the step and its next one, which the
double-buffer argument of :mod:`device_comms.cpu_shm.sync` covers ("Writing a
peer's slot").

**reduce_scatter in one step** (:meth:`SmallAllReduce.remember_scatter`): when
each rank's part of the input is one block (the dimensions before the scattered
one are all of length 1), the same step serves a reduce_scatter: every rank
copies its whole input into its slot, steps, and reduces only its own part of
every slot, in rank order, into a new tensor of the part's shape. Its step is
signed as the engine's general reduce_scatter signs its first step, so ranks
whose layouts take different paths still find the mismatch.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import torch

from device_comms.cpu_shm.address_views import NULL_PAGE, AddressViews
from device_comms.cpu_shm.context import EngineContext, shape_key, signature
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.cpu_shm.host_arrays import array_of, mark_written, numpy_dtype
from device_comms.cpu_shm.seen_once import SeenOnce
from device_comms.fixed_reduce import NUMPY_ERRORS, NUMPY_SUM, binary_fn, quiet_numpy_sum
from device_comms.reduce_op import ReduceOp

__all__ = ["SmallAllReduce", "SmallEntry", "NotServed", "KEPT_ENTRIES", "PAIR_SMALL_MIN_BYTES",
           "PAIR_TORCH_INTO_PEER_MIN_BYTES", "PAIR_TORCH_INTO_PEER_MAX_BYTES"]

#: Two ranks: the smallest one-step all_reduce that reduces into the peer's slot. Its
#: extra copy out of the slot is a fixed cost per call; what it saves (lines that move
#: once, in the modified state) grows with the message, and outweighs the copy from
#: here on (the crossover is measured in docs/performance.md).
PAIR_SMALL_MIN_BYTES = 4 << 10
#: Two ranks: the smallest one-step all_reduce reduced by torch (not a ``numpy.add``
#: sum) that reduces into the peer's slot. Below it, torch's copy out of the peer's
#: slot (a ``clone`` or ``copy_``, 1.2 us at 4 KiB against numpy's 0.2) costs more
#: than the line transfers it saves (docs/performance.md, "Torch's reductions below
#: 64 KiB").
PAIR_TORCH_INTO_PEER_MIN_BYTES = 64 << 10
#: Two ranks: the largest one-step all_reduce reduced by torch (not a ``numpy.add``
#: sum: bfloat16, float16, MAX, ...) that reduces into the peer's slot; larger ones
#: read both slots into a private result, which measured faster there
#: (docs/performance.md, "Torch's reductions past 128 KiB").
PAIR_TORCH_INTO_PEER_MAX_BYTES = 128 << 10
_ADDRESSES_MAX = 16  # caller addresses with views, per entry
#: Entries a :class:`SmallAllReduce` keeps, one per (op, dtype, shape): an engine's
#: layers alternate among a few layouts, and making an entry costs several calls' time.
KEPT_ENTRIES = 64
_memmove = ctypes.memmove
_from_numpy = torch.from_numpy


class NotServed(Exception):
    """:meth:`SmallAllReduce.run` cannot serve this call as it stands (raised before
    any step); the caller takes its checked path, which says why."""


def numpy_sum(tensor: torch.Tensor, op: ReduceOp) -> bool:
    """Whether a one-step all_reduce of ``tensor`` with ``op`` is a ``numpy.add`` sum
    (else torch reduces)."""
    # 0-d: numpy's ufuncs return scalars, not arrays
    return op is ReduceOp.SUM and tensor.dtype in NUMPY_SUM and tensor.dim() > 0


class SmallEntry:
    """What a one-step all_reduce (or reduce_scatter) of one (op, dtype, shape) needs,
    kept for the next call.

    Without arguments: the entry no call matches.

    Args:
        ctx: The engine's context (its slots are viewed).
        tensor: A contiguous tensor of the shape and dtype (it fits a slot).
        op: The reduction.
        into_peer: Two ranks reduce into each other's slot.
        part: A reduce_scatter's: ``(start, shape)``, this rank's part of the
            input (contiguous from element ``start``, of ``shape``), which is
            all it reduces; None: an all_reduce.
        size_key: The step's size key (None: the shape's).
        kind: The collective's name (None: ``"all_reduce"``, or
            ``"reduce_scatter"`` with ``part``).

    Attributes:
        kind: The collective (``"all_reduce"`` or ``"reduce_scatter"``), signed
            into the step and named in its errors.
        op: The reduction (None: the entry no call matches).
        dtype: The tensors' dtype.
        shape: Their shape.
        nbytes: Their bytes.
        itemsize: Bytes of one element.
        plain: Real dtype (no lazy conjugation to resolve): a caller that checked
            a tensor's dtype, shape, device, layout, strides and grad against
            this entry, and that its storage still holds its bytes, may call
            :meth:`SmallAllReduce.run` directly.
        sig: The step's signature word.
        size_key: The step's size key.
        fn: ``fn(a, b, out=...)``: the reduction of two operands.
        numpy: The operands are numpy arrays (a sum ``numpy.add`` runs).
        avg: Divide by the number of ranks at the end.
        into_peer: Two ranks reduce into each other's slot.
        threaded: torch runs this entry's kernels (more than ``GRAIN`` elements,
            not a numpy sum): they run under the engine's thread limit.
        parities: Per buffer parity: this rank's slot as ``nbytes`` numpy bytes,
            every rank's slot as an operand, and the operands past the first two.
        scratch: A numpy sum with ``out`` and without ``into_peer``: the array it
            reduces into when ``out`` has no view, then copied into ``out``.
        scratch_address: ``scratch``'s address.
        by_address: Views of caller memory by address (input and ``out``).
    """

    __slots__ = ("kind", "op", "dtype", "shape", "nbytes", "itemsize", "plain", "sig",
                 "size_key", "fn",
                 "numpy", "avg", "into_peer", "threaded", "parities", "scratch",
                 "scratch_address", "by_address")

    def __init__(
        self,
        ctx: EngineContext | None = None,
        tensor: torch.Tensor | None = None,
        op: ReduceOp | None = None,
        into_peer: bool = False,
        part: tuple[int, torch.Size] | None = None,
        size_key: int | None = None,
        kind: str | None = None,
    ) -> None:
        self.scratch: Any = None
        self.scratch_address = 0
        self.kind = kind or ("all_reduce" if part is None else "reduce_scatter")
        if ctx is None or tensor is None or op is None:  # the entry no call matches
            self.op, self.dtype, self.shape, self.nbytes, self.itemsize = None, None, None, 0, 0
            self.plain = self.numpy = self.avg = self.into_peer = self.threaded = False
            self.sig = self.size_key = 0
            self.fn: Any = torch.add
            self.parities: tuple[tuple[Any, list[Any], list[Any]], ...] = ((None, [], []),) * 2
            self.by_address = AddressViews(torch.empty(0, device="cpu"))
            return
        dtype, shape = tensor.dtype, tensor.shape
        self.op, self.dtype, self.shape, self.nbytes = op, dtype, shape, tensor.nbytes
        self.itemsize = tensor.element_size()
        self.plain = not dtype.is_complex
        self.sig = signature(self.kind, dtype, op)
        self.size_key = shape_key(shape) if size_key is None else size_key
        self.avg = op is ReduceOp.AVG
        self.into_peer = into_peer and part is None
        operands: list[list[Any]]
        if part is None:
            operands = [ctx.shaped(0, tensor), ctx.shaped(1, tensor)]
        else:  # every rank's copy of this rank's part
            start, part_shape = part
            end = start + math.prod(part_shape)
            operands = [[slot[start:end].view(part_shape) for slot in ctx.ws.slots(parity, dtype)]
                        for parity in (0, 1)]
        self.numpy = numpy_sum(tensor, op)
        if self.numpy:
            self.fn = np.add
            operands = [[view.numpy() for view in operands[0]],
                        [view.numpy() for view in operands[1]]]
            if not into_peer and part is None:  # out= goes here when out has no view
                self.scratch = np.empty(tuple(shape), dtype=numpy_dtype(dtype))
                self.scratch_address = self.scratch.ctypes.data
        else:
            self.fn = binary_fn(op, dtype)
        self.threaded = not self.numpy and tensor.numel() > GRAIN
        nbytes, me, slot = tensor.nbytes, ctx.me, ctx.ws.slot
        self.parities = (
            (slot(0, me, torch.uint8)[:nbytes].numpy(), operands[0], operands[0][2:]),
            (slot(1, me, torch.uint8)[:nbytes].numpy(), operands[1], operands[1][2:]),
        )
        self.by_address = AddressViews(
            tensor, numpy_dtype(dtype) if self.numpy else None, _ADDRESSES_MAX
        )


#: The entry no call matches.
_NO_ENTRY = SmallEntry()


class SmallAllReduce:
    """The one-step all_reduce over an engine context: entries by (op, dtype, shape), the call.

    Args:
        ctx: The engine's context.
        into_peer_min_bytes: Two ranks: one-step all_reduces of at least this many
            bytes reduce into the peer's slot; smaller ones read both slots.
        into_peer_torch_min_bytes: Two ranks: one-step all_reduces that torch
            reduces (not ``numpy.add`` sums) and that are smaller than this read
            both slots too.
        into_peer_torch_max_bytes: Two ranks: one-step all_reduces that torch
            reduces and that are larger than this read both slots too.

    Attributes:
        last: The entry of the last one-step all_reduce (see :meth:`remember`).
        into_peer_min_bytes: As the argument (read when an entry is made).
        into_peer_torch_min_bytes: As the argument (read when an entry is made).
        into_peer_torch_max_bytes: As the argument (read when an entry is made).
    """

    def __init__(
        self,
        ctx: EngineContext,
        into_peer_min_bytes: int = PAIR_SMALL_MIN_BYTES,
        into_peer_torch_max_bytes: int = PAIR_TORCH_INTO_PEER_MAX_BYTES,
        into_peer_torch_min_bytes: int = PAIR_TORCH_INTO_PEER_MIN_BYTES,
    ) -> None:
        self._ctx = ctx
        self._sync = ctx.sync
        self._size = ctx.size
        self._me = ctx.me
        self._my_slot = (ctx.slot_addresses[0][ctx.me], ctx.slot_addresses[1][ctx.me])
        self.into_peer_min_bytes = into_peer_min_bytes
        self.into_peer_torch_max_bytes = into_peer_torch_max_bytes
        self.into_peer_torch_min_bytes = into_peer_torch_min_bytes
        self._kernel_threads = ctx.kernel_threads
        self.last = _NO_ENTRY
        #: The entries by (dtype, shape, id of the op), oldest first.
        self._kept: dict[tuple[torch.dtype, torch.Size, int], SmallEntry] = {}
        #: The reduce_scatter entries by (dtype, shape, id of the op, dim, None),
        #: oldest first.
        self._kept_scatter: dict[
            tuple[torch.dtype, torch.Size, int, int, tuple[int, ...] | None], SmallEntry] = {}
        self._scatter_seen = SeenOnce(KEPT_ENTRIES)  # layouts without an entry, seen once
        #: The reduce_scatterv entries, likewise (by counts too).
        self._kept_scatterv: dict[
            tuple[torch.dtype, torch.Size, int, int, tuple[int, ...] | None], SmallEntry] = {}
        self._scatterv_seen = SeenOnce(KEPT_ENTRIES)

    def find(self, op: Any, dtype: torch.dtype, shape: torch.Size) -> SmallEntry:
        """The kept entry of ``op`` on ``dtype`` and ``shape``, made :attr:`last`; else the
        entry no call matches (its ``plain`` is False). A caller that checked a tensor
        as :attr:`SmallEntry.plain` says may then :meth:`run` it directly.

        ``op`` may be anything: entries are found by its identity (``id``: a kept
        entry holds its op, so no other object has that id meanwhile), which
        costs less than hashing a ``ReduceOp``.
        """
        entry = self._kept.get((dtype, shape, id(op)))
        if entry is None:
            return _NO_ENTRY
        self.last = entry
        return entry

    def remember(self, tensor: torch.Tensor, op: ReduceOp) -> SmallEntry:
        """The entry for ``tensor``'s shape and dtype (contiguous, fits a slot) and
        ``op``, made :attr:`last`: the kept one, else a new one, kept in place of
        the one kept longest once :data:`KEPT_ENTRIES` are."""
        key = (tensor.dtype, tensor.shape, id(op))
        kept = self._kept
        entry = kept.get(key)
        if entry is None:
            nbytes = tensor.nbytes
            into_peer = self._size == 2 and nbytes >= self.into_peer_min_bytes and (
                numpy_sum(tensor, op)
                or self.into_peer_torch_min_bytes <= nbytes <= self.into_peer_torch_max_bytes)
            entry = SmallEntry(self._ctx, tensor, op, into_peer)
            if len(kept) >= KEPT_ENTRIES:
                del kept[next(iter(kept))]
            kept[key] = entry
        self.last = entry
        return entry

    def find_scatter(self, op: Any, dtype: torch.dtype, shape: torch.Size, dim: int,
                     counts: tuple[int, ...] | None = None) -> SmallEntry:
        """The kept reduce_scatter entry of ``op`` on ``dtype`` and ``shape`` along ``dim``
        (non-negative; with ``counts``, a reduce_scatterv's), else the entry no call
        matches; found as :meth:`find` finds."""
        kept = self._kept_scatter if counts is None else self._kept_scatterv
        return kept.get((dtype, shape, id(op), dim, counts), _NO_ENTRY)

    def remember_scatter(self, tensor: torch.Tensor, dim: int, op: ReduceOp, size_key: int,
                         counts: tuple[int, ...] | None = None) -> SmallEntry | None:
        """The reduce_scatter entry for ``tensor`` (contiguous, fits a slot, its
        dimensions before ``dim`` all of length 1, ``dim`` non-negative and divided
        among the ranks, or by ``counts`` for a reduce_scatterv) and ``op``: this
        rank's part of it, reduced from every rank's slot; ``size_key`` signs the
        step. Kept as :meth:`remember` keeps all_reduce entries, and made only
        when the layout comes back (None the first time: the caller takes the
        engine's general reduce_scatter)."""
        key = (tensor.dtype, tensor.shape, id(op), dim, counts)
        # reduce_scatterv's counts change from step to step: their entries come and go
        # in a table of their own, which leaves the reduce_scatter entries be
        kept, seen = ((self._kept_scatter, self._scatter_seen) if counts is None
                      else (self._kept_scatterv, self._scatterv_seen))
        entry = kept.get(key)
        if entry is None:
            if not seen.again(key):  # id(op): a false "seen" costs one entry
                return None
            part_shape = list(tensor.shape)
            inner = math.prod(part_shape[dim + 1:])
            me = self._me
            if counts is None:
                part_shape[dim] //= self._size
                start = me * part_shape[dim] * inner
            else:
                part_shape[dim] = counts[me]
                start = sum(counts[:me]) * inner
            entry = SmallEntry(self._ctx, tensor, op, part=(start, torch.Size(part_shape)),
                               size_key=size_key,
                               kind="reduce_scatter" if counts is None else "reduce_scatterv")
            if len(kept) >= KEPT_ENTRIES:
                del kept[next(iter(kept))]
            kept[key] = entry
        return entry

    def close(self) -> None:
        """Drop the entries (their views map the workspace)."""
        self.last = _NO_ENTRY
        self._kept.clear()
        self._kept_scatter.clear()
        self._scatter_seen.clear()
        self._kept_scatterv.clear()
        self._scatterv_seen.clear()

    def run(
        self, tensor: torch.Tensor, entry: SmallEntry, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The one-step all_reduce of ``tensor``, which matches ``entry`` (op, dtype, shape),
        or its reduce_scatter for an entry of :meth:`remember_scatter`.

        ``entry`` comes from :meth:`remember` (its views map this workspace);
        ``tensor`` is contiguous. Returns ``out`` (``tensor`` itself or disjoint
        from it) when given (an all_reduce's only), else a new tensor.

        Raises:
            NotServed: ``tensor`` has no memory (before any step).
        """
        if entry.threaded:
            with self._kernel_threads:
                return self._run(tensor, entry, out)
        return self._run(tensor, entry, out)

    def _run(
        self, tensor: torch.Tensor, entry: SmallEntry, out: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`run`, under the engine's thread limit where the entry needs it."""
        sync = self._sync
        parity = (sync.gen + 1) & 1  # sync.next_parity, without the property call
        mine, operands, more = entry.parities[parity]
        src = tensor.data_ptr()
        held = entry.by_address.get(src)
        if held is not None:
            mine[...] = held[0]
        else:
            if src < NULL_PAGE and entry.nbytes:  # storage-less zeros or a freed storage
                raise NotServed("input_ has no memory")  # the caller's checks say which
            _memmove(self._my_slot[parity], src, entry.nbytes)
            held = entry.by_address.sight(tensor, src)
        sync.step(entry.kind, entry.sig, entry.size_key, True, True)  # glibc / numpy stores
        if out is not None:  # the operands are slot views: out may be tensor
            return self._into(tensor, operands, more, entry, out, held)
        if entry.into_peer:
            return self._into_peer(tensor, operands[1 - self._me], entry, held)
        fn = entry.fn
        try:
            acc = fn(operands[0], operands[1])
            for operand in more:
                fn(acc, operand, out=acc)
        except NUMPY_ERRORS:  # an overflow report turned into an error: redo it quietly
            if not entry.numpy:
                raise
            acc = quiet_numpy_sum(operands)
        if entry.numpy:
            return _from_numpy(acc)
        reduced: torch.Tensor = acc  # the reduction was torch's, not numpy's
        if entry.avg:
            reduced.div_(self._size)
        return reduced

    def _into(
        self,
        tensor: torch.Tensor,
        operands: list[Any],
        more: list[Any],
        entry: SmallEntry,
        out: torch.Tensor,
        held_input: tuple[Any, Any] | None,
    ) -> torch.Tensor:
        """The one-step all_reduce's result in ``out`` (which may be ``tensor``).

        Reading every slot, the reduction of the slot views ``operands``
        (``more``: those past the first two) goes straight into ``out``. Into
        the peer's slot, the rank's own operand is ``tensor`` (the peer may be
        reducing into this rank's slot), the reduction goes into the peer's slot
        and is copied into ``out``: ``tensor`` is read before ``out`` is written.
        ``held_input``: the entry's views of ``tensor``'s bytes, if it has them.
        """
        fn = entry.fn
        held = held_input  # views of out's bytes
        if out is not tensor:
            address = out.data_ptr()
            held = entry.by_address.get(address) or entry.by_address.sight(out, address)
        if entry.scratch is not None:
            # Into out's own view if the entry has one, else a private array and one
            # memmove into out: cheaper than making an array view of out.
            acc = entry.scratch if held is None else held[1]
            try:
                fn(operands[0], operands[1], out=acc)
                for operand in more:
                    fn(acc, operand, out=acc)
            except NUMPY_ERRORS:  # an overflow report turned into an error: redo it quietly
                quiet_numpy_sum(operands, acc)
            if held is None:
                _memmove(out.data_ptr(), entry.scratch_address, out.nbytes)
            mark_written(out)
            return out
        acc = out
        if entry.numpy:
            acc = held[1] if held is not None else array_of(out)
        if entry.into_peer:  # into the peer's slot first (the module docstring says why)
            reduced = self._reduce_into_peer(tensor, operands[1 - self._me], entry, held_input)
            if entry.numpy:
                acc[...] = reduced
            elif entry.avg:
                torch.div(reduced, 2, out=out)
            else:
                out.copy_(reduced)
            mark_written(out)
            return out
        try:  # noqa: SIM105 - suppress() would add a context manager to every call
            fn(operands[0], operands[1], out=acc)
        except NUMPY_ERRORS:  # a report comes after acc was written: the IEEE result stands
            pass
        for operand in more:
            fn(acc, operand, out=acc)
        if entry.avg:
            out.div_(self._size)
        mark_written(out)
        return out

    def _into_peer(
        self, tensor: torch.Tensor, peer: Any, entry: SmallEntry, held: tuple[Any, Any] | None
    ) -> torch.Tensor:
        """Two ranks: reduce into the peer's slot view ``peer`` in rank order and copy it
        out (the module docstring says why); this rank's own slot is the peer's to
        modify. ``held``: the entry's views of ``tensor``'s bytes, if it has them."""
        peer = self._reduce_into_peer(tensor, peer, entry, held)
        if entry.numpy:
            return _from_numpy(peer.copy())
        return torch.div(peer, 2) if entry.avg else peer.clone()

    def _reduce_into_peer(
        self, tensor: torch.Tensor, peer: Any, entry: SmallEntry, held: tuple[Any, Any] | None
    ) -> Any:
        """Two ranks: reduce ``tensor`` and the peer's slot view ``peer`` in rank order
        into ``peer`` and return it. ``held``: the entry's views of ``tensor``'s bytes,
        if it has them."""
        fn = entry.fn
        own: Any = tensor
        if entry.numpy:
            own = held[1] if held is not None else array_of(tensor)
        try:
            if self._me == 0:
                fn(own, peer, out=peer)
            else:
                fn(peer, own, out=peer)
        except NUMPY_ERRORS:  # reported after peer was written: the IEEE result stands
            pass
        return peer
