"""Collectives among the ranks of one node through a shared-memory workspace.

Algorithms (``L`` local ranks; every op is one or more steps of
:class:`~device_comms.cpu_shm.sync.StepSync`; messages larger than a slot go in
slot-sized pieces, two steps apart in the double buffer):

* **all_reduce, one shot** (one step per slot-sized piece): every rank copies
  its tensor into its slot; every rank reduces all ``L`` slots in rank order
  (its own operand straight from its input). A handful of torch calls: one
  copy, ``L-1`` element-wise ops. Used up to :data:`DEFAULT_ONESHOT_BYTES`
  (configurable; beyond a slot it goes in pieces).
* **all_reduce, two ranks**: one step into the peer's slot from
  :data:`~device_comms.cpu_shm.small.PAIR_SMALL_MIN_BYTES` (up to :data:`GRAIN`
  elements, or :data:`PAIR_ONE_STEP_MAX_BYTES` when both ranks run their kernels
  on one thread: :meth:`ShmEngine.agree_pair_one_step`), and beyond one step a
  pipelined reduce-scatter + all-gather in which each rank reduces half of
  every piece (:mod:`device_comms.cpu_shm.pair`).
* **all_reduce, large** (reduce-scatter + all-gather, two steps
  per piece): the piece is cut into ``L`` regions; rank ``i`` copies the
  regions *other* ranks own into its slot, reduces region ``i`` (its own input
  plus the peers' slots, in rank order) into its slot of the other parity, and
  then every rank copies all reduced regions out. Each region is computed by
  exactly one rank, so results are identical everywhere, and the reduction
  work and memory bandwidth are shared.
* **reduce_scatter(v)**: rank ``j``'s region of every rank's input goes through
  the slots; rank ``j`` reduces it (one step per piece). A small reduce_scatter
  whose regions are blocks of the input is one step of the one-step all_reduce
  (:meth:`ShmEngine.one_step_scatter`).
* **all_gather(v)/gather**: every rank copies its tensor in; readers copy all
  slots out: ``torch.cat`` straight from the slots when it fits, else blocks
  of rows written into the output's final layout
  (:meth:`~device_comms.cpu_shm.gather.ShmGathers.gather_rows`).
* **broadcast/reduce**: the root writes / only the root reduces; a broadcast of
  at most :data:`BY_ADDRESS_MAX_BYTES` that fits a slot is one step with one
  ``memmove`` in and one out (:meth:`ShmEngine.broadcast_by_address`).
* **all_to_allv**: each rank's rows for the others stream through its slot,
  every receiver copies its part straight into place: one copy in, one out
  (:class:`~device_comms.cpu_shm.alltoallv.ShmAllToAllv`).

Composition: the engine is built over one
:class:`~device_comms.cpu_shm.context.EngineContext` (workspace, step
synchroniser, thread cap, slot views) and owns one part per scheme that has its
own state: :class:`~device_comms.cpu_shm.small.SmallAllReduce` (the one-step
all_reduce, at most a slot and :data:`GRAIN` elements: the latency-bound case;
two ranks at one thread each up to :data:`PAIR_ONE_STEP_MAX_BYTES`),
:class:`~device_comms.cpu_shm.pair.PairAllReduce` (two ranks, beyond one step),
:class:`~device_comms.cpu_shm.gather.ShmGathers` and
:class:`~device_comms.cpu_shm.alltoallv.ShmAllToAllv`. It runs the reductions
of any number of ranks and the broadcast itself, and chooses among them.

Threads: every op over more than :data:`~device_comms.cpu_shm.engine_threads.GRAIN`
elements runs its torch kernels under :attr:`ShmEngine.kernel_threads`, with
:attr:`ShmEngine.threads` intra-op threads (the node's CPUs divided among its
local ranks, whatever torch's own setting; :mod:`device_comms.cpu_shm.engine_threads`
says why: with torch's default thread count every rank's OpenMP team spins on
the CPUs its peers need, and one thread per rank leaves a many-core node's
memory bandwidth idle). Smaller kernels never start a parallel region.

Results of :data:`~device_comms.cpu_shm.host_alloc.HUGE_MIN_BYTES` and more are
allocated with :func:`device_comms.cpu_shm.host_alloc.empty` (huge pages: a
fresh mapping of that size would otherwise fault in 4 KiB at a time, which can
cost more than the collective; :mod:`device_comms.cpu_shm.host_alloc` says why).

Each op's first step carries a signature (op kind, dtype, reduce op, root,
and a size key covering the shape and layout arguments; see
:func:`~device_comms.signatures.step_signature.shape_key`) that every rank compares, so
mismatched calls raise
:class:`~device_comms.errors.CollectiveMismatch` everywhere instead of
returning garbage. Results are always new tensors (never views of the
workspace), except the broadcasts, which fill their argument. A
new result may live in memory torch did not allocate (numpy's, huge pages),
so its storage cannot grow (``resize_`` to more elements raises); a caller's
own tensors are never marked so (:mod:`device_comms.cpu_shm.host_arrays`).
Not thread-safe: one collective at a time per communicator, as with NCCL
(:class:`~device_comms.cpu.communicator.CpuCommunicator` refuses a second
thread's collective with :class:`~device_comms.errors.ConcurrentCallError`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.alltoallv import ShmAllToAllv
from device_comms.cpu_shm.context import EngineContext, shape_key, signature
from device_comms.cpu_shm.engine_threads import GRAIN, threaded
from device_comms.cpu_shm.gather import ShmGathers
from device_comms.cpu_shm.host_arrays import mark_written
from device_comms.cpu_shm.pair import PairAllReduce
from device_comms.cpu_shm.small import SmallAllReduce, SmallEntry
from device_comms.cpu_shm.sync import StepSync
from device_comms.cpu_shm.workspace import ShmWorkspace
from device_comms.fixed_reduce import reduce_views
from device_comms.reduce_op import ReduceOp

__all__ = ["ShmEngine", "DEFAULT_ONESHOT_BYTES", "PAIR_ONE_STEP_MAX_BYTES",
           "BY_ADDRESS_MAX_BYTES"]

#: Largest all_reduce done in one shot; above it, reduce-scatter + all-gather. One
#: shot takes one synchronisation per piece where the two-phase scheme takes two,
#: and the two-phase scheme moves fewer bytes per rank and shares the reduction: one
#: shot wins while synchronisation dominates, two-phase once memory bandwidth does
#: (the crossover is measured in docs/performance.md).
DEFAULT_ONESHOT_BYTES = 2 << 20
#: Two ranks that both run their kernels on one thread: the largest all_reduce done
#: in one step into the peer's slot, past :data:`GRAIN` elements (the ranks agree on
#: it: :meth:`ShmEngine.agree_pair_one_step`). Lines of the
#: slots then move between the two caches in the modified state; the pipelined
#: scheme's peer only reads them, and the next write to a line the peer holds
#: waits for its copy to be invalidated: 4.5x the cost of writing a line the peer
#: never touched, 17x on a host in a slow state (docs/performance.md, "Lines the
#: peer has read"). Ranks with more threads keep the pipelined scheme past the grain.
PAIR_ONE_STEP_MAX_BYTES = 512 << 10
#: Largest broadcast :meth:`ShmEngine.broadcast_by_address` copies with one thread's
#: ``memmove`` (larger ones: torch copies, parallel with the engine's thread count).
BY_ADDRESS_MAX_BYTES = 256 << 10
_ALIGN_BYTES = 64  # region boundaries on cache lines
_VIEW_CACHE_MAX = 512
_memmove = ctypes.memmove


class ShmEngine:
    """Shared-memory collectives for the local ranks of a workspace.

    Args:
        ws: The mapped workspace.
        sync: The step synchroniser over ``ws``.
        oneshot_bytes: Largest all_reduce/reduce done in one shot.
        threads: Most intra-op threads the engine's kernels use; None for
            :func:`~device_comms.cpu_shm.engine_threads.engine_threads` (the node's
            CPUs divided among its local ranks).

    Attributes:
        ctx: What the parts share (workspace, synchroniser, thread cap, views).
        ws: The workspace.
        sync: The step synchroniser.
        size: Number of local ranks.
        me: This rank's local index.
        threads: The engine's thread limit.
        kernel_threads: Context manager limiting torch's intra-op threads to
            :attr:`threads` inside.
        oneshot_bytes: all_reduce/reduce up to this many bytes run one shot (in
            slot-sized pieces above a slot); larger ones reduce-scatter + all-gather.
        small: The one-step all_reduce.
        pair: Two ranks: the all_reduce beyond one step (used while its
            ``piece_bytes`` is not 0); None with more ranks.
        pair_one_step_bytes: Two ranks: all_reduces past :data:`GRAIN` elements
            and up to this many bytes (at most a slot) take one step into the
            peer's slot; 0 (the default): none do. It decides how many steps a
            call takes, so it must be the same on both ranks: set it with
            :meth:`agree_pair_one_step`.
        gathers: all_gather(v) and gather.
        alltoallv: The uneven all-to-all.
        all_gather_cat: :meth:`ShmGathers.all_gather_cat` of :attr:`gathers`.
        gatherv_cat: :meth:`ShmGathers.gatherv_cat` of :attr:`gathers`.
        gather_rows: :meth:`ShmGathers.gather_rows` of :attr:`gathers`.
        all_to_allv: :meth:`ShmAllToAllv.all_to_allv` of :attr:`alltoallv`.
    """

    def __init__(
        self,
        ws: ShmWorkspace,
        sync: StepSync,
        oneshot_bytes: int | None = None,
        threads: int | None = None,
    ) -> None:
        ctx = self.ctx = EngineContext(ws, sync, threads)
        self.ws = ws
        self.sync = sync
        self.size = ctx.size
        self.me = ctx.me
        self.threads = ctx.threads
        self.kernel_threads = ctx.kernel_threads
        self.oneshot_bytes = DEFAULT_ONESHOT_BYTES if oneshot_bytes is None else oneshot_bytes
        self.small = SmallAllReduce(ctx)
        self.pair = PairAllReduce(ctx) if ctx.size == 2 else None
        self.gathers = ShmGathers(ctx)
        self.alltoallv = ShmAllToAllv(ctx)
        # The parts' ops, bound here so that a call reaches them in one lookup.
        self.all_gather_cat = self.gathers.all_gather_cat
        self.gatherv_cat = self.gathers.gatherv_cat
        self.gather_rows = self.gathers.gather_rows
        self.all_to_allv = self.alltoallv.all_to_allv
        self._one_step_bytes = min(ws.slot_bytes, self.oneshot_bytes)
        self.pair_one_step_bytes = 0
        self._shaped = ctx.shaped
        self._my_slot = (ctx.slot_addresses[0][ctx.me], ctx.slot_addresses[1][ctx.me])
        #: reduce_scatter's one-step views: my slot for the input, every rank's copy
        #: of my region.
        self._scatter_views: dict[
            tuple[int, torch.dtype, int, int, int], tuple[torch.Tensor, list[torch.Tensor]]
        ] = {}

    def close(self) -> None:
        """Mark this rank closed for its peers and unmap. Idempotent."""
        self._scatter_views.clear()
        self.small.close()
        self.gathers.close()
        if self.pair is not None:
            self.pair.close()
        self.alltoallv.close()
        self.ctx.close()

    def _bounds(self, count: int, itemsize: int) -> list[int]:
        """Split ``count`` elements into ``size`` cache-line-aligned regions."""
        align = max(1, _ALIGN_BYTES // itemsize)
        step = math.ceil(count / self.size / align) * align
        return [min(count, region * step) for region in range(self.size + 1)]

    # ------------------------------------------------------------------ reductions
    def agree_pair_one_step(self, threads: Sequence[int]) -> int:
        """Set :attr:`pair_one_step_bytes` from every rank's engine threads and return it.

        Two ranks that both run their kernels on one thread take one step up to
        :data:`PAIR_ONE_STEP_MAX_BYTES`; otherwise the pipelined scheme serves
        everything past :data:`GRAIN` elements. Every rank of the workspace must
        call this with the same ``threads`` (each rank's :attr:`threads`, as an
        all-gather returns them) before its first all_reduce past the grain.

        Args:
            threads: The :attr:`threads` of every rank (any order; ranks on other
                nodes may be included: one above 1 anywhere keeps the scheme off).
        """
        one = self.size == 2 and len(threads) > 0 and max(threads) == 1
        self.pair_one_step_bytes = PAIR_ONE_STEP_MAX_BYTES if one else 0
        return self.pair_one_step_bytes

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All-reduce contiguous ``tensor``, identical on every rank.

        Returns ``out`` (contiguous, ``tensor``'s shape and dtype; ``tensor`` itself
        or disjoint from it) when given, else a new tensor.
        """
        nbytes = tensor.nbytes
        if nbytes <= self._one_step_bytes and (
            tensor.numel() <= GRAIN or nbytes <= self.pair_one_step_bytes
        ):
            small = self.small  # one step; torch runs its kernels serially
            entry = small.last
            # Identity checks, not a dict keyed by the enum: ReduceOp.__hash__ runs in Python.
            if op is not entry.op or tensor.dtype is not entry.dtype or tensor.shape != entry.shape:
                entry = small.remember(tensor, op)
            return small.run(tensor, entry, out)
        with self.kernel_threads:
            result = self._large_all_reduce(tensor, op, out)
        if out is None:
            return result
        mark_written(out)
        return out

    def _large_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The all_reduce beyond one small step (see the module docstring for the schemes)."""
        signed = (signature("all_reduce", tensor.dtype, op), shape_key(tensor.shape))
        pair = self.pair
        if pair is not None and pair.piece_bytes:
            return pair.all_reduce(tensor, op, signed, out)
        if tensor.nbytes <= self._one_step_bytes:
            sync = self.sync
            parity = sync.next_parity
            views = self._shaped(parity, tensor)
            _memmove(self._my_slot[parity], tensor.data_ptr(), tensor.nbytes)
            sync.step("all_reduce", signed[0], signed[1], True)
            if out is not None:  # own operand from the slot: out may be tensor
                return reduce_views(views, op, out=out)
            me = self.me
            return reduce_views([tensor if rank == me else view
                                 for rank, view in enumerate(views)], op)
        result = out if out is not None else host_alloc.empty(tensor.shape, tensor.dtype)
        if tensor.nbytes <= self.oneshot_bytes:  # own operand from the input unless out may be it
            self._oneshot_pieces(tensor, op, "all_reduce", signed, result.view(-1), out is None)
        else:
            self._two_phase(tensor, op, "all_reduce", signed, result.view(-1))
        return result

    @threaded(lambda self, tensor, *_: tensor.numel())
    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp,
        signed: tuple[int, int] | None = None,
        name: str = "reduce",
    ) -> torch.Tensor | None:
        """Reduce onto local rank ``dst`` (new tensor there, None elsewhere).

        ``signed`` replaces the step signature and ``name`` the op named in
        errors (a caller's own, e.g. the hierarchical all-reduce's).
        """
        sync = self.sync
        if signed is None:
            signed = (signature("reduce", tensor.dtype, op, dst), shape_key(tensor.shape))
        if tensor.nbytes <= self._one_step_bytes:
            views = self._shaped(sync.next_parity, tensor)
            views[self.me].copy_(tensor)
            sync.step(name, signed[0], signed[1], True)
            return reduce_views(views, op) if self.me == dst else None
        result = host_alloc.empty(tensor.shape, tensor.dtype) if self.me == dst else None
        flat = None if result is None else result.view(-1)
        if tensor.nbytes <= self.oneshot_bytes:
            self._oneshot_pieces(tensor, op, name, signed, flat, True)
        else:
            self._two_phase(tensor, op, name, signed, flat)
        return result

    def _oneshot_pieces(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        name: str,
        signed: tuple[int, int],
        result: torch.Tensor | None,
        own_from_input: bool,
    ) -> None:
        """One shot per slot-sized piece: everyone writes, readers reduce all slots.

        The reduction goes into flat ``result`` (None: this rank only writes).
        Without ``own_from_input`` the rank's own operand is read from its slot,
        so ``result`` may be ``tensor``.
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        flat, count, dtype = tensor.view(-1), tensor.numel(), tensor.dtype
        chunk = ws.slot_elems(dtype)
        first = True
        for start in range(0, count, chunk):
            end = min(count, start + chunk)
            length = end - start
            parity = sync.next_parity
            ws.slot(parity, me, dtype)[:length].copy_(flat[start:end])
            sync.step(name, signed[0], signed[1], first)
            first = False
            if result is not None:
                srcs = [
                    flat[start:end] if rank == me and own_from_input
                    else ws.slot(parity, rank, dtype)[:length]
                    for rank in range(size)
                ]
                reduce_views(srcs, op, out=result[start:end])

    def _two_phase(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        name: str,
        signed: tuple[int, int],
        result: torch.Tensor | None,
    ) -> None:
        """Reduce-scatter + all-gather per slot-sized piece, into flat ``result`` (None:
        this rank gets nothing).

        ``result`` may be ``tensor``: a piece's input is read before the second
        step, its output written after it.
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        flat, count, dtype = tensor.view(-1), tensor.numel(), tensor.dtype
        chunk = ws.slot_elems(dtype)
        first = True
        for start in range(0, count, chunk):
            bounds = self._bounds(min(chunk, count - start), tensor.element_size())
            parity = sync.next_parity
            mine = ws.slot(parity, me, dtype)
            for region in range(size):
                lo, hi = bounds[region], bounds[region + 1]
                if region != me and hi > lo:
                    mine[lo:hi].copy_(flat[start + lo : start + hi])
            sync.step(name, signed[0], signed[1], first)
            first = False
            lo, hi = bounds[me], bounds[me + 1]
            reduced_parity = sync.next_parity
            if hi > lo:
                srcs = [
                    flat[start + lo : start + hi] if rank == me
                    else ws.slot(parity, rank, dtype)[lo:hi]
                    for rank in range(size)
                ]
                reduce_views(srcs, op, out=ws.slot(reduced_parity, me, dtype)[lo:hi])
            sync.step(name)
            if result is not None:
                for region in range(size):
                    lo, hi = bounds[region], bounds[region + 1]
                    if hi > lo:
                        result[start + lo : start + hi].copy_(
                            ws.slot(reduced_parity, region, dtype)[lo:hi])

    def one_step_scatter(
        self, tensor: torch.Tensor, dim: int, op: ReduceOp, size_key: int,
        counts: tuple[int, ...] | None = None,
    ) -> SmallEntry | None:
        """The one-step reduce_scatter entry for ``tensor`` along non-negative ``dim``
        (divided among the ranks, or by ``counts`` for a reduce_scatterv) and ``op``
        (:meth:`SmallAllReduce.remember_scatter`; ``size_key`` signs the step), when
        one serves it: a contiguous real tensor of at most a slot and :data:`GRAIN`
        elements whose dimensions before ``dim`` are all of length 1, so that each
        rank's part is one block. None: the caller takes :meth:`reduce_scatter`,
        which signs its first step the same way."""
        if not tensor.is_contiguous():
            return None
        small = self.small
        entry = small.find_scatter(op, tensor.dtype, tensor.shape, dim, counts)
        if entry.plain:
            return entry
        numel = tensor.numel()
        if (0 < numel <= GRAIN and tensor.nbytes <= self._one_step_bytes
                and not tensor.dtype.is_complex and tensor.shape[:dim].numel() == 1):
            return small.remember_scatter(tensor, dim, op, size_key, counts)
        return None

    @threaded(lambda self, flat, *_: flat.numel())
    def reduce_scatter(
        self, flat: torch.Tensor, counts: Sequence[int], op: ReduceOp, kind: str, size_key: int
    ) -> torch.Tensor:
        """Reduce 1-D ``flat`` across ranks; return this rank's region (``counts[me]`` elements).

        Region ``j`` of ``flat`` is ``counts[j]`` elements, regions back to back in rank order.
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        dtype = flat.dtype
        sig = signature(kind, dtype, op)
        mine_count = counts[me]
        out = host_alloc.empty(mine_count, dtype)
        if flat.nbytes <= self._one_step_bytes:  # one step: the slot holds all of the input
            parity = (sync.gen + 1) & 1  # sync.next_parity, without the property call
            mine, regions = self._one_step_scatter_views(
                parity, dtype, flat.numel(), sum(counts[:me]), mine_count)
            mine.copy_(flat)
            sync.step(kind, sig, size_key, True)
            if mine_count:
                reduce_views(regions, op, out=out)
            return out
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        align = max(1, _ALIGN_BYTES // flat.element_size())
        chunk = max(align, ws.slot_elems(dtype) // size // align * align)
        first = True
        for start in range(0, max(counts), chunk):
            lengths = [max(0, min(chunk, count - start)) for count in counts]
            slot_offsets = [0]
            for length in lengths:
                slot_offsets.append(slot_offsets[-1] + length)
            parity = sync.next_parity
            slot = ws.slot(parity, me, dtype)
            for region in range(size):
                length = lengths[region]
                if region != me and length:
                    src = offsets[region] + start
                    slot[slot_offsets[region] : slot_offsets[region] + length].copy_(
                        flat[src : src + length])
            sync.step(kind, sig, size_key, first)
            first = False
            length = lengths[me]
            if length:
                mine_at, src = slot_offsets[me], offsets[me] + start
                srcs = [
                    flat[src : src + length] if rank == me
                    else ws.slot(parity, rank, dtype)[mine_at : mine_at + length]
                    for rank in range(size)
                ]
                reduce_views(srcs, op, out=out[start : start + length])
        if first:  # nothing to move (all regions empty): still agree on the call
            sync.step(kind, sig, size_key, True)
        return out

    def _one_step_scatter_views(
        self, parity: int, dtype: torch.dtype, count: int, mine_at: int, mine_count: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """reduce_scatter in one step: my slot for the ``count`` input elements, and every
        rank's copy of my region (``mine_count`` elements from ``mine_at``). Cached."""
        key = (parity, dtype, count, mine_at, mine_count)
        views = self._scatter_views.get(key)
        if views is None:
            if len(self._scatter_views) >= _VIEW_CACHE_MAX:
                self._scatter_views.clear()
            ws = self.ws
            views = self._scatter_views[key] = (ws.slot(parity, self.me, dtype)[:count], [
                ws.slot(parity, rank, dtype)[mine_at : mine_at + mine_count]
                for rank in range(self.size)
            ])
        return views

    # ------------------------------------------------------------------ data movement
    def broadcast_by_address(
        self, tensor: torch.Tensor, src: int, signed: tuple[int, int]
    ) -> torch.Tensor:
        """:meth:`broadcast` of a tensor of at most :data:`BY_ADDRESS_MAX_BYTES` (and a
        slot) that is contiguous and has memory (a caller checked): one step, this
        thread's ``memmove`` in on ``src`` and out elsewhere, no torch dispatch.
        ``signed`` is the signature :meth:`broadcast` would take."""
        sync = self.sync
        parity = (sync.gen + 1) & 1  # sync.next_parity, without the property call
        me, nbytes = self.me, tensor.nbytes
        if me == src:
            _memmove(self._my_slot[parity], tensor.data_ptr(), nbytes)
        sync.step("broadcast", signed[0], signed[1], True, True)  # glibc stores and loads
        if me != src:
            _memmove(tensor.data_ptr(), self.ctx.slot_addresses[parity][src], nbytes)
            mark_written(tensor)  # torch did not see the write
        return tensor

    @threaded(lambda self, tensor, *_: tensor.numel())
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        signed: tuple[int, int] | None = None,
        name: str = "broadcast",
    ) -> torch.Tensor:
        """Fill contiguous ``tensor`` on every rank with local rank ``src``'s; returns ``tensor``.

        ``signed`` and ``name`` replace the step signature and the op's name
        (see :meth:`reduce`).
        """
        ws, sync, me = self.ws, self.sync, self.me
        dtype, count = tensor.dtype, tensor.numel()
        flat = tensor.view(-1)
        if signed is None:
            signed = (signature("broadcast", dtype, None, src), shape_key(tensor.shape))
        chunk = ws.slot_elems(dtype)
        first = True
        for start in range(0, count, chunk):
            end = min(count, start + chunk)
            parity = sync.next_parity
            if me == src:
                ws.slot(parity, me, dtype)[: end - start].copy_(flat[start:end])
            sync.step(name, signed[0], signed[1], first)
            first = False
            if me != src:
                flat[start:end].copy_(ws.slot(parity, src, dtype)[: end - start])
        if first:
            sync.step(name, signed[0], signed[1], True)
        return tensor
