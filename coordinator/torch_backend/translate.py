"""Translation of torch.distributed's call arguments into the communicator's.

A :class:`~coordinator.torch_backend.process_group.GroupcoordProcessGroup`
receives what torch's ``ProcessGroup`` methods receive: lists of tensors
(one per device, a relic of multi-GPU processes) and options objects. The
helpers here check those arguments (``TypeError``/``ValueError`` naming the
argument) and turn them into what a
:class:`~device_comms.base.DeviceCommunicator` takes: one tensor, a
:class:`~device_comms.reduce_op.ReduceOp`, split sizes as ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from device_comms.reduce_op import ReduceOp
from device_comms.validation import check_tensor, check_writable

__all__ = [
    "known_reduce_op", "to_reduce_op",
    "single", "tensor_list", "same_dtype", "split_sizes", "copy_pieces",
    "check_whole_and_piece", "root_list", "check_inputs", "check_outputs",
]

_CPU = torch.device("cpu")
_RED = dist.ReduceOp.RedOpType
#: torch's op kinds by our ops (every one of ours has torch's name; PREMUL_SUM is torch's only).
_OPS: dict[Any, ReduceOp] = {_RED.__members__[op.name]: op for op in ReduceOp}
_PREMUL_SUM: Any = _RED.__members__["PREMUL_SUM"]


def _kind(op: Any) -> Any:
    """The ``RedOpType`` of a ``torch.distributed.ReduceOp`` or ``RedOpType`` (else None)."""
    # dist.ReduceOp.SUM and friends are RedOpType members, which also pass
    # isinstance(op, dist.ReduceOp); torch's functions put a ReduceOp in the options.
    if isinstance(op, _RED):
        return op
    if isinstance(op, dist.ReduceOp):
        return cast(Any, op).op
    return None


def known_reduce_op(op: Any) -> ReduceOp | None:
    """Our :class:`ReduceOp` for a ``torch.distributed.ReduceOp`` (or its
    ``RedOpType``) that we carry; None for any other value."""
    kind = _kind(op)
    return _OPS.get(kind) if kind is not None else None


def to_reduce_op(op: Any, arg: str = "op") -> ReduceOp:
    """Our :class:`ReduceOp` for a ``torch.distributed.ReduceOp`` (or its ``RedOpType``).

    Raises:
        TypeError: ``op`` is not a reduction we carry: ``PREMUL_SUM`` (an NCCL
            op whose factor torch keeps in C++; gloo rejects it too) or not a
            ``ReduceOp`` at all.
    """
    rop = known_reduce_op(op)
    if rop is None:
        if _kind(op) == _PREMUL_SUM:
            raise TypeError(f"{arg}=ReduceOp.PREMUL_SUM is not supported by the groupcoord "
                            "backend (nor by gloo); scale the tensor and use SUM")
        raise TypeError(f"{arg} must be a torch.distributed.ReduceOp, got {op!r}")
    return rop


def single(tensors: Any, arg: str) -> torch.Tensor:
    """The one tensor of ``tensors`` (torch passes one tensor per process, in a list).

    Raises:
        TypeError: ``tensors`` is not a list of one tensor.
        ValueError: It holds more than one (a multi-device call).
    """
    ts = tensor_list(tensors, arg)
    if len(ts) != 1:
        raise ValueError(f"{arg} must hold exactly one tensor (one CPU tensor per process), "
                         f"got {len(ts)}")
    return ts[0]


def tensor_list(tensors: Any, arg: str, length: int | None = None) -> list[torch.Tensor]:
    """``tensors`` as a list of tensors (of ``length`` when given).

    Raises:
        TypeError: ``tensors`` is not a sequence of tensors.
        ValueError: It has the wrong length.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{arg} must be a list of torch.Tensor, got {type(tensors).__name__}")
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if length is not None and len(out) != length:
        raise ValueError(f"{arg} must hold {length} tensors (one per rank of the group), "
                         f"got {len(out)}")
    return out


def check_inputs(tensors: Sequence[torch.Tensor], arg: str) -> None:
    """Check that every tensor of ``tensors`` is a dense CPU tensor with data, naming
    ``arg[i]``: a meta, sparse or GPU input would otherwise fail in a local copy
    on this rank alone, with the peers already in the call.

    Raises:
        TypeError: A tensor is sparse, quantised or nested.
        ValueError: A tensor is a meta tensor, not on the CPU, or its storage was freed.
    """
    for i, t in enumerate(tensors):
        check_tensor(t, f"{arg}[{i}]", _CPU)


