"""A communicator that carries every op over a ``torch.distributed`` group.

This is the portable path: gloo for CPU tensors (and NCCL for CUDA ones when
given a NCCL ``device_group``). Faster transports subclass it and override the
ops they accelerate, falling back to these implementations for the rest.

Uneven ops (``all_gatherv``, ``reduce_scatterv``) pad every rank's piece to the
largest and slice afterwards, which works on any backend. Pure data-movement
ops send every type outside a small native set as ``uint8`` byte views, so they
work even where a backend lacks a kernel (``bfloat16``, ``uint16``, ``float8``...).

Signed calls (CPU tensors). Every op, collective or point-to-point, starts
with an envelope exchange (:mod:`device_comms.signatures.envelopes`): each rank sends
every peer its call's header (op, dtype, shape, layout arguments, root, the
group's call number; :mod:`device_comms.signatures.call_signature`) and, when the call
is small (at most :data:`~device_comms.signatures.envelopes.BLOCK_INLINE` bytes from a
rank), the payload itself. Then every rank has seen every header and:

* a call that every rank made alike is already done when small (each rank
  computes its result from the payloads: reductions in rank order, so every
  rank gets bitwise identical values); a larger one runs the gloo op next,
  whose sizes every rank now knows to agree, so gloo never sees a size
  mismatch (which aborts the process);
* a rank whose own arguments failed validation (any op, any argument; see
  :meth:`DeviceCommunicator._reject`) sent a REJECTED header with its reason
  instead: its peers raise :class:`~device_comms.errors.PeerRejectedError`
  naming it, it raises its own ``TypeError``/``ValueError``;
* calls that differ (op, dtype, shape, layout, root, call number: a skipped
  or extra call) raise :class:`~device_comms.errors.CollectiveMismatch` on
  every rank, naming who called what;
* in all three cases every rank sent and received exactly one envelope, so
  the group stays usable for the next call.

Send and recv exchange envelopes between the two ranks (the receiver sends its
expected dtype, shape and source), so both sides raise on a mismatch or a
rejection; a payload over the inline size follows after both agreed. Each
direction with each peer has its own tags, counter and lock
(:mod:`device_comms.signatures.p2p_envelopes`): a rank may send to a peer on one thread
while it receives from the same peer on another.

None of this runs for GPU tensors: an exchange on the host would synchronise
the stream every call and break CUDA graph capture, so they keep
``torch.distributed``'s behaviour (and scatter's metadata announcement).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from device_comms.base import DeviceCommunicator
from device_comms.errors import CollectiveMismatch, DecodeError
from device_comms.fixed_reduce import reduce_views
from device_comms.reduce_op import ReduceOp
from device_comms.signatures.call_signature import data_shape
from device_comms.signatures.envelopes import BLOCK_INLINE, INLINE_MAX, Blocks, as_bytes
from device_comms.signatures.signed_calls import SignedCalls
from device_comms.torch_dist import gloo_alltoallv
from shm_broadcast.describe import describe
from shm_broadcast.ranks.group_adapter import object_group

__all__ = ["TorchDistributedCommunicator", "wire_view"]

# torch >= 2.12 names these *_single; older releases only have *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Types every backend moves natively; all others (bfloat16, float16, bool,
# int16, uint16/32/64, float8, complex...) move as raw bytes.
_NATIVE = frozenset(
    {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64})
# Integer types gloo (and NCCL) cannot reduce: reduced in a wider type and cast
# back. Two's complement arithmetic is modular, so wrap-around and bitwise ops
# give exactly the narrow type's results.
_REDUCE_AS = {torch.int16: torch.int32}


def _wire_op(op: ReduceOp, dtype: torch.dtype) -> Any:
    """The ``torch.distributed`` op for ``op`` on ``dtype``.

    Backends reduce ``bool`` as bytes, so SUM would leave 2s (and wrap to 0 at
    256 ranks) where logical OR means 1; MAX/MIN over 0/1 bytes are OR/AND.
    """
    if dtype == torch.bool:  # (AVG is rejected for bool before this)
        if op is ReduceOp.SUM:
            return ReduceOp.MAX.to_torch()
        if op is ReduceOp.PRODUCT:
            return ReduceOp.MIN.to_torch()
    return op.to_torch()


def _drops_nan(op: ReduceOp, t: torch.Tensor) -> bool:
    """Whether the backend's MIN/MAX may drop a NaN of ``t``: gloo's compare-and-keep
    returns the other operand when the incoming one is NaN, so which NaNs survive
    depends on the reduction's order; the engines (``torch.maximum`` semantics)
    propagate every NaN."""
    return ((op is ReduceOp.MIN or op is ReduceOp.MAX) and t.dtype.is_floating_point
            and t.device.type == "cpu")


def _nan_mask(t: torch.Tensor) -> torch.Tensor:
    return torch.isnan(t).to(torch.uint8)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """A same-memory view of contiguous ``t`` in a dtype every backend can move.

    Types outside a small native set travel as flat ``uint8`` bytes; callers
    only use this for pure data movement on contiguous tensors.
    """
    if t.dtype not in _NATIVE:
        return t.reshape(-1).view(torch.uint8)
    return t


class TorchDistributedCommunicator(DeviceCommunicator):
    """Every op through ``torch.distributed`` on ``device_group`` (any device type).

    Same arguments as :class:`~device_comms.base.DeviceCommunicator`.
    """

    name = "torch"
    device_types = frozenset({"cpu", "cuda"})
    priority = 0

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        device: torch.device,
        device_group: dist.ProcessGroup | None = None,
        unique_name: str = "",
        *,
        timeout: float | None = None,
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, timeout=timeout)
        #: Whether calls are signed (an envelope exchange first; see the module
        #: docstring): only for CPU tensors, since on a GPU the exchange would
        #: synchronise the stream every call and could not run inside CUDA graph
        #: capture, so GPU calls keep torch.distributed's behaviour.
        self._checks_calls: bool = self.device.type == "cpu"
        #: The signed calls' state and steps (used only when ``_checks_calls``).
        self._signed = SignedCalls(
            self.device_group, self.unique_name, self.rank_in_group, self.world_size,
            prologue=self._prologue, call_number=self._call_number,
        )

    def _g(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def destroy(self) -> None:
        """Release every resource (see the base class), and the signed calls'
        references to this communicator: nothing then keeps it, or its process
        groups, alive in a reference cycle once its owner lets go of it."""
        try:
            super().destroy()
        finally:
            self._signed.release()

    def number_calls(self, source: Callable[[], int] | None) -> None:
        """Number the collectives (see the base class); the signed calls' headers
        carry the numbers."""
        super().number_calls(source)
        self._signed.number_calls(source)

    def _prologue(self, op: str, header: np.ndarray | None, reason: str | None) -> bool:
        """Agree on a signed collective by a cheaper or wider means first (none here).

        :class:`~device_comms.signatures.signed_calls.SignedCalls` calls it
        before every collective's envelopes. Subclasses whose ranks also meet
        elsewhere (the shared-memory engine, the hierarchical leaders) override
        this so that a call there and a call here are compared too. Returns
        True when it already told the peers about this rank's rejection
        (``reason``).
        """
        return False

    # --- reductions -----------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if self._checks_calls:
            signed = self._signed
            small = t.nbytes <= BLOCK_INLINE
            h = signed.header("all_reduce", t.dtype, op, 0, t.shape, t.shape)
            signed.call("all_reduce", h, t if small else None)
            if small:
                return reduce_views(signed.received(t), op)
        wide = _REDUCE_AS.get(t.dtype)
        out = t.to(wide) if wide is not None else t.clone()
        dist.all_reduce(out, op=_wire_op(op, t.dtype), group=self.device_group)
        if _drops_nan(op, t):
            hit = _nan_mask(t)
            dist.all_reduce(hit, op=ReduceOp.MAX.to_torch(), group=self.device_group)
            out.masked_fill_(hit.bool(), float("nan"))
        if op is ReduceOp.AVG:
            out.div_(self.world_size)
        return out.to(t.dtype) if wide is not None else out

    def _reduce(self, t: torch.Tensor, dst: int, op: ReduceOp) -> torch.Tensor | None:
        me = self.rank_in_group == dst
        if self._checks_calls:
            signed = self._signed
            small = t.nbytes <= BLOCK_INLINE
            h = signed.header("reduce", t.dtype, op, dst, t.shape, t.shape)
            signed.call("reduce", h, t if small and not me else None)
            if small:
                return reduce_views(signed.received(t), op) if me else None
        wide = _REDUCE_AS.get(t.dtype)
        out = t.to(wide) if wide is not None else t.clone()
        dist.reduce(out, dst=self._g(dst), op=_wire_op(op, t.dtype), group=self.device_group)
        hit = _nan_mask(t) if _drops_nan(op, t) else None
        if hit is not None:
            dist.reduce(hit, dst=self._g(dst), op=ReduceOp.MAX.to_torch(), group=self.device_group)
        if not me:
            return None
        if hit is not None:
            out.masked_fill_(hit.bool(), float("nan"))
        if op is ReduceOp.AVG:
            out.div_(self.world_size)
        return out.to(t.dtype) if wide is not None else out

    def _reduce_scatter(self, t: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        n = self.world_size
        x = t.movedim(dim, 0).contiguous()
        m = x.shape[0] // n
        if self._checks_calls:
            return self._signed_reduce_scatter(
                "reduce_scatter", t, x, dim, [m] * n, op, (t.shape, dim)
            )
        return self._plain_reduce_scatter(x, dim, op)

    def _plain_reduce_scatter(self, x: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        """Reduce-scatter of ``x`` (the scattered dim moved to 0) through the backend."""
        out = self._backend_reduce_scatter(x, dim, op)
        if _drops_nan(op, x):
            hit = self._backend_reduce_scatter(_nan_mask(x), dim, ReduceOp.MAX)
            out.masked_fill_(hit.bool(), float("nan"))
        return out

    def _backend_reduce_scatter(self, x: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        wide = _REDUCE_AS.get(x.dtype)
        if wide is not None:
            return self._backend_reduce_scatter(x.to(wide), dim, op).to(x.dtype)
        n = self.world_size
        out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=x.dtype, device=x.device)
        _reduce_scatter_flat(out.view(-1), x.view(-1), op=_wire_op(op, x.dtype),
                             group=self.device_group)
        if op is ReduceOp.AVG:
            out.div_(n)
        return out.movedim(0, dim).contiguous()

    def _reduce_scatterv(
        self, t: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        x = t.movedim(dim, 0).contiguous()
        if self._checks_calls:
            return self._signed_reduce_scatter(
                "reduce_scatterv", t, x, dim, sizes, op, (tuple(sizes), t.shape, dim)
            )
        return self._plain_reduce_scatterv(x, dim, sizes, op)

    def _signed_reduce_scatter(
        self, kind: str, t: torch.Tensor, x: torch.Tensor, dim: int, sizes: list[int],
        op: ReduceOp, layout: object,
    ) -> torch.Tensor:
        """(v)reduce-scatter on CPU: the whole input in the block when small, else gloo.

        Every rank's block then holds its whole input; this rank reduces its
        region of each, in rank order.
        """
        me, inner, signed = self.rank_in_group, x.shape[1:], self._signed
        small = x.nbytes <= BLOCK_INLINE
        h = signed.header(kind, t.dtype, op, 0, layout, t.shape)
        signed.call(kind, h, x if small else None)
        if not small:
            if kind == "reduce_scatter":
                return self._plain_reduce_scatter(x, dim, op)
            return self._plain_reduce_scatterv(x, dim, sizes, op)
        start = sum(sizes[:me])
        mine = x[start : start + sizes[me]]
        at = [start * math.prod(inner)] * self.world_size
        got = signed.received(mine, [mine.shape] * self.world_size, at)
        return reduce_views(got, op).movedim(0, dim).contiguous()

    def _plain_reduce_scatterv(
        self, x: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        """Uneven reduce-scatter through the backend: pieces padded to the largest."""
        out = self._backend_reduce_scatterv(x, dim, sizes, op)
        if _drops_nan(op, x):
            hit = self._backend_reduce_scatterv(_nan_mask(x), dim, sizes, ReduceOp.MAX)
            out.masked_fill_(hit.bool(), float("nan"))
        return out

    def _backend_reduce_scatterv(
        self, x: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        wide = _REDUCE_AS.get(x.dtype)
        if wide is not None:
            return self._backend_reduce_scatterv(x.to(wide), dim, sizes, op).to(x.dtype)
        n, m = self.world_size, max(sizes)
        padded = torch.zeros((n * m,) + x.shape[1:], dtype=x.dtype, device=x.device)
        off = 0
        for i, s in enumerate(sizes):
            padded[i * m : i * m + s] = x[off : off + s]
            off += s
        out = torch.empty((m,) + x.shape[1:], dtype=x.dtype, device=x.device)
        _reduce_scatter_flat(out.view(-1), padded.view(-1), op=_wire_op(op, x.dtype),
                             group=self.device_group)
        if op is ReduceOp.AVG:
            out.div_(n)
        return out[: sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    # --- data movement ----------------------------------------------------------
    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self._checks_calls:
            signed = self._signed
            small = t.nbytes <= BLOCK_INLINE
            h = signed.header("all_gather", t.dtype, None, 0, (t.shape, dim), t.shape)
            signed.call("all_gather", h, t if small else None)
            if small:
                return torch.cat(signed.received(t), dim)
        n = self.world_size
        out = torch.empty((n,) + t.shape, dtype=t.dtype, device=t.device)
        _all_gather_flat(wire_view(out).view(-1), wire_view(t).view(-1), group=self.device_group)
        return _concat_leading(out, dim)

    def _all_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        return self._signed_gatherv(t, dim, sizes, None)

    def _all_gatherv_packed(self, packed: torch.Tensor, sizes: list[int],
                            layout: int) -> torch.Tensor:
        return self._signed_gatherv(packed, 0, sizes, layout)

    def _row_counts(self, n: int) -> list[int]:
        # Signed as all_gatherv_rows (not a plain all_gather of one int64, which a
        # peer's unrelated all_gather could pair with); the counts ride in the envelope.
        if not self._checks_calls:
            return super()._row_counts(n)
        signed = self._signed
        mine = torch.tensor([n], dtype=torch.int64, device="cpu")
        h = signed.header("all_gatherv_rows", torch.int64, None, 0, (1,), (1,))
        signed.call("all_gatherv_rows", h, mine)
        return [int(t) for t in torch.cat(signed.received(mine)).tolist()]

    def _signed_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int],
                        layout: int | None) -> torch.Tensor:
        """All-gather of uneven pieces; ``layout`` (packed rows' digest) is signed too."""
        inner = t.shape[:dim] + t.shape[dim + 1 :]
        if self._checks_calls:
            signed = self._signed
            small = max(sizes) * math.prod(inner) * t.element_size() <= BLOCK_INLINE
            packed = -1 if layout is None else layout  # hash(None) differs between processes
            h = signed.header("all_gatherv", t.dtype, None, 0, (tuple(sizes), inner, dim, packed),
                              t.shape)
            signed.call("all_gatherv", h, t if small else None)
            if small:
                shapes = [t.shape[:dim] + (s,) + t.shape[dim + 1 :] for s in sizes]
                return torch.cat(signed.received(t, shapes), dim)
        return self._plain_gatherv(t, dim, sizes)

    def _plain_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """All-gather of uneven pieces as bytes, each padded to the largest."""
        n, m = self.world_size, max(sizes)
        x = t.movedim(dim, 0)
        inner = tuple(x.shape[1:])
        row = math.prod(inner) * t.element_size()
        buf = torch.zeros(m * row, dtype=torch.uint8, device=t.device)
        if x.shape[0]:
            buf[: x.shape[0] * row].view(t.dtype).view(x.shape).copy_(x)
        out = torch.empty(n * m * row, dtype=torch.uint8, device=t.device)
        _all_gather_flat(out, buf, group=self.device_group)
        rows = out.view(n, m * row)
        pieces = [rows[r, : s * row].view(t.dtype).view((s,) + inner) for r, s in enumerate(sizes)]
        return torch.cat(pieces, 0).movedim(0, dim).contiguous()

    def _gather(self, t: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        me = self.rank_in_group == dst
        if self._checks_calls:
            signed = self._signed
            small = t.nbytes <= BLOCK_INLINE
            h = signed.header("gather", t.dtype, None, dst, (t.shape, dim), t.shape)
            signed.call("gather", h, t if small and not me else None)
            if small:
                return torch.cat(signed.received(t), dim) if me else None
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
            signed = self._signed
            small = t.nbytes <= BLOCK_INLINE
            me = self.rank_in_group == src
            h = signed.header("broadcast", t.dtype, None, src, t.shape, t.shape)
            signed.call("broadcast", h, t if small and me else None)
            if small:
                if not me:
                    t.copy_(signed.blocks().views(t.dtype, t.shape)[src])
                return t
        dist.broadcast(wire_view(t), src=self._g(src), group=self.device_group)
        return t

    def _scatter(self, t: torch.Tensor | None, src: int, dim: int) -> torch.Tensor:
        if self._checks_calls:
            return self._signed_scatter(t, src, dim)
        # GPU: the source announces shape, dtype and dim (msgpack, never pickle), then scatters.
        meta = None if t is None else ["ok", list(t.shape), _dtype_name(t.dtype), dim]
        meta = object_group(self.cpu_group).broadcast(meta, src)
        if meta[0] == "error":
            raise CollectiveMismatch(
                f"scatter on group {self.unique_name!r}: the source rank {src} rejected its "
                f"input ({meta[1]}); fix the call on rank {src}",
                queue=self.unique_name, peers=(src,),
            )
        shape, dtype, d = self._check_scatter_meta(meta, src)
        return self._plain_scatter(t, src, shape, dtype, d % len(shape))

    def _plain_scatter(
        self, t: torch.Tensor | None, src: int, shape: list[int], dtype: torch.dtype, d: int
    ) -> torch.Tensor:
        """Scatter through the backend once every rank knows the source's shape and dtype."""
        piece_shape = list(shape)
        piece_shape[d] //= self.world_size
        out = torch.empty(piece_shape, dtype=dtype, device=self.device)
        chunks = None
        if t is not None:
            chunks = [wire_view(c.contiguous()) for c in torch.tensor_split(t, self.world_size, d)]
        dist.scatter(wire_view(out), chunks, src=self._g(src), group=self.device_group)
        return out

    def _signed_scatter(self, t: torch.Tensor | None, src: int, dim: int) -> torch.Tensor:
        """Scatter on CPU: the source's block holds its shape, and its tensor when small.

        Receivers know neither shape nor dtype, so their header leaves both
        open; every rank's ``dim`` travels in word 10 and is checked against
        the source's tensor after the exchange.
        """
        n, me, signed = self.world_size, self.rank_in_group, self._signed
        if t is not None:
            prefix = _shape_prefix(t.shape)
            small = prefix.numel() + t.nbytes <= BLOCK_INLINE
            payload = torch.cat([prefix, as_bytes(t)]) if small else prefix
            h = signed.header("scatter", None, None, src, (), t.shape, data_dtype=t.dtype,
                              extra=dim)
            signed.call("scatter", h, payload)
            self._check_scatter_dims(src, h, signed.blocks())
            if small:
                mine = torch.tensor_split(t, n, dim)[me]
                return mine.clone(memory_format=torch.contiguous_format)
            return self._plain_scatter(t, src, list(t.shape), t.dtype, dim)
        h = signed.header("scatter", None, None, src, (), None, extra=dim)
        signed.call("scatter", h)
        env = signed.blocks()
        d = self._check_scatter_dims(src, h, env)
        shape, dtype = self._scatter_source(src, env)
        skip = 16 * ((len(shape) + 1) // 2)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype, device="cpu").element_size()
        if skip + nbytes <= BLOCK_INLINE:
            whole = env.payload(src)[skip : skip + nbytes].view(dtype).view(shape)
            return torch.tensor_split(whole, n, d)[me].clone(memory_format=torch.contiguous_format)
        return self._plain_scatter(None, src, shape, dtype, d)

    def _check_scatter_dims(self, src: int, mine: np.ndarray, env: Blocks) -> int:
        """The source's scatter dim (``env``: the exchange of the call, ``mine``: this rank's
        header); raises on every rank unless every rank's ``dim`` names it."""
        me = self.rank_in_group
        words = [mine if r == me else env.words[r] for r in range(self.world_size)]
        ndim, src_d = int(words[src][9]), int(words[src][10])
        dims = [int(w[10]) for w in words]
        bad = [r for r, d in enumerate(dims) if not -ndim <= d < ndim or d % ndim != src_d]
        if bad:
            raise CollectiveMismatch(
                f"group {self.unique_name!r}, op scatter: rank(s) {bad} passed a dim that does "
                f"not match the source's (dim per rank: {dims}; the source rank {src} scatters "
                f"a {ndim}-D tensor along dim {src_d}); every rank must pass the same dim. "
                f"Nothing was exchanged and the group stays usable.",
                queue=self.unique_name, peers=bad,
            )
        return src_d

    def _scatter_source(self, src: int, env: Blocks) -> tuple[list[int], torch.dtype]:
        """Shape and dtype of the source's tensor, from its block in ``env`` (checked before
        allocating)."""
        words = env.words[src]
        ndim = int(words[9])
        raw = env.payload(src)
        _, dtype = data_shape(words)
        shape = None
        if 0 < ndim <= _MAX_DIMS and raw.numel() >= 8 * ndim:
            shape = raw[: 8 * ndim].view(torch.int64).tolist()
        if dtype is None or shape is None or any(x < 0 for x in shape):
            raise DecodeError(
                f"scatter on group {self.unique_name!r}: rank {src}'s block does not describe "
                f"a tensor (ndim {ndim}, dtype code {int(words[8])}); nothing was allocated",
                queue=self.unique_name, peers=(src,))
        return shape, dtype

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
                f"malformed ({describe(meta, 200)}); nothing was allocated", peers=(src,))
        return shape, dtype, d

    def _scatter_abort(self, src: int, message: str) -> None:
        if self._checks_calls:
            self._abort_collective("scatter", message)
        else:
            object_group(self.cpu_group).broadcast(["error", message], src)

    def _all_to_all(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        n, me = self.world_size, self.rank_in_group
        x = t.movedim(scatter_dim, 0).contiguous()
        if self._checks_calls:
            signed = self._signed
            small = x.nbytes <= BLOCK_INLINE
            h = signed.header("all_to_all", t.dtype, None, 0, (t.shape, scatter_dim, gather_dim),
                              t.shape)
            signed.call("all_to_all", h, x if small else None)
            if small:  # piece ``me`` of every rank's whole input
                mine = torch.tensor_split(x, n, 0)[me]
                got = signed.received(mine, [mine.shape] * n, [me * mine.numel()] * n)
                return torch.cat([p.movedim(0, scatter_dim) for p in got], gather_dim).contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(wire_view(out), wire_view(x), group=self.device_group)
        # out = [piece from rank 0 | piece from rank 1 | ...], each in moved layout.
        pieces = [p.movedim(0, scatter_dim) for p in out.chunk(n, 0)]
        return torch.cat(pieces, gather_dim).contiguous()

    def _all_to_allv(
        self, t: torch.Tensor, send: list[int], recv: list[int] | None
    ) -> torch.Tensor:
        if self._checks_calls:
            signed = self._signed
            return gloo_alltoallv.signed_all_to_allv(
                self, t, send, recv, header=signed.header, call=signed.call,
                payload=signed.payload)
        got = gloo_alltoallv.exchange_sizes(self, send, recv)
        out = torch.empty((sum(got),) + t.shape[1:], dtype=t.dtype, device=t.device)
        return gloo_alltoallv.plain_all_to_allv(self.device_group, t, send, got, out)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        if self._checks_calls:
            signed = self._signed
            small = t.nbytes <= INLINE_MAX
            h = signed.header("send/recv", t.dtype, None, self.rank_in_group, t.shape, t.shape)
            with signed.p2p_side("send", dst) as side:
                signed.p2p_call("send", side, h, as_bytes(t) if small else None)
                if not small:
                    side.send_raw(as_bytes(t)).wait()
            return
        dist.send(wire_view(t), dst=self._g(dst), group=self.device_group)

    def _recv(self, size: torch.Size, dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(size, dtype=dtype, device=self.device)
        if self._checks_calls:
            signed = self._signed
            with signed.p2p_side("recv", src) as side:
                header = signed.header("send/recv", dtype, None, src, size, size)
                signed.p2p_call("recv", side, header)
                if out.nbytes <= INLINE_MAX:
                    as_bytes(out).copy_(side.payload())
                else:
                    side.recv_raw(as_bytes(out)).wait()
            return out
        dist.recv(wire_view(out), src=self._g(src), group=self.device_group)
        return out

    # --- rejected calls -----------------------------------------------------------
    def _abort_collective(self, op: str, message: str, *meta: Any) -> None:
        """Send a REJECTED envelope in place of this rank's call (CPU; see the module docstring).

        ``meta`` is ``(peer,)`` for send/recv (nobody is told without a valid peer).
        """
        if not self._checks_calls:
            if op == "all_to_allv":  # its sizes travel over the CPU group anyway
                self._guard(op, gloo_alltoallv.reject_exchange, self, message)
            return  # other GPU calls exchange no headers: peers cannot be told (see _checks_calls)
        signed = self._signed
        if op in ("send", "recv"):
            if meta:
                with signed.p2p_side(op, meta[0]) as side:
                    self._guard(op, signed.p2p_call, op, side, None, None, message)
            return
        self._guard(op, signed.reject, op, message)


_MAX_DIMS = 64  # dims a tensor may have (torch's limit)


def _shape_prefix(shape: torch.Size) -> torch.Tensor:
    """The shape as int64 words, padded to 16 bytes (the data after it stays aligned)."""
    words = torch.zeros(2 * ((len(shape) + 1) // 2), dtype=torch.int64, device="cpu")
    words[: len(shape)] = torch.tensor(list(shape), dtype=torch.int64, device="cpu")
    return words.view(torch.uint8)


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
