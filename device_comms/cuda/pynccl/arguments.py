"""What :class:`~device_comms.cuda.pynccl.PyNcclCommunicator` accepts, checked before NCCL runs.

Every operation checks its arguments here before it enqueues anything: a
mistake raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong
device, layout, size or rank) naming the argument, on the rank that made it,
instead of a hang or a corrupt result in NCCL. Sizes agreeing *across* ranks
are not checked (NCCL itself does not; see the communicator's docstring).
"""

from __future__ import annotations

from typing import Any

import torch

from device_comms import validation
from device_comms.errors import CommunicatorUnavailable

__all__ = ["check_device", "check_operand", "check_same", "check_rows", "check_peer"]


def check_device(device: Any, injected: bool) -> torch.device:
    """The communicator's device: a CUDA device (any device with an ``injected`` library).

    An int is a CUDA index; ``"cuda"`` without an index means the current device.

    Raises:
        TypeError: ``device`` is not a torch.device, str or int.
        ValueError: Not a CUDA device while the library is NCCL's own.
        CommunicatorUnavailable: A CUDA device without an index where CUDA
            cannot be used (torch built without it, no driver or GPU).
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device must be a torch.device, a str or an int, got {type(device).__name__}"
        )
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda" and not injected:
        raise ValueError(f"device must be a CUDA device for NCCL, got {dev}")
    if dev.type == "cuda":
        try:
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            elif not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
        except (AssertionError, RuntimeError) as e:  # torch without CUDA, or no driver/GPU
            raise CommunicatorUnavailable(
                f"device {device!r} needs CUDA, which this process cannot use: {e}") from e
        count = torch.cuda.device_count()
        if not 0 <= dev.index < count:
            raise ValueError(f"device must be one of this process's {count} CUDA device(s), "
                             f"got {dev}")
    return dev


def check_operand(t: Any, arg: str, device: torch.device) -> torch.Tensor:
    """Return ``t`` if it is a contiguous tensor on ``device``.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``t`` is on another device or not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(
            f"{arg} must be on this communicator's device {device}, "
            f"got a tensor on {t.device}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{arg} must be contiguous (call .contiguous() first), got strides {t.stride()}"
        )
    return t


def check_same(a: torch.Tensor, b: torch.Tensor, a_arg: str, b_arg: str, numel: int,
               what: str | None = None) -> None:
    """``a`` must have ``b``'s dtype and ``numel`` elements (``what`` says where it comes from).

    Raises:
        TypeError: The dtypes differ.
        ValueError: ``a`` has another number of elements.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"{a_arg} must have {b_arg}'s dtype {b.dtype}, got {a.dtype}")
    if a.numel() != numel:
        want = f"{what} = {numel}" if what else f"{numel}"
        raise ValueError(
            f"{a_arg} must have {want} elements, got {a.numel()} (shape {tuple(a.shape)})"
        )


def check_rows(piece: torch.Tensor, whole: torch.Tensor, sizes: Any, piece_arg: str,
               whole_arg: str, gathered: str, rank: int, world_size: int) -> list[int]:
    """Checks of the uneven ops: rows of ``piece`` = ``sizes[rank]``, of ``whole`` = sum.

    Returns:
        ``sizes`` as a list of ints.

    Raises:
        TypeError: Bad ``sizes``, or the dtypes differ.
        ValueError: Bad ``sizes``, a 0-dim tensor, or shapes that do not match.
    """
    sz = validation.check_sizes(sizes, world_size)
    if piece.dtype != whole.dtype:
        raise TypeError(
            f"{piece_arg} must have {whole_arg}'s dtype {whole.dtype}, got {piece.dtype}"
        )
    for t, arg in ((piece, piece_arg), (whole, whole_arg)):
        if t.dim() == 0:
            raise ValueError(
                f"{arg} must have at least one dimension (rows along dim 0), got a 0-dim tensor"
            )
    if piece.shape[1:] != whole.shape[1:]:
        raise ValueError(
            f"{piece_arg} and {whole_arg} must match beyond dim 0, got shapes "
            f"{tuple(piece.shape)} and {tuple(whole.shape)}"
        )
    if piece.shape[0] != sz[rank]:
        raise ValueError(
            f"{piece_arg}.shape[0] must be sizes[{rank}] = {sz[rank]} on rank "
            f"{rank}, got {piece.shape[0]}"
        )
    if whole.shape[0] != sum(sz):
        raise ValueError(
            f"{gathered}.shape[0] must be sum(sizes) = {sum(sz)}, got {whole.shape[0]}"
        )
    return sz


def check_peer(peer: Any, arg: str, rank: int, world_size: int) -> int:
    """Return ``peer`` as an int if it is a group rank other than ``rank`` (point-to-point).

    Raises:
        TypeError: ``peer`` is not an int.
        ValueError: ``peer`` is out of range or this rank.
    """
    checked = validation.check_rank(peer, world_size, arg)
    if checked == rank:
        raise ValueError(
            f"{arg}={checked} is this rank; point-to-point needs another rank of the group"
        )
    return checked
