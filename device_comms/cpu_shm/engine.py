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
  :data:`~device_comms.cpu_shm.pair.PAIR_SMALL_MIN_BYTES`, and beyond one step a
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
  the slots; rank ``j`` reduces it (one step per piece).
* **all_gather(v)/gather**: every rank copies its tensor in; readers copy all
  slots out: ``torch.cat`` straight from the slots when it fits, else blocks
  of rows written into the output's final layout
  (:meth:`~device_comms.cpu_shm.gather.ShmGatherOps.gather_rows`).
* **broadcast/reduce**: the root writes / only the root reduces.
* **all_to_allv**: each rank's rows for the others stream through its slot,
  every receiver copies its part straight into place: one copy in, one out
  (:class:`~device_comms.cpu_shm.alltoallv.ShmAllToAllvOps`).

Threads: every op over more than :data:`~device_comms.cpu_shm.engine_threads.GRAIN`
elements runs its torch kernels under :attr:`ShmEngine.kernel_threads`, with
:attr:`ShmEngine.threads` intra-op threads (the node's CPUs divided among its
local ranks, whatever torch's own setting; :mod:`device_comms.cpu_shm.engine_threads`
says why: torch's default thread count made every rank's OpenMP team spin on
the CPUs its peers needed, a 30-50x slowdown at 1-16 MiB, and one thread per
rank left a many-core node's memory bandwidth idle). Smaller kernels never
start a parallel region.

The one-step all_reduce (at most a slot and :data:`GRAIN` elements, the
latency-bound case) has its own module, :mod:`device_comms.cpu_shm.small`.

Results of 32 MiB and more are allocated with :func:`device_comms.cpu_shm.host_alloc.empty`
(huge pages; a fresh 64 MiB ``torch.empty`` costs more page faults than the
collective itself on a VM).

Each op's first step carries a signature (op kind, dtype, reduce op, root,
and a size key covering the shape and layout arguments; see
:func:`~device_comms.signatures.step_signature.shape_key`) that every rank compares, so
mismatched calls raise
:class:`~device_comms.errors.CollectiveMismatch` everywhere instead of
returning garbage. Results are always new tensors (never views of the
workspace), except :meth:`ShmEngine.broadcast`, which fills its argument. A
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
from typing import Any

import torch

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.alltoallv import ShmAllToAllvOps
from device_comms.cpu_shm.engine_threads import GRAIN, KernelThreads, engine_threads, threaded
from device_comms.cpu_shm.gather import ShmGatherOps
from device_comms.cpu_shm.host_arrays import mark_written
from device_comms.cpu_shm.pair import DEFAULT_PAIR_PIECE_BYTES, PAIR_SMALL_MIN_BYTES, ShmPairOps
from device_comms.cpu_shm.small import ShmSmallOps, SmallAllReduce
from device_comms.cpu_shm.sync import StepSync
from device_comms.cpu_shm.workspace import ShmWorkspace
from device_comms.fixed_reduce import reduce_views
from device_comms.reduce_op import ReduceOp
from device_comms.signatures.step_signature import shape_key, signature

__all__ = ["ShmEngine", "DEFAULT_ONESHOT_BYTES"]

# Largest all_reduce done in one shot; above it, reduce-scatter + all-gather.
# Measured on the 2-vCPU development VM (2 and 4 ranks, idle and loaded): one
# shot wins up to 2 MiB (one synchronisation instead of two), the two-phase
# scheme from 4 MiB (it moves fewer bytes per rank and shares the reduction).
DEFAULT_ONESHOT_BYTES = 2 << 20
_ALIGN_BYTES = 64  # region boundaries on cache lines
_VIEW_CACHE_MAX = 512
_memmove = ctypes.memmove


