"""How torch dtypes and :class:`~device_comms.reduce_op.ReduceOp` reach NCCL.

Data movement (all-gather, broadcast, send/recv, gather) carries every dtype
as a flat ``uint8`` byte view, so it works for types NCCL has no name for.

Reductions need an NCCL type and operator. :func:`reduction_plan` picks one of:

* ``native``: the dtype has an ``ncclDataType_t`` (``float8_e4m3fn`` and
  ``float8_e5m2`` only from NCCL 2.24, and NCCL reduces them on SM >= 90 only);
* ``bool``: a ``uint8`` view; SUM/MAX/BOR become ``ncclMax`` (logical or),
  MIN/PRODUCT/BAND become ``ncclMin`` (logical and);
* ``widen``: ``int16``/``uint16`` are copied to ``int32``, reduced, and cast
  back; two's complement arithmetic is modular, so the results equal the
  narrow type's own (wrap-around included);
* ``complex``: SUM/AVG of ``complex32/64/128`` as pairs of real numbers
  (``torch.view_as_real``).

Anything else raises ``TypeError`` naming the dtype; bitwise operators (other
than the bool cases above) raise ``ValueError``: NCCL has none. Both happen
before any communication.
"""

from __future__ import annotations

import dataclasses

import torch

from device_comms.cuda.pynccl.library import format_version
from device_comms.reduce_op import ReduceOp

__all__ = [
    "DATATYPE_CODES",
    "REDOP_CODES",
    "FP8_MIN_VERSION",
    "native_dtype",
    "bytes_view",
    "ReducePlan",
    "reduction_plan",
    "as_reduce_op",
]

# ncclDataType_t (nccl.h); the aliases ncclChar/ncclInt/ncclHalf/... are not repeated.
DATATYPE_CODES: dict[str, int] = {
    "ncclInt8": 0, "ncclUint8": 1, "ncclInt32": 2, "ncclUint32": 3, "ncclInt64": 4,
    "ncclUint64": 5, "ncclFloat16": 6, "ncclFloat32": 7, "ncclFloat64": 8,
    "ncclBfloat16": 9, "ncclFloat8e4m3": 10, "ncclFloat8e5m2": 11,
}
# ncclRedOp_t (nccl.h), the built-in operators.
REDOP_CODES: dict[str, int] = {
    "ncclSum": 0, "ncclProd": 1, "ncclMax": 2, "ncclMin": 3, "ncclAvg": 4,
}
# First NCCL release whose ncclDataType_t has the two float8 types (2.24.0;
# PyTorch's NCCL_SUPPORTS_FP8 and nccl-tests' HAVE_FP8 use the same gate).
FP8_MIN_VERSION = 22400

_NATIVE: dict[torch.dtype, str] = {
    torch.int8: "ncclInt8", torch.uint8: "ncclUint8", torch.int32: "ncclInt32",
    torch.uint32: "ncclUint32", torch.int64: "ncclInt64", torch.uint64: "ncclUint64",
    torch.float16: "ncclFloat16", torch.float32: "ncclFloat32", torch.float64: "ncclFloat64",
    torch.bfloat16: "ncclBfloat16",
}
_FP8: dict[torch.dtype, str] = {
    dt: name
    for dt, name in (
        (getattr(torch, "float8_e4m3fn", None), "ncclFloat8e4m3"),
        (getattr(torch, "float8_e5m2", None), "ncclFloat8e5m2"),
    )
    if isinstance(dt, torch.dtype)
}
_OPS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "ncclSum", ReduceOp.PRODUCT: "ncclProd", ReduceOp.MAX: "ncclMax",
    ReduceOp.MIN: "ncclMin", ReduceOp.AVG: "ncclAvg",
}
_BOOL_OPS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "ncclMax", ReduceOp.MAX: "ncclMax", ReduceOp.BOR: "ncclMax",
    ReduceOp.MIN: "ncclMin", ReduceOp.PRODUCT: "ncclMin", ReduceOp.BAND: "ncclMin",
}
_WIDEN: dict[torch.dtype, torch.dtype] = {torch.int16: torch.int32, torch.uint16: torch.int32}
_COMPLEX_PARTS: dict[torch.dtype, torch.dtype] = {
    torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64,
}


def as_reduce_op(op: object, arg: str = "op") -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (a member or its name, any case)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    names = ", ".join(ReduceOp.__members__)
    raise TypeError(f"{arg} must be a ReduceOp ({names}), got {op!r}")


def native_dtype(dtype: torch.dtype, version: int) -> int | None:
    """The ``ncclDataType_t`` of ``dtype`` under NCCL ``version``, or None."""
    name = _NATIVE.get(dtype)
    if name is None and dtype in _FP8 and version >= FP8_MIN_VERSION:
        name = _FP8[dtype]
    return None if name is None else DATATYPE_CODES[name]


