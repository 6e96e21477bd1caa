"""Gathers of the shared-memory engine: all_gather(v) and gather.

Every rank copies its tensor into its slot of the next parity; after the step
(:class:`~device_comms.cpu_shm.sync.StepSync`) the readers copy every rank's slot
out: ``torch.cat`` straight from the slots when every piece fits a slot, else
blocks of whole rows (or, for rows wider than a slot, a row in column pieces)
written into the output's final layout, one step per block. A root that
gathers reads its own part from its input, so it writes nothing. The slot
double buffer makes the next op's writes safe (see :mod:`device_comms.cpu_shm.sync`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from device_comms.cpu_shm.engine_threads import KernelThreads, threaded

if TYPE_CHECKING:
    from device_comms.cpu_shm.sync import StepSync
    from device_comms.cpu_shm.workspace import ShmWorkspace

__all__ = ["ShmGatherOps"]


class _GatherStep(NamedTuple):
    """What every piece of one gather_rows call shares."""

    x2: torch.Tensor
    out2: torch.Tensor | None
    widths: Sequence[int]
    offs: list[int]
    writes: bool
    kind: str
    sig: Any
    size_key: int


class ShmGatherOps:
    """The gathers of :class:`~device_comms.cpu_shm.engine.ShmEngine` (a mixin: the
    engine provides the workspace, the synchroniser and the helpers below)."""

    ws: ShmWorkspace
    sync: StepSync
    size: int
    me: int

    @property
    def kernel_threads(self) -> KernelThreads:  # provided by the engine
        raise NotImplementedError

    def _shaped(self, parity: int, t: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def _sig(self, kind: str, dtype: torch.dtype, op: Any = None, root: int = 0) -> int:
        raise NotImplementedError

    @threaded(lambda self, t, *_: t.numel() * self.size)
    def all_gather_cat(
        self,
        t: torch.Tensor,
        dim: int,
        kind: str = "all_gather",
        dst: int | None = None,
        size_key: int | None = None,
    ) -> torch.Tensor | None:
        """Every rank's ``t`` (same shape, fits a slot) concatenated along ``dim``.

        Every rank gets it when ``dst`` is None, else only local rank ``dst``.
        ``size_key`` (default: the element count) must agree on every rank.
        """
        views = self._shaped(self.sync.next_parity, t)
        views[self.me].copy_(t)
        sig = self._sig(kind, t.dtype, None, 0 if dst is None else dst)
        self.sync.step(kind, sig, t.numel() if size_key is None else size_key, True)
        if dst is None or dst == self.me:
            return torch.cat(views, dim)
        return None

    @threaded(lambda self, t, shapes, *_: sum(math.prod(s) for s in shapes))
    def gatherv_cat(
        self, t: torch.Tensor, shapes: Sequence[torch.Size], dim: int, size_key: int
    ) -> torch.Tensor:
        """All-gather of per-rank shapes ``shapes`` (each fits a slot), concatenated along ``dim``."""
        p, dt = self.sync.next_parity, t.dtype
        views = [
            s[: math.prod(shape)].view(shape)
            for s, shape in zip(self.ws.slots(p, dt), shapes)
        ]
        views[self.me].copy_(t)
        self.sync.step("all_gatherv", self._sig("all_gatherv", dt), size_key, True)
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
        ws, sync, me = self.ws, self.sync, self.me
        dt = x2.dtype
        sig = self._sig(kind, dt, None, 0 if dst is None else dst)
        rows_n = x2.shape[0]
        offs = [0]
        for w in widths:
            offs.append(offs[-1] + w)
        writes = dst is None or dst != me  # a root reads its own part from x2
        chunk = ws.slot_elems(dt)
        wmax = max(widths) if widths else 0
        if wmax == 0 or rows_n == 0:
            sync.step(kind, sig, size_key, True)  # nothing to move; still agree on the call
            return
        if wmax <= chunk:  # blocks of whole rows
            per = max(1, chunk // wmax)
            pieces = [(i, min(per, rows_n - i), None) for i in range(0, rows_n, per)]
        else:  # each row in column pieces
            pieces = [(i, 1, a) for i in range(rows_n) for a in range(0, wmax, chunk)]
        step = _GatherStep(x2, out2, widths, offs, writes, kind, sig, size_key)
        for n, (i, nrows, a) in enumerate(pieces):
            if a is None:
                self._gather_row_block(step, i, nrows, first=n == 0)
            else:
                self._gather_column_piece(step, i, a, chunk, first=n == 0)

    def _gather_row_block(self, step: _GatherStep, i: int, nrows: int, first: bool) -> None:
        """Rows ``i : i + nrows`` of every rank's piece through one round of slots."""
        ws, me, dt, widths = self.ws, self.me, step.x2.dtype, step.widths
        p = self.sync.next_parity
        if step.writes and widths[me]:
            ws.slot(p, me, dt)[: nrows * widths[me]].copy_(step.x2[i : i + nrows].reshape(-1))
        self.sync.step(step.kind, step.sig, step.size_key, first)
        if step.out2 is None:
            return
        for r in range(self.size):
            w = widths[r]
            if w:
                src = (step.x2[i : i + nrows] if r == me
                       else ws.slot(p, r, dt)[: nrows * w].view(nrows, w))
                step.out2[i : i + nrows, step.offs[r] : step.offs[r] + w].copy_(src)

    def _gather_column_piece(self, step: _GatherStep, i: int, a: int, chunk: int,
                             first: bool) -> None:
        """Columns ``a : a + chunk`` of row ``i`` of every rank's piece (rows wider than a slot)."""
        ws, me, dt, widths = self.ws, self.me, step.x2.dtype, step.widths
        p = self.sync.next_parity
        ln = max(0, min(chunk, widths[me] - a))
        if step.writes and ln:
            ws.slot(p, me, dt)[:ln].copy_(step.x2[i, a : a + ln])
        self.sync.step(step.kind, step.sig, step.size_key, first)
        if step.out2 is None:
            return
        for r in range(self.size):
            lr = max(0, min(chunk, widths[r] - a))
            if lr:
                src = step.x2[i, a : a + lr] if r == me else ws.slot(p, r, dt)[:lr]
                step.out2[i, step.offs[r] + a : step.offs[r] + a + lr].copy_(src)
