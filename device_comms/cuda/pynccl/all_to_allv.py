"""Uneven all-to-all on NCCL: one ``ncclSend``/``ncclRecv`` per peer, fused in one group.

Rows move as bytes (any dtype). For each peer ``r`` (never this rank) the
group holds a send of this rank's ``send_sizes[r]`` rows and a receive of
``recv_sizes[r]`` rows into their place in the output; empty ones are left
out (NCCL matches a send with a receive of the same byte count, so both
sides skip a pair alike when the sizes agree). This rank's own rows are a
stream-ordered device copy. Everything is enqueued on one stream with no
synchronisation, so a CUDA graph captures it (the sizes are then fixed in the
graph). The sizes of the two sides are not compared here: NCCL does not, and a
disagreement hangs or corrupts; :class:`~device_comms.cuda.communicator.CudaCommunicator`
agrees on them over the CPU group first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from device_comms import validation
from device_comms.cuda.pynccl.arguments import check_operand
from device_comms.cuda.pynccl.types import DATATYPE_CODES, bytes_view

__all__ = ["all_to_allv"]

_UINT8 = DATATYPE_CODES["ncclUint8"]


def check_arguments(
    out: Any, in_: Any, send_sizes: Any, recv_sizes: Any, rank: int, world_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Checks before anything is enqueued; returns the operands and sizes as lists.

    Raises:
        TypeError: Not tensors, dtypes differ, bad size types.
        ValueError: Wrong device, not contiguous, 0-dim, row shapes differ,
            sizes of the wrong length or sum, or ``send_sizes[rank]`` !=
            ``recv_sizes[rank]`` (this rank's rows to itself).
    """
    x, o = check_operand(in_, "in_", device), check_operand(out, "out", device)
    send = validation.check_sizes(send_sizes, world_size, "send_sizes", total=None)
    recv = validation.check_sizes(recv_sizes, world_size, "recv_sizes", total=None)
    if o.dtype != x.dtype:
        raise TypeError(f"out must have in_'s dtype {x.dtype}, got {o.dtype}")
    if x.dim() == 0 or o.dim() == 0:
        raise ValueError("in_ and out must have at least one dimension (rows along dim 0)")
    if x.shape[1:] != o.shape[1:]:
        raise ValueError(f"in_ and out must match beyond dim 0, got shapes "
                         f"{tuple(x.shape)} and {tuple(o.shape)}")
    if x.shape[0] != sum(send):
        raise ValueError(f"in_.shape[0] must be sum(send_sizes) = {sum(send)}, got {x.shape[0]}")
    if o.shape[0] != sum(recv):
        raise ValueError(f"out.shape[0] must be sum(recv_sizes) = {sum(recv)}, got {o.shape[0]}")
    if send[rank] != recv[rank]:
        raise ValueError(f"send_sizes[{rank}] ({send[rank]}) and recv_sizes[{rank}] "
                         f"({recv[rank]}) are this rank's rows to itself and must be equal")
    return o, x, send, recv


def all_to_allv(
    lib: Any, comm: Any, grouped: Any, out: torch.Tensor, in_: torch.Tensor,
    send: Sequence[int], recv: Sequence[int], rank: int, stream: int | None,
) -> None:
    """Enqueue the exchange (arguments already checked by :func:`check_arguments`).

    Args:
        lib: The NCCL library binding.
        comm: The ``ncclComm_t``.
        grouped: A context manager that wraps its body in ``ncclGroupStart``/``End``.
        out: The result, ``sum(recv)`` rows.
        in_: This rank's rows, ``sum(send)`` of them.
        send: Rows of ``in_`` for each rank.
        recv: Rows from each rank.
        rank: This rank.
        stream: The raw stream to enqueue on.
    """
    row = math.prod(in_.shape[1:]) * in_.element_size()
    if not row:
        return
    src, dst = bytes_view(in_, "in_"), bytes_view(out, "out")
    soff, roff = _offsets(send), _offsets(recv)
    if send[rank]:
        dst[roff[rank] * row : (roff[rank] + recv[rank]) * row].copy_(
            src[soff[rank] * row : (soff[rank] + send[rank]) * row])
    pairs = [r for r in range(len(send)) if r != rank and (send[r] or recv[r])]
    if not pairs:
        return
    with grouped():
        for r in pairs:
            if send[r]:
                lib.send(src.data_ptr() + soff[r] * row, send[r] * row, _UINT8, r, comm, stream)
            if recv[r]:
                lib.recv(dst.data_ptr() + roff[r] * row, recv[r] * row, _UINT8, r, comm, stream)


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out
