"""The one-step all_reduce of the shared-memory engine: the latency-bound case.

An all_reduce of at most a slot and :data:`~device_comms.cpu_shm.engine_threads.GRAIN`
elements is one step of :class:`~device_comms.cpu_shm.sync.StepSync`: every rank
copies its input into its slot, publishes, and reduces all slots in rank order
(with two ranks from :data:`~device_comms.cpu_shm.pair.PAIR_SMALL_MIN_BYTES` on,
into the peer's slot: :meth:`~device_comms.cpu_shm.pair.ShmPairOps._pair_small`).
At 1 KiB the collective itself is a few microseconds, so what each call costs
in Python decides its speed, and the path is kept to a few calls:

* :class:`SmallAllReduce`, the engine's entry for the last (op, dtype, shape)
  (``ShmEngine.last_small``, matched by identity: hashing a ``ReduceOp`` runs
  Python code), holds the step's signature, the slot views and the reduction;
  a caller that checked a tensor against it may call
  :meth:`ShmSmallOps.small_all_reduce` directly.
* The input goes into the slot with ``ctypes.memmove`` the first time an
  address is seen and, from its second call on, through a numpy view of that
  address (a third of the cost; an in-place result is written through it too):
  :meth:`SmallAllReduce.held_at` says why a view that owns nothing is safe.
* The step skips the ordering fences a TSO machine does not need
  (``StepSync.step(plain_stores=True)``; the argument is in
  :mod:`device_comms.cpu_shm.sync`).
* float32/float64/int32/int64 sums are ``numpy.add`` (bitwise the same sum,
  ~0.25 us less dispatch than ``torch.add``), wrapped with ``torch.from_numpy``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from device_comms.cpu_shm.host_arrays import array_of, bytes_at, mark_written
from device_comms.fixed_reduce import NUMPY_ERRORS, NUMPY_SUM, binary_fn, quiet_numpy_sum
from device_comms.reduce_op import ReduceOp

if TYPE_CHECKING:
    from device_comms.cpu_shm.engine import ShmEngine
    from device_comms.cpu_shm.sync import StepSync

__all__ = ["SmallAllReduce", "ShmSmallOps", "NotServed"]

_HELD_MAX = 16  # caller addresses with a byte view, per entry
# No mapping starts in the first page: an address below it is data_ptr() of a tensor
# without memory (autograd's zeros: 0; a view of a storage resized to 0: its offset).
_NULL_PAGE = 4096
_memmove = ctypes.memmove
_from_numpy = torch.from_numpy


class NotServed(Exception):
    """:meth:`ShmSmallOps.small_all_reduce` cannot serve this call as it stands (raised
    before any step); the caller takes its checked path, which says why."""


class SmallAllReduce:
    """What a one-step all_reduce of one (op, dtype, shape) needs, kept for the next call."""

    __slots__ = ("op", "dtype", "shape", "nbytes", "sig", "size_key", "fn", "avg", "views",
                 "numpy", "pair", "scratch", "scratch_addr", "plain", "more", "mine", "held",
                 "sighted")

    def __init__(self, eng: ShmEngine | None, t: torch.Tensor | None, op: ReduceOp | None) -> None:
        self.op, self.dtype, self.shape, self.nbytes = op, None, None, 0
        #: Real dtype (no lazy conjugation to resolve): a caller that checked
        #: a tensor's dtype, shape, device, layout, strides and grad against
        #: this entry may call :meth:`ShmSmallOps.small_all_reduce` directly.
        self.plain = False
        self.sig, self.size_key, self.fn, self.avg = 0, 0, torch.add, False
        self.views: tuple[list[Any], ...] = ([], [])
        self.numpy = self.pair = False
        self.scratch: Any = None
        self.scratch_addr = 0
        #: More than two ranks: the slots past the first two, by parity.
        self.more: tuple[list[Any], ...] = ([], [])
        #: This rank's slot of each parity as ``nbytes`` numpy bytes.
        self.mine: tuple[Any, ...] = ()
        #: Caller memory by address: ``nbytes`` numpy bytes and, for numpy sums,
        #: the same bytes as a typed array of the entry's shape (see :meth:`held_at`).
        self.held: dict[int, tuple[Any, Any]] = {}
        self.sighted: set[int] = set()
        if eng is None or t is None or op is None:
            return  # the empty entry no call matches
        self.pair = eng.size == 2 and t.nbytes >= eng.pair_small_min_bytes
        self.dtype, self.shape, self.nbytes = t.dtype, t.shape, t.nbytes
        self.plain = not t.dtype.is_complex
        self.sig = eng._sig("all_reduce", t.dtype, op)
        self.size_key = eng.shape_key(t.shape)
        self.fn = binary_fn(op, t.dtype)
        self.avg = op is ReduceOp.AVG
        self.views = (eng._shaped(0, t), eng._shaped(1, t))
        self.mine = tuple(eng.ws.slot(p, eng.me, torch.uint8)[: t.nbytes].numpy() for p in (0, 1))
        if op is ReduceOp.SUM and t.dtype in NUMPY_SUM and t.dim() > 0:  # 0-d: ufuncs give scalars
            self.numpy = True
            self.fn = np.add
            self.views = tuple([v.numpy() for v in vs] for vs in self.views)
            if not self.pair:  # out= reduces here, then one copy (see ShmSmallOps._small_into)
                self.scratch = np.empty(tuple(t.shape), dtype=self.views[0][0].dtype)
                self.scratch_addr = self.scratch.ctypes.data
        self.more = (self.views[0][2:], self.views[1][2:])

    def held_at(self, addr: int) -> tuple[Any, Any] | None:
        """Numpy views of the ``nbytes`` bytes at ``addr``, from the second call there on.

        Only for the memory of a live contiguous tensor of this entry's shape and
        dtype that starts at ``addr``: those are exactly the bytes the views
        cover, whichever allocation they belong to now, and they are mapped
        while that tensor lives. The views own nothing (a freed tensor's
        address may come back, as allocators reuse blocks, and then they serve
        the new tensor). A copy through them costs a third of a
        ``ctypes.memmove`` call; making them costs about 1.5 calls, so an address
        gets views only when it comes back.
        """
        if not addr or not self.nbytes:
            return None
        if addr not in self.sighted:
            if len(self.sighted) >= _HELD_MAX:
                self.sighted.clear()
            self.sighted.add(addr)
            return None
        raw = bytes_at(addr, self.nbytes)
        typed = raw.view(self.views[0][0].dtype).reshape(tuple(self.shape)) if self.numpy else None
        if len(self.held) >= _HELD_MAX:
            self.held.clear()
        v = self.held[addr] = (raw, typed)
        return v


class ShmSmallOps:
    """The one-step all_reduce of :class:`~device_comms.cpu_shm.engine.ShmEngine` (a
    mixin: the engine provides the synchroniser and the state below)."""

    sync: StepSync
    size: int
    me: int
    _my_addr: tuple[int, int]
    _pair_small: Callable[..., torch.Tensor]  # ShmPairOps's

    def small_all_reduce(
        self, c: SmallAllReduce, t: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The one-step all_reduce of ``t``, which matches entry ``c`` (op, dtype, shape).

        ``c`` must be the engine's ``last_small`` and match ``t``; ``t`` is contiguous.
        """
        sync = self.sync
        p = (sync.gen + 1) & 1
        src = t.data_ptr()
        held = c.held.get(src)
        if held is not None:
            c.mine[p][...] = held[0]
        else:
            if src < _NULL_PAGE and c.nbytes:  # storage-less zeros or a freed storage
                raise NotServed("input_ has no memory")  # the caller's checks say which
            _memmove(self._my_addr[p], src, c.nbytes)
            held = c.held_at(src)
        sync.step("all_reduce", c.sig, c.size_key, True, True)  # glibc / numpy stores
        views = c.views[p]
        if out is not None:  # the operands are slot views: out may be t
            return self._small_into(t, views, c.more[p], c, out, held)
        if c.pair:
            return self._pair_small(t, views[1 - self.me], c, held)
        fn = c.fn
        try:
            acc = fn(views[0], views[1])
            for v in c.more[p]:
                fn(acc, v, out=acc)
        except NUMPY_ERRORS:  # an overflow report turned into an error: redo it quietly
            if not c.numpy:
                raise
            acc = quiet_numpy_sum(views)
        if c.numpy:
            return _from_numpy(acc)
        if c.avg:
            acc.div_(self.size)
        return acc

    def _small_into(
        self,
        t: torch.Tensor,
        views: list[Any],
        more: list[Any],
        c: SmallAllReduce,
        out: torch.Tensor,
        held_t: tuple[Any, Any] | None,
    ) -> torch.Tensor:
        """The one-step all_reduce's reduction straight into ``out`` (which may be ``t``).

        Operands are the slot ``views`` (``more``: those past the first two),
        except with two ranks from :data:`PAIR_SMALL_MIN_BYTES` on, where the
        peer may be reducing into this rank's slot (:meth:`_pair_small`) and
        the rank's own operand is ``t``: reading and writing the same element
        in one element-wise op is safe. ``held_t``: the entry's views of ``t``'s
        bytes (:meth:`SmallAllReduce.held_at`), if it has them.
        """
        fn = c.fn
        held = held_t  # views of out's bytes
        if out is not t:
            addr = out.data_ptr()
            held = c.held.get(addr) or c.held_at(addr)
        if c.scratch is not None:
            # Into out's own view if the entry has one, else a private array and one
            # memmove into out: cheaper than making an array view of out.
            acc = c.scratch if held is None else held[1]
            try:
                fn(views[0], views[1], out=acc)
                for v in more:
                    fn(acc, v, out=acc)
            except NUMPY_ERRORS:  # an overflow report turned into an error: redo it quietly
                quiet_numpy_sum(views, acc)
            if held is None:
                _memmove(out.data_ptr(), c.scratch_addr, out.nbytes)
            mark_written(out)
            return out
        acc = out
        if c.numpy:
            acc = held[1] if held is not None else array_of(out)
        if c.pair:
            own: Any = t
            if c.numpy:
                own = held_t[1] if held_t is not None else array_of(t)
            views = [own, views[1]] if self.me == 0 else [views[0], own]
        try:  # numpy here only with two ranks (c.pair): this is its one call
            fn(views[0], views[1], out=acc)
        except NUMPY_ERRORS:  # reported after acc was written: the IEEE result stands
            pass
        for v in more:
            fn(acc, v, out=acc)
        if c.avg:
            out.div_(self.size)
        mark_written(out)
        return out
