"""What every rank writes beside a step of the shared-memory engine: its signature.

A collective's first step carries two int64 words that every rank compares
(:meth:`~device_comms.cpu_shm.sync.StepSync.step`): :func:`signature` packs the op
kind, dtype, reduce op and root (one byte each, the root in the rest), and the
*size key* covers the shape and layout arguments (:func:`shape_key` for a
plain shape, readable in mismatch messages when small). Two kinds are never a
real call's: :data:`REJECTED` (a rank that refused its own arguments) and
:data:`FAILED` (an error relayed from elsewhere). Codes are stable across
processes and torch versions (new dtypes are appended).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from device_comms.reduce_op import ReduceOp

__all__ = [
    "signature", "shape_key", "shape_of_key", "dtype_code", "dtype_of", "op_of",
    "describe_signature", "KIND_NAMES", "SHAPE_KEYED_KINDS", "REJECTED", "FAILED",
]

KIND_NAMES = {
    1: "all_reduce", 2: "all_gather", 3: "all_gatherv", 4: "reduce_scatter",
    5: "reduce_scatterv", 6: "broadcast", 7: "gather", 8: "reduce",
    9: "scatter", 10: "all_to_all", 11: "send/recv", 12: "all_to_allv",
    13: "all_gatherv_rows", 14: "barrier",
}
_KIND_CODES = {v: k for k, v in KIND_NAMES.items()}
#: Signature of a step taken by a rank that rejected its own arguments (kind 0xFF).
REJECTED = 0xFF
#: Signature of a step that relays an error found elsewhere (kind 0xFE; see
#: :meth:`StepSync.relay`): a node leader passing on what another node's ranks did.
FAILED = 0xFE
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
] + [  # newer bit containers, when this torch has them (codes stay stable: appended)
    dt for dt in (
        getattr(torch, name, None)
        for name in (
            "complex32", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
            "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        )
    ) if isinstance(dt, torch.dtype)
]
_DTYPE_CODES = {d: i + 1 for i, d in enumerate(_DTYPES)}
_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}

_OPS = {v: k for k, v in _OP_CODES.items()}


def signature(
    kind: str, dtype: torch.dtype | None, op: ReduceOp | None = None, root: int = 0
) -> int:
    """Pack what must agree across ranks (op kind, dtype, reduce op, root) into an int64.

    ``dtype=None`` (code 0) stands for "not known to every rank" (scatter's receivers).
    """
    return (
        _KIND_CODES[kind]
        | (dtype_code(dtype) if dtype is not None else 0) << 8
        | (_OP_CODES[op] if op is not None else 0) << 16
        | root << 24
    )


def dtype_code(dtype: torch.dtype) -> int:
    """A stable small code for ``dtype`` (63: a dtype without a code)."""
    return _DTYPE_CODES.get(dtype, 63)


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of :func:`dtype_code` ``code`` (None: unknown or no code)."""
    return _DTYPES[code - 1] if 0 < code <= len(_DTYPES) else None


def op_of(code: int) -> ReduceOp | None:
    """The reduce op packed in a signature's op byte (None: not a reduction)."""
    return _OPS.get(code)


def describe_signature(sig_a: int, sig_b: int) -> str:
    """Human-readable form of a packed signature (for mismatch messages)."""
    kind = KIND_NAMES.get(sig_a & 0xFF, f"op#{sig_a & 0xFF}")
    code = (sig_a >> 8) & 0xFF
    dtype = _DTYPES[code - 1] if 0 < code <= len(_DTYPES) else "?"
    parts = [kind, f"dtype={dtype}"]
    op = _OPS.get((sig_a >> 16) & 0xFF)
    if op is not None:
        parts.append(f"op={op.name}")
    if kind in ("broadcast", "gather", "reduce"):
        parts.append(f"root={sig_a >> 24}")
    shape = shape_of_key(sig_b) if kind in SHAPE_KEYED_KINDS else None
    # A key that is not a readable shape is a digest of the sizes and layout
    # arguments; its last hex digits tell two calls apart in a message.
    parts.append(f"shape={shape}" if shape is not None else f"sizes #{sig_b & 0xFFFFFF:06x}")
    return "(" + ", ".join(parts) + ")"


# Kinds whose size key is a shape_key (the others hash their layout arguments too).
SHAPE_KEYED_KINDS = frozenset({"all_reduce", "reduce", "broadcast", "send/recv"})
_HASHED = 1 << 62  # flag of a shape_key that is a hash
_DIM_BITS = 20


def shape_key(shape: Sequence[int]) -> int:
    """A non-negative int64 that tells shapes apart, readable when the shape is small.

    Up to three dims below 2**20 are packed exactly (dims 20 bits each, then
    ``(ndim - 1) % 4`` in bits 60-61, so a 1-D shape's key is its length), and
    a mismatch message can print the shape; any other shape is a hash of its
    dims with bit 62 set. The same in every process.
    """
    if len(shape) <= 3 and all(0 <= s < 1 << _DIM_BITS for s in shape):
        k = ((len(shape) - 1) % 4) << 60
        for i, s in enumerate(shape):
            k |= s << (_DIM_BITS * i)
        return k
    return (hash(tuple(shape)) & ((1 << 60) - 1)) | _HASHED


def shape_of_key(key: int) -> tuple[int, ...] | None:
    """The shape a :func:`shape_key` packed exactly, else None."""
    if key < 0 or key & _HASHED:
        return None
    mask = (1 << _DIM_BITS) - 1
    ndim = (((key >> 60) & 3) + 1) % 4
    return tuple((key >> (_DIM_BITS * i)) & mask for i in range(ndim))