def bytes_view(t: torch.Tensor, arg: str = "tensor") -> torch.Tensor:
    """A flat ``uint8`` view of contiguous ``t`` (same memory), for data movement."""
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError as e:
        raise TypeError(f"{arg} of dtype {t.dtype} cannot be moved as raw bytes: {e}") from e


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """How one reduction of one dtype runs on NCCL.

    Attributes:
        kind: ``"native"``, ``"bool"``, ``"widen"`` or ``"complex"`` (see module doc).
        dtype: The ``ncclDataType_t`` sent to NCCL.
        op: The ``ncclRedOp_t`` sent to NCCL.
        wide: The type reduced in, for ``"widen"`` (else None).
        factor: NCCL elements per tensor element (2 for complex).
    """

    kind: str
    dtype: int
    op: int
    wide: torch.dtype | None = None
    factor: int = 1

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        """A flat view of contiguous ``t`` in the type NCCL reduces (not for ``widen``)."""
        if self.kind == "bool":
            return t.reshape(-1).view(torch.uint8)
        if self.kind == "complex":
            return torch.view_as_real(t.reshape(-1)).reshape(-1)
        if self.kind == "widen":
            raise ValueError(
                "a widened reduction has no same-memory view; copy with .to(plan.wide)"
            )
        return t.reshape(-1)


def reduction_plan(dtype: torch.dtype, op: object, version: int) -> ReducePlan:
    """Choose how NCCL ``version`` reduces ``dtype`` with ``op``.

    Raises:
        TypeError: ``op`` is not a reduction, or NCCL cannot reduce ``dtype``
            (or not with ``op``).
        ValueError: ``op`` is bitwise (NCCL has no bitwise reductions).
    """
    rop = as_reduce_op(op)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype == torch.bool:
        return _bool_plan(rop)
    _check_not_bitwise(rop, dtype)
    code = native_dtype(dtype, version)
    if code is not None:
        _check_avg(rop, dtype)
        return ReducePlan("native", code, REDOP_CODES[_OPS[rop]])
    if dtype in _WIDEN:
        _check_avg(rop, dtype)
        wide = _WIDEN[dtype]
        return ReducePlan("widen", DATATYPE_CODES[_NATIVE[wide]], REDOP_CODES[_OPS[rop]], wide)
    if dtype in _COMPLEX_PARTS:
        return _complex_plan(rop, dtype)
    raise TypeError(_no_reduction(dtype, version))


def _bool_plan(rop: ReduceOp) -> ReducePlan:
    name = _BOOL_OPS.get(rop)
    if name is None and rop is ReduceOp.AVG:
        raise TypeError(
            "op=ReduceOp.AVG cannot reduce a torch.bool tensor; use SUM/MAX (logical or) "
            "or MIN/PRODUCT (logical and), or convert to float first"
        )
    if name is None:
        raise ValueError(
            f"op=ReduceOp.{rop.name} is not supported by NCCL for torch.bool tensors (NCCL has "
            f"no bitwise reductions); use SUM/MAX/BOR (logical or) or MIN/PRODUCT/BAND "
            f"(logical and), or all_reduce the tensor as int32 with SUM and take it modulo 2"
        )
    return ReducePlan("bool", DATATYPE_CODES["ncclUint8"], REDOP_CODES[name])


def _complex_plan(rop: ReduceOp, dtype: torch.dtype) -> ReducePlan:
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(
            f"op=ReduceOp.{rop.name} is not supported for complex dtype {dtype} (complex numbers "
            f"have no order, and NCCL multiplies element-wise only); use SUM/AVG, or reduce "
            f".real/.imag separately"
        )
    part = DATATYPE_CODES[_NATIVE[_COMPLEX_PARTS[dtype]]]
    return ReducePlan("complex", part, REDOP_CODES[_OPS[rop]], factor=2)


def _check_not_bitwise(rop: ReduceOp, dtype: torch.dtype) -> None:
    if rop in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise ValueError(
            f"op=ReduceOp.{rop.name} is not supported by NCCL (ncclRedOp_t has sum, prod, max, "
            f"min and avg only), got it for a {dtype} tensor; use the torch/gloo communicator "
            f"for bitwise reductions, or all_gather and combine locally "
            f"(e.g. torch.bitwise_{rop.name[1:].lower()} over the gathered pieces)"
        )


def _check_avg(rop: ReduceOp, dtype: torch.dtype) -> None:
    if rop is ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(
            f"op=ReduceOp.AVG needs a floating-point tensor, got dtype {dtype}; "
            f"use SUM and divide, or convert to float first"
        )


def _no_reduction(dtype: torch.dtype, version: int) -> str:
    if dtype in _FP8:
        return (
            f"NCCL {format_version(version)} cannot reduce {dtype}: float8 reductions need NCCL >= "
            f"{format_version(FP8_MIN_VERSION)}; convert to float16/bfloat16 first (data movement "
            f"of {dtype} works on any version)"
        )
    return (
        f"NCCL cannot reduce tensors of dtype {dtype} (no ncclDataType_t and no exact "
        f"conversion); convert to a supported type first (float16/bfloat16/float32/float64, "
        f"int8/uint8/int32/uint32/int64/uint64); data movement of {dtype} works as raw bytes"
    )
