"""A communicator that carries every op over a ``torch.distributed`` group.

This is the portable path: gloo for CPU tensors (and NCCL for CUDA ones when
given a NCCL ``device_group``). Faster transports subclass it and override the
ops they accelerate, falling back to these implementations for the rest.

Uneven ops (``all_gatherv``, ``reduce_scatterv``) pad every rank's piece to the
largest and slice afterwards, which works on any backend. Pure data-movement
ops send every type outside a small native set as ``uint8`` byte views, so they
work even where a backend lacks a kernel (``bfloat16``, ``uint16``, ``float8``...).

Rejected calls (a rank whose own arguments fail validation while its peers'
calls are valid; see :meth:`DeviceCommunicator._reject`):

* ``all_gatherv``: every piece travels behind a header with its real size; a
  rank whose input does not match its own ``sizes`` entry still joins the
  all-gather with size -1 and a dummy payload (this needs a tensor of the right
  dtype and inner shape, a valid ``dim`` and a valid ``sizes`` list; for other
  rejections its peers wait for the timeout);
* ``broadcast`` and ``reduce_scatterv``: every call first all-gathers one
  int64 per rank over ``cpu_group`` (its byte count, -1 when it rejected), so
  a rejection *or* a size disagreement raises on every rank instead of
  hanging or aborting inside gloo. This costs one small round trip per call;
* then, if some but not all ranks rejected, the lowest rejecting rank
  broadcasts its reason (on this error path only) and the valid ranks raise
  :class:`~device_comms.errors.PeerRejectedError` naming it; every rank has
  run the same collectives, so the group stays usable;
* other ops do not announce a rejection (their peers wait for the timeout);
* none of this runs for GPU tensors (no header exchange: it would synchronise
  the stream and break CUDA graph capture), which keep torch.distributed's
  behaviour.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from device_comms.base import DeviceCommunicator
from device_comms.errors import CollectiveMismatch, DecodeError, PeerRejectedError
from shm_broadcast.group_adapter import object_group
from device_comms.reduce_op import ReduceOp

__all__ = ["TorchDistributedCommunicator", "wire_view"]

# torch >= 2.12 names these *_single; older releases only have *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Types every backend moves natively; all others (bfloat16, float16, bool,
# int16, uint16/32/64, float8, complex...) move as raw bytes.
_NATIVE = frozenset({torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64})
# Integer types gloo (and NCCL) cannot reduce: reduced in a wider type and cast
# back. Two's complement arithmetic is modular, so wrap-around and bitwise ops
# give exactly the narrow type's results.
_REDUCE_AS = {torch.int16: torch.int32}
# Bytes in front of every rank's piece in all_gatherv: its size along ``dim``
# (int64; -1 when its arguments were rejected), padded so any dtype stays aligned.
_GATHERV_HDR = 16


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """A same-memory view of contiguous ``t`` in a dtype every backend can move.

    Types outside a small native set travel as flat ``uint8`` bytes; callers
    only use this for pure data movement on contiguous tensors.
    """
    if t.dtype not in _NATIVE:
        return t.reshape(-1).view(torch.uint8)
    return t


class TorchDistributedCommunicator(DeviceCommunicator):
    """Every op through ``torch.distributed`` on ``device_group`` (any device type)."""

    name = "torch"
    device_types = frozenset({"cpu", "cuda"})
    priority = 0

    def _g(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    @property
    def _checks_calls(self) -> bool:
        """Whether calls exchange size headers (rejections, size mismatches).

        Only for CPU tensors: on a GPU the header check would synchronise the
        stream every call and could not run inside CUDA graph capture, so GPU
        calls keep torch.distributed's behaviour.
        """
        return self.device.type == "cpu"

    # --- reductions -----------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        wide = _REDUCE_AS.get(t.dtype)
        out = t.to(wide) if wide is not None else t.clone()
        dist.all_reduce(out, op=op.to_torch(), group=self.device_group)
        if op is ReduceOp.AVG:
            out.div_(self.world_size)
        return out.to(t.dtype) if wide is not None else out

    def _reduce(self, t: torch.Tensor, dst: int, op: ReduceOp) -> torch.Tensor | None:
        wide = _REDUCE_AS.get(t.dtype)
        out = t.to(wide) if wide is not None else t.clone()
        dist.reduce(out, dst=self._g(dst), op=op.to_torch(), group=self.device_group)
        if self.rank_in_group != dst:
            return None
        if op is ReduceOp.AVG:
            out.div_(self.world_size)
        return out.to(t.dtype) if wide is not None else out

    def _reduce_scatter(self, t: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        wide = _REDUCE_AS.get(t.dtype)
        if wide is not None:
            return self._reduce_scatter(t.to(wide), dim, op).to(t.dtype)
        n = self.world_size
        x = t.movedim(dim, 0).contiguous()
        out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=t.dtype, device=t.device)
        _reduce_scatter_flat(out.view(-1), x.view(-1), op=op.to_torch(), group=self.device_group)
        if op is ReduceOp.AVG:
            out.div_(n)
        return out.movedim(0, dim).contiguous()

    def _reduce_scatterv(
        self, t: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        wide = _REDUCE_AS.get(t.dtype)
        if wide is not None:
            return self._reduce_scatterv(t.to(wide), dim, sizes, op).to(t.dtype)
        n, m = self.world_size, max(sizes)
        x = t.movedim(dim, 0)
        padded = torch.zeros((n * m,) + x.shape[1:], dtype=t.dtype, device=t.device)
        off = 0
        for i, s in enumerate(sizes):
            padded[i * m : i * m + s] = x[off : off + s]
            off += s
        out = torch.empty((m,) + x.shape[1:], dtype=t.dtype, device=t.device)
        if self._checks_calls:
            self._agree("reduce_scatterv", padded.nbytes)
        _reduce_scatter_flat(out.view(-1), padded.view(-1), op=op.to_torch(), group=self.device_group)
        if op is ReduceOp.AVG:
            out.div_(n)
        return out[: sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    # --- data movement ----------------------------------------------------------
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.world_size
        out = torch.empty((n,) + t.shape, dtype=t.dtype, device=t.device)
        _all_gather_flat(wire_view(out).view(-1), wire_view(t).view(-1), group=self.device_group)
        return _concat_leading(out, dim)

    def _all_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        return self._gatherv_bytes(t, dim, sizes, t.shape[dim])

    def _gatherv_bytes(
        self, t: torch.Tensor, dim: int, sizes: list[int], own: int, reason: str | None = None
    ) -> torch.Tensor | None:
        """All-gather of uneven pieces as bytes, each behind a header with its size.

        Every rank checks every header against ``sizes``, so a rank whose input
        does not match its entry (``own`` = -1 and ``reason`` after a local
        rejection) makes every valid rank raise instead of returning a wrong
        result. Returns None on a rejecting rank.
        """
        n, m = self.world_size, max(sizes)
        x = t.movedim(dim, 0)
        inner = tuple(x.shape[1:])
        row = math.prod(inner) * t.element_size()
        piece = _GATHERV_HDR + m * row
        buf = torch.empty(piece, dtype=torch.uint8, device=t.device)
        buf[:8].view(torch.int64).fill_(own)
        if 0 < own <= m:
            buf[_GATHERV_HDR : _GATHERV_HDR + own * row].view(t.dtype).view((own,) + inner).copy_(x)
        out = torch.empty(n * piece, dtype=torch.uint8, device=t.device)
        _all_gather_flat(out, buf, group=self.device_group)
        rows = out.view(n, piece)
        if self._checks_calls:  # headers are checked on CPU only (see _checks_calls)
            self._check_gatherv_heads(rows, sizes, dim, reason)
            if reason is not None:
                return None
        pieces = [
            rows[r, _GATHERV_HDR : _GATHERV_HDR + s * row].view(t.dtype).view((s,) + inner)
            for r, s in enumerate(sizes)
        ]
        return torch.cat(pieces, 0).movedim(0, dim).contiguous()

    def _check_gatherv_heads(
        self, rows: torch.Tensor, sizes: list[int], dim: int, reason: str | None
    ) -> None:
        """Raise unless every piece's header matches ``sizes`` (returns on a rejecting rank)."""
        n = self.world_size
        heads = rows[:, :8].clone().view(torch.int64).view(-1).tolist()
        if self._settle_rejections("all_gatherv", heads, reason):
            return
        bad = [r for r in range(n) if heads[r] != sizes[r]]
        if bad:
            got = ", ".join(f"rank {r}: {heads[r]}" for r in bad)
            raise CollectiveMismatch(
                f"group {self.unique_name!r}, op all_gatherv: inputs do not match sizes={sizes} "
                f"along dim {dim} ({got}); every rank must pass the same sizes list, with its "
                f"own entry matching its input"
            )

    # --- rejected calls ---------------------------------------------------------
    def _agree(self, op: str, nbytes: int, reason: str | None = None) -> None:
        """All-gather every rank's byte count of ``op`` (-1: it rejected its arguments).

        Raises on every valid rank if some rank rejected
        (:class:`PeerRejectedError`) or the byte counts differ
        (:class:`CollectiveMismatch`); returns on a rejecting rank.
        """
        n = self.world_size
        mine = torch.tensor([-1 if reason is not None else nbytes], dtype=torch.int64)
        out = torch.empty(n, dtype=torch.int64)
        _all_gather_flat(out, mine, group=self.cpu_group)
        heads = out.tolist()
        if self._settle_rejections(op, heads, reason):
            return
        if any(h != heads[0] for h in heads):
            raise CollectiveMismatch(
                f"group {self.unique_name!r}, op {op}: ranks disagree on the size of the call "
                f"(bytes per rank: {heads}); every rank must pass tensors of the same shape and "
                f"dtype"
            )

    def _settle_rejections(self, op: str, heads: list[int], reason: str | None) -> bool:
        """Act on the all-gathered headers of a call (negative: that rank rejected).

        Every rank sees the same ``heads``, so every rank takes the same path:
        when some but not all ranks rejected, the lowest rejecting rank
        broadcasts its reason. Returns True on a rejecting rank (it raises its
        own error), raises :class:`PeerRejectedError` on a valid rank, and
        returns False when nobody rejected.
        """
        rejected = [r for r, h in enumerate(heads) if h < 0]
        if not rejected:
            return False
        why = reason
        if len(rejected) < self.world_size:  # msgpack over gloo: never unpickled
            why = object_group(self.cpu_group).broadcast(reason, rejected[0])
        if reason is not None:
            return True
        raise PeerRejectedError(self.unique_name, op, rejected[0], str(why))

    def _abort_collective(self, op: str, message: str, *meta: Any) -> None:
        if not self._checks_calls:
            return  # GPU calls exchange no headers: peers cannot be told (see _checks_calls)
        if op == "all_gatherv":
            args = self._gatherv_dummy(*meta) if len(meta) == 3 else None
            if args is not None:
                self._guard(op, self._gatherv_bytes, *args, -1, message)
        elif op in ("broadcast", "reduce_scatterv"):
            self._guard(op, self._agree, op, -1, message)

    def _gatherv_dummy(
        self, input_: Any, dim: Any, sizes: Any
    ) -> tuple[torch.Tensor, int, list[int]] | None:
        """Arguments for joining a rejected all_gatherv, or None if they cannot be built."""
        if not isinstance(input_, torch.Tensor) or input_.device.type != self.device.type:
            return None
        if not isinstance(dim, int) or isinstance(dim, bool) or input_.dim() == 0:
            return None
        if not -input_.dim() <= dim < input_.dim() or not isinstance(sizes, (list, tuple)):
            return None
        if len(sizes) != self.world_size or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
        ):
            return None
        d = dim % input_.dim()
        shape = list(input_.shape)
        shape[d] = 0  # no payload: the header says "rejected"; inner shape sizes the pieces
        return torch.empty(shape, dtype=input_.dtype, device=input_.device), d, list(sizes)

    def _gather(self, t: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        me = self.rank_in_group == dst
        bufs = [torch.empty_like(t) for _ in range(self.world_size)] if me else None
        dist.gather(
            wire_view(t),
            [wire_view(b) for b in bufs] if bufs is not None else None,
            dst=self._g(dst),
            group=self.device_group,
        )
        return torch.cat(bufs, dim) if bufs is not None else None

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self._checks_calls:
            self._agree("broadcast", t.nbytes)
        dist.broadcast(wire_view(t), src=self._g(src), group=self.device_group)
        return t

    def _scatter(self, t: torch.Tensor | None, src: int, dim: int) -> torch.Tensor:
        """The source announces shape, dtype and dim (msgpack, never pickle), then scatters."""
        meta = None if t is None else ["ok", list(t.shape), _dtype_name(t.dtype), dim]
        meta = object_group(self.cpu_group).broadcast(meta, src)
        if meta[0] == "error":
            raise CollectiveMismatch(
                f"scatter on group {self.unique_name!r}: the source rank {src} rejected its "
                f"input ({meta[1]}); fix the call on rank {src}",
                queue=self.unique_name, peers=(src,),
            )
        shape, dtype, d = self._check_scatter_meta(meta, src)
        d = d % len(shape)
        n = self.world_size
        piece_shape = list(shape)
        piece_shape[d] //= n
        out = torch.empty(piece_shape, dtype=dtype, device=self.device)
        chunks = None
        if t is not None:
            chunks = [wire_view(c.contiguous()) for c in t.chunk(n, d)]
        dist.scatter(wire_view(out), chunks, src=self._g(src), group=self.device_group)
        return out

    def _check_scatter_meta(self, meta: Any, src: int) -> tuple[list[int], torch.dtype, int]:
        """Shape, dtype and dim from the source's announcement, checked before allocating."""
        try:
            _, shape, dtype_name, d = meta
            dtype = getattr(torch, dtype_name)
            ok = (isinstance(dtype, torch.dtype) and isinstance(d, int)
                  and all(isinstance(x, int) and x >= 0 for x in shape) and -len(shape) <= d
                  < len(shape))
        except (TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise DecodeError(
                f"scatter on group {self.unique_name!r}: the announcement of rank {src} is "
                f"malformed ({meta!r:.200}); nothing was allocated", peers=(src,))
        return shape, dtype, d

    def _scatter_abort(self, src: int, message: str) -> None:
        object_group(self.cpu_group).broadcast(["error", message], src)

    def _all_to_all(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        n = self.world_size
        x = t.movedim(scatter_dim, 0).contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(wire_view(out), wire_view(x), group=self.device_group)
        # out = [piece from rank 0 | piece from rank 1 | ...], each in moved layout.
        pieces = [p.movedim(0, scatter_dim) for p in out.chunk(n, 0)]
        return torch.cat(pieces, gather_dim).contiguous()

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(wire_view(t), dst=self._g(dst), group=self.device_group)

    def _recv(self, size: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(wire_view(out), src=self._g(src), group=self.device_group)
        return out


def _concat_leading(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """(n, *shape) -> shape with dim ``dim`` n times larger (rank-major concat)."""
    n = stacked.shape[0]
    shape = list(stacked.shape[1:])
    x = stacked.movedim(0, dim)  # (..., n, shape[dim], ...)
    shape[dim] *= n
    return x.reshape(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (an attribute of ``torch``)."""
    return str(dtype).removeprefix("torch.")