class ShmEngine(ShmPairOps, ShmSmallOps, ShmGatherOps, ShmAllToAllvOps):
    """Shared-memory collectives for the local ranks of a workspace.

    Args:
        ws: The mapped workspace.
        sync: The step synchroniser over ``ws``.
        oneshot_bytes: Largest all_reduce/reduce done in one shot.
        threads: Most intra-op threads the engine's kernels use; None for
            :func:`~device_comms.cpu_shm.engine_threads.engine_threads` (the node's
            CPUs divided among its local ranks).

    Attributes:
        size: Number of local ranks.
        me: This rank's local index.
        threads: The engine's thread limit.
    """

    def __init__(
        self,
        ws: ShmWorkspace,
        sync: StepSync,
        oneshot_bytes: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.ws = ws
        self.sync = sync
        self.size = ws.local_size
        self.me = ws.local_rank
        if oneshot_bytes is None:
            oneshot_bytes = DEFAULT_ONESHOT_BYTES
        #: all_reduce/reduce up to this many bytes run one shot (in slot-sized
        #: pieces above a slot); larger ones reduce-scatter + all-gather.
        self.oneshot_bytes = oneshot_bytes
        self.threads = engine_threads(sync.pids, self.me, threads)
        self._cap = KernelThreads(self.threads)
        #: Two ranks: all_reduce above the one-step path goes through
        #: :meth:`_pair_all_reduce` in pieces of this many bytes (0: off).
        self.pair_piece_bytes = DEFAULT_PAIR_PIECE_BYTES
        #: Two ranks: one-step all_reduces of at least this many bytes reduce into
        #: the peer's slot too (:meth:`_pair_small`); smaller ones read both slots.
        self.pair_small_min_bytes = PAIR_SMALL_MIN_BYTES
        self._single = min(ws.slot_bytes, oneshot_bytes)  # one step, cached views
        self._my_addr = (ws.slot_address(0, self.me), ws.slot_address(1, self.me))
        self._slot_addr = [[ws.slot_address(p, r) for r in range(self.size)] for p in (0, 1)]
        self._plans: dict[tuple[int, int, int], tuple[int, list[tuple[Any, Any, int, int]]]] = {}
        self._slot_views: dict[tuple[torch.dtype, bool], list[list[Any]]] = {}
        self._views: dict[tuple[int, torch.dtype, torch.Size], list[torch.Tensor]] = {}
        self._sigs: dict[tuple[str, torch.dtype, ReduceOp | None, int], int] = {}
        self._shape_keys: dict[torch.Size, int] = {}
        #: The last one-step all_reduce's entry (its op, dtype, shape and slot views).
        self.last_small = SmallAllReduce(None, None, None)

    @property
    def kernel_threads(self) -> KernelThreads:
        """Context manager limiting torch's intra-op threads to :attr:`threads` inside."""
        return self._cap

    def close(self) -> None:
        """Mark this rank closed for its peers and unmap. Idempotent."""
        self._views.clear()
        self._slot_views.clear()
        self.last_small = SmallAllReduce(None, None, None)  # its views map the workspace
        self.sync.close()
        self.ws.close()

    # ------------------------------------------------------------------ helpers
    def _sig(self, kind: str, dtype: torch.dtype, op: ReduceOp | None = None, root: int = 0) -> int:
        key = (kind, dtype, op, root)
        s = self._sigs.get(key)
        if s is None:
            s = self._sigs[key] = signature(kind, dtype, op, root)
        return s

    def shape_key(self, shape: torch.Size) -> int:
        """The size key of a call on a tensor of ``shape`` (cached; same on every rank)."""
        k = self._shape_keys.get(shape)
        if k is None:
            if len(self._shape_keys) >= _VIEW_CACHE_MAX:
                self._shape_keys.clear()
            k = self._shape_keys[shape] = shape_key(shape)
        return k

    def _shaped(self, parity: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot as a tensor shaped like ``t`` (cached)."""
        key = (parity, t.dtype, t.shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _VIEW_CACHE_MAX:
                self._views.clear()
            n = t.numel()
            v = [s[:n].view(t.shape) for s in self.ws.slots(parity, t.dtype)]
            self._views[key] = v
        return v

    def _bounds(self, count: int, itemsize: int) -> list[int]:
        """Split ``count`` elements into ``size`` cache-line-aligned regions."""
        align = max(1, _ALIGN_BYTES // itemsize)
        step = math.ceil(count / self.size / align) * align
        return [min(count, j * step) for j in range(self.size + 1)]

    # ------------------------------------------------------------------ reductions
    def all_reduce(
        self, t: torch.Tensor, op: ReduceOp, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All-reduce contiguous ``t``, identical on every rank.

        Returns ``out`` (contiguous, ``t``'s shape and dtype; ``t`` itself or
        disjoint from it) when given, else a new tensor.
        """
        if t.nbytes <= self._single and t.numel() <= GRAIN:  # one step; torch runs it serially
            c = self.last_small
            # Identity checks, not a dict keyed by the enum: ReduceOp.__hash__ runs in Python.
            if op is not c.op or t.dtype is not c.dtype or t.shape != c.shape:
                c = self.last_small = SmallAllReduce(self, t, op)
            return self.small_all_reduce(c, t, out)
        with self._cap:
            res = self._large_all_reduce(t, op, out)
        if out is None:
            return res
        mark_written(out)
        return out

    def _large_all_reduce(
        self, t: torch.Tensor, op: ReduceOp, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The all_reduce beyond one small step (see the module docstring for the schemes)."""
        sync = self.sync
        sig = (self._sig("all_reduce", t.dtype, op), self.shape_key(t.shape))
        if self.size == 2 and self.pair_piece_bytes:
            return self._pair_all_reduce(t, op, sig, out)
        if t.nbytes <= self._single:
            p = sync.next_parity
            views = self._shaped(p, t)
            _memmove(self._my_addr[p], t.data_ptr(), t.nbytes)
            sync.step("all_reduce", sig[0], sig[1], True)
            if out is not None:  # own operand from the slot: out may be t
                return reduce_views(views, op, out=out)
            return reduce_views([t if r == self.me else v for r, v in enumerate(views)], op)
        if t.nbytes <= self.oneshot_bytes:
            return self._oneshot_pieces(t, op, "all_reduce", sig, True, out)  # type: ignore[return-value]
        return self._two_phase(t, op, "all_reduce", sig, True, out)  # type: ignore[return-value]

    @threaded(lambda self, t, *_: t.numel())
    def reduce(
        self,
        t: torch.Tensor,
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
            signed = (self._sig("reduce", t.dtype, op, dst), self.shape_key(t.shape))
        if t.nbytes <= self._single:
            views = self._shaped(sync.next_parity, t)
            views[self.me].copy_(t)
            sync.step(name, signed[0], signed[1], True)
            return reduce_views(views, op) if self.me == dst else None
        if t.nbytes <= self.oneshot_bytes:
            return self._oneshot_pieces(t, op, name, signed, self.me == dst)
        return self._two_phase(t, op, name, signed, self.me == dst)

    def _oneshot_pieces(
        self,
        t: torch.Tensor,
        op: ReduceOp,
        name: str,
        sig: tuple[int, int],
        want: bool,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One shot per slot-sized piece: everyone writes, readers reduce all slots.

        The result goes into ``into`` when given (it may be ``t``: then the
        rank's own operand is read from its slot).
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        flat, n, dt = t.view(-1), t.numel(), t.dtype
        out = None if not want else into if into is not None else host_alloc.empty(n, dt)
        own = flat if into is None else None
        chunk = ws.slot_elems(dt)
        first = True
        for a in range(0, n, chunk):
            ln = min(chunk, n - a)
            p = sync.next_parity
            ws.slot(p, me, dt)[:ln].copy_(flat[a : a + ln])
            sync.step(name, sig[0], sig[1], first)
            first = False
            if out is not None:
                srcs = [
                    own[a : a + ln] if r == me and own is not None else ws.slot(p, r, dt)[:ln]
                    for r in range(size)
                ]
                reduce_views(srcs, op, out=out.view(-1)[a : a + ln])
        return out.view(t.shape) if out is not None else None

    def _two_phase(
        self,
        t: torch.Tensor,
        op: ReduceOp,
        name: str,
        sig: tuple[int, int],
        want: bool,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Reduce-scatter + all-gather per slot-sized piece, into ``into`` when given.

        ``into`` may be ``t``: a piece's input is read before the second step,
        its output written after it.
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        flat, n, dt = t.view(-1), t.numel(), t.dtype
        out = None if not want else into.view(-1) if into is not None else host_alloc.empty(n, dt)
        chunk = ws.slot_elems(dt)
        first = True
        for a in range(0, n, chunk):
            b = self._bounds(min(chunk, n - a), t.element_size())
            p = sync.next_parity
            mine = ws.slot(p, me, dt)
            for j in range(size):
                if j != me and b[j + 1] > b[j]:
                    mine[b[j] : b[j + 1]].copy_(flat[a + b[j] : a + b[j + 1]])
            sync.step(name, sig[0], sig[1], first)
            first = False
            lo, hi = b[me], b[me + 1]
            q = sync.next_parity
            if hi > lo:
                srcs = [
                    flat[a + lo : a + hi] if r == me else ws.slot(p, r, dt)[lo:hi]
                    for r in range(size)
                ]
                reduce_views(srcs, op, out=ws.slot(q, me, dt)[lo:hi])
            sync.step(name)
            if out is not None:
                for j in range(size):
                    if b[j + 1] > b[j]:
                        out[a + b[j] : a + b[j + 1]].copy_(ws.slot(q, j, dt)[b[j] : b[j + 1]])
        return out.view(t.shape) if out is not None else None

    @threaded(lambda self, x, *_: x.numel())
    def reduce_scatter(
        self, x: torch.Tensor, counts: Sequence[int], op: ReduceOp, kind: str, size_key: int
    ) -> torch.Tensor:
        """Reduce flat ``x`` across ranks; return this rank's region (``counts[me]`` elements).

        Region ``j`` of ``x`` is ``counts[j]`` elements, regions back to back in rank order.
        """
        ws, sync, me, size = self.ws, self.sync, self.me, self.size
        dt = x.dtype
        sig = self._sig(kind, dt, op)
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + c)
        mine_n = counts[me]
        out = host_alloc.empty(mine_n, dt)
        if x.nbytes <= self._single:  # one step: the slot holds all of x
            p = sync.next_parity
            key = ("rs", p, dt, x.numel(), offs[me], mine_n)
            views = self._views.get(key)
            if views is None:  # my slot for x, then every rank's copy of my region
                if len(self._views) >= _VIEW_CACHE_MAX:
                    self._views.clear()
                lo = offs[me]
                views = self._views[key] = [ws.slot(p, me, dt)[: x.numel()]] + [
                    ws.slot(p, r, dt)[lo : lo + mine_n] for r in range(size)
                ]
            views[0].copy_(x)
            sync.step(kind, sig, size_key, True)
            if mine_n:
                reduce_views(views[1:], op, out=out)
            return out
        align = max(1, _ALIGN_BYTES // x.element_size())
        chunk = max(align, ws.slot_elems(dt) // size // align * align)
        first = True
        for a in range(0, max(counts), chunk):
            lens = [max(0, min(chunk, c - a)) for c in counts]
            pos = [0]
            for ln in lens:
                pos.append(pos[-1] + ln)
            p = sync.next_parity
            slot = ws.slot(p, me, dt)
            for j in range(size):
                if j != me and lens[j]:
                    slot[pos[j] : pos[j + 1]].copy_(x[offs[j] + a : offs[j] + a + lens[j]])
            sync.step(kind, sig, size_key, first)
            first = False
            ln = lens[me]
            if ln:
                srcs = [
                    x[offs[me] + a : offs[me] + a + ln] if r == me
                    else ws.slot(p, r, dt)[pos[me] : pos[me] + ln]
                    for r in range(size)
                ]
                reduce_views(srcs, op, out=out[a : a + ln])
        if first:  # nothing to move (all regions empty): still agree on the call
            sync.step(kind, sig, size_key, True)
        return out

    # ------------------------------------------------------------------ data movement
    @threaded(lambda self, t, *_: t.numel())
    def broadcast(
        self,
        t: torch.Tensor,
        src: int,
        signed: tuple[int, int] | None = None,
        name: str = "broadcast",
    ) -> torch.Tensor:
        """Fill contiguous ``t`` on every rank with local rank ``src``'s ``t``; returns ``t``.

        ``signed`` and ``name`` replace the step signature and the op's name
        (see :meth:`reduce`).
        """
        ws, sync, me = self.ws, self.sync, self.me
        dt, n = t.dtype, t.numel()
        flat = t.view(-1)
        if signed is None:
            signed = (self._sig("broadcast", dt, None, src), self.shape_key(t.shape))
        chunk = ws.slot_elems(dt)
        first = True
        for a in range(0, n, chunk):
            ln = min(chunk, n - a)
            p = sync.next_parity
            if me == src:
                ws.slot(p, me, dt)[:ln].copy_(flat[a : a + ln])
            sync.step(name, signed[0], signed[1], first)
            first = False
            if me != src:
                flat[a : a + ln].copy_(ws.slot(p, src, dt)[:ln])
        if first:
            sync.step(name, signed[0], signed[1], True)
        return t