def check_outputs(tensors: Sequence[torch.Tensor], arg: str) -> None:
    """:func:`check_inputs`, and that the result can be written into each tensor
    (not an expanded view, not an inference tensor outside inference mode).

    Raises:
        TypeError: As :func:`check_inputs`.
        ValueError: As :func:`check_inputs`, or a tensor cannot be written here.
    """
    for i, t in enumerate(tensors):
        check_writable(check_tensor(t, f"{arg}[{i}]", _CPU), f"{arg}[{i}]")


def same_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype, arg: str) -> None:
    """Check every tensor of ``tensors`` has ``dtype``.

    Raises:
        TypeError: One does not (naming ``arg[i]``).
    """
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(f"{arg}[{i}] must have dtype {dtype}, got {t.dtype}")


def split_sizes(sizes: Any, rows: int, world_size: int, arg: str) -> list[int]:
    """Split sizes along dim 0: ``sizes`` as ints, or equal splits of ``rows`` when empty.

    Raises:
        TypeError: ``sizes`` is not a list of ints.
        ValueError: It has the wrong length, a negative entry or does not sum to
            ``rows``; or, when empty, ``rows`` does not divide by ``world_size``.
    """
    if sizes is None or len(sizes) == 0:
        if rows % world_size:
            raise ValueError(f"{arg} is empty, so dim 0 ({rows}) must divide by the group "
                             f"size {world_size}")
        return [rows // world_size] * world_size
    out = []
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{arg}[{i}] must be an int, got {type(s).__name__}")
        if s < 0:
            raise ValueError(f"{arg}[{i}] must be >= 0, got {s}")
        out.append(s)
    if len(out) != world_size:
        raise ValueError(f"{arg} must have {world_size} entries (one per rank), got {len(out)}")
    if sum(out) != rows:
        raise ValueError(f"{arg} sums to {sum(out)} but dim 0 of the tensor is {rows}")
    return out


def copy_pieces(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of 1-D ``flat`` into ``outputs`` (each its numel, reshaped)."""
    offset = 0
    for o in outputs:
        n = o.numel()
        o.copy_(flat[offset:offset + n].view(o.shape))
        offset += n


def check_whole_and_piece(whole: torch.Tensor, whole_arg: str, piece: torch.Tensor,
                          piece_arg: str, world_size: int) -> None:
    """Check a gathered or scattered pair: ``whole`` (an all-gather's output, a
    reduce-scatter's input) holds ``world_size`` times ``piece``'s elements, of
    ``piece``'s dtype (both already checked to be tensors).

    Raises:
        TypeError: The dtypes differ.
        ValueError: The element counts do not fit.
    """
    if whole.dtype != piece.dtype:
        raise TypeError(f"{whole_arg} must have {piece_arg}'s dtype {piece.dtype}, "
                        f"got {whole.dtype}")
    if whole.numel() != piece.numel() * world_size:
        raise ValueError(f"{whole_arg} must have group size ({world_size}) x {piece_arg}'s "
                         f"{piece.numel()} elements, got {whole.numel()}")


def root_list(lists: Any, outer_arg: str, inner_arg: str, world_size: int,
              like: torch.Tensor) -> list[torch.Tensor]:
    """The root's tensors of a gather or scatter: ``lists`` must hold one list of
    ``world_size`` tensors, each of ``like``'s dtype and element count.

    Raises:
        TypeError: Not a list of tensors, or a dtype differs.
        ValueError: The wrong number of lists or tensors, or an element count differs.
    """
    if not isinstance(lists, Sequence) or len(lists) != 1:
        raise ValueError(f"{outer_arg} must be a list holding one list of tensors on the root")
    ts = tensor_list(lists[0], inner_arg, world_size)
    same_dtype(ts, like.dtype, inner_arg)
    for j, t in enumerate(ts):
        if t.numel() != like.numel():
            raise ValueError(f"{inner_arg}[{j}] must have {like.numel()} elements, "
                             f"got {t.numel()}")
    return ts
