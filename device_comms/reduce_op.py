"""Reduction operators, their validation and a local reference reduction."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReduceOp", "check_reduce_op", "reduce_local", "BITWISE_OPS", "NO_ARITHMETIC"]


class ReduceOp(enum.Enum):
    """Element-wise reductions understood by every communicator."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def to_torch(self) -> torch.distributed.ReduceOp:
        """The matching ``torch.distributed.ReduceOp`` (AVG maps to SUM; divide after)."""
        import torch.distributed as dist

        return {  # type: ignore[return-value]  # torch's stubs type the members as RedOpType
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.AVG: dist.ReduceOp.SUM,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.BAND: dist.ReduceOp.BAND,
            ReduceOp.BOR: dist.ReduceOp.BOR,
            ReduceOp.BXOR: dist.ReduceOp.BXOR,
        }[self]


BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_INTEGRAL = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)
# Bit containers torch has no arithmetic kernels for: they can be moved, not reduced.
NO_ARITHMETIC = frozenset(
    dt
    for dt in (
        getattr(torch, name, None)
        for name in (
            "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
            "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
            "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
            "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
            "int1", "int2", "int3", "int4", "int5", "int6", "int7",
        )
    )
    if isinstance(dt, torch.dtype)
)


def check_reduce_op(op: object, dtype: torch.dtype, arg: str = "op") -> ReduceOp:
    """Validate ``op`` for tensors of ``dtype`` and return it as a :class:`ReduceOp`.

    Accepts a :class:`ReduceOp`, its name (``"sum"``/``"SUM"``), or a
    ``torch.distributed.ReduceOp``.

    Raises:
        TypeError: ``op`` is not a reduction, a bitwise op is used on a
            non-integer dtype, AVG on an integer dtype, MIN/MAX/PRODUCT on a
            complex dtype, or ``dtype`` has no
            arithmetic in torch (``uint16/32/64``, ``float8_*``, ``float4_*``,
            ``bits*``, and the sub-byte ``uint1-7``/``int1-7``).
    """
    rop = _coerce(op, arg)
    if dtype in NO_ARITHMETIC:
        raise TypeError(
            f"{arg}=ReduceOp.{rop.name} cannot reduce a {dtype} tensor: torch has no "
            f"arithmetic for that dtype; convert it first (e.g. .to(torch.float32))"
        )
    if rop in BITWISE_OPS and dtype not in _INTEGRAL:
        raise TypeError(
            f"{arg}=ReduceOp.{rop.name} needs an integer or bool tensor, got dtype {dtype}; "
            f"use SUM/MIN/MAX/PRODUCT/AVG for floating point"
        )
    if dtype.is_complex and rop in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        raise TypeError(
            f"{arg}=ReduceOp.{rop.name} is not supported for complex dtype {dtype} "
            f"(complex numbers have no order, and torch.distributed rejects a complex "
            f"PRODUCT); use SUM/AVG, or reduce .real/.imag or torch.view_as_real separately"
        )
    if rop is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"{arg}=ReduceOp.AVG needs a floating-point tensor, got dtype {dtype}; "
            f"use SUM and divide, or convert to float first"
        )
    if rop is ReduceOp.AVG and dtype == torch.complex32:
        raise TypeError(
            f"{arg}=ReduceOp.AVG cannot reduce a {dtype} tensor: torch cannot divide "
            f"that dtype; use SUM and divide after .to(torch.complex64)"
        )
    return rop


def _coerce(op: object, arg: str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    else:
        try:
            import torch.distributed as dist

            if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
                name = str(op).rsplit(".", 1)[-1].upper()
                if name == "PREMUL_SUM":
                    raise TypeError(f"{arg}: PREMUL_SUM is not supported")
                return ReduceOp[name]
        except (ImportError, KeyError):
            pass
    names = ", ".join(m.name for m in ReduceOp)
    raise TypeError(f"{arg} must be a ReduceOp ({names}), got {op!r}")


def reduce_local(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce ``tensors`` element-wise in list order (a fixed, rank-independent order).

    The reference for the shared-memory collectives' arithmetic. Floating-point
    SUM/AVG accumulate left to right, so any rank that reduces the same list
    gets a bitwise identical result.

    Raises:
        TypeError: ``tensors`` is not a sequence of tensors, or ``op`` is not a
            reduction valid for their dtype (see :func:`check_reduce_op`).
        ValueError: ``tensors`` is empty, or its tensors differ in shape, dtype
            or device.
    """
    op = check_reduce_op(op, _same_kind(tensors).dtype)
    acc = tensors[0].clone()
    for t in tensors[1:]:
        _accumulate_(acc, t, op)
    if op is ReduceOp.AVG:
        acc.div_(len(tensors))
    return acc


def _same_kind(tensors: Any) -> torch.Tensor:
    """The first of ``tensors`` once every one is a tensor of its shape, dtype and device."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a sequence of torch.Tensor, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError("tensors must be a non-empty sequence")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
    first: torch.Tensor = tensors[0]
    for i, t in enumerate(tensors[1:], 1):
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                f"tensors[{i}] must match tensors[0] in shape, dtype and device: got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}, tensors[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return first


def _accumulate_(acc: torch.Tensor, t: torch.Tensor, op: ReduceOp) -> None:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if acc.dtype == torch.bool:
            acc.logical_or_(t)
        else:
            acc.add_(t)
    elif op is ReduceOp.PRODUCT:
        if acc.dtype == torch.bool:
            acc.logical_and_(t)
        else:
            acc.mul_(t)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, t, out=acc)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, t, out=acc)
    elif op is ReduceOp.BAND:
        acc.bitwise_and_(t)
    elif op is ReduceOp.BOR:
        acc.bitwise_or_(t)
    elif op is ReduceOp.BXOR:
        acc.bitwise_xor_(t)
    else:  # pragma: no cover
        raise TypeError(f"unknown op {op!r}")
