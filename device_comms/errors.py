"""Errors of :mod:`device_comms`: the project's family plus NCCL and kernel errors.

The family (root, timeout, dead peer, closed, mismatch) is defined once in
:mod:`shm_broadcast.errors` and re-exported here; ``DeviceCommError``,
``CollectiveTimeout`` and ``CommunicatorClosed`` are other names of
:class:`GroupCoordError`, :class:`CommTimeout` and :class:`ClosedError`.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from shm_broadcast.errors import (
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    ConcurrentCallError,
    DecodeError,
    EncodeError,
    GroupCoordError,
    PeerDiedError,
    PeerRejectedError,
)

__all__ = [
    "GroupCoordError",
    "DeviceCommError",
    "CommunicatorUnavailable",
    "CommTimeout",
    "CollectiveTimeout",
    "PeerDiedError",
    "ClosedError",
    "CommunicatorClosed",
    "CollectiveMismatch",
    "PeerRejectedError",
    "DecodeError",
    "EncodeError",
    "BrokenCommunicator",
    "ConcurrentCallError",
    "NcclError",
    "KernelCompileError",
    "add_note",
    "with_own_arguments",
]

# The family is defined once, in the bottom package; these are the same classes.
DeviceCommError = GroupCoordError
CollectiveTimeout = CommTimeout
CommunicatorClosed = ClosedError


class CommunicatorUnavailable(GroupCoordError, LookupError):
    """No registered communicator is available for the requested name/device."""


class BrokenCommunicator(GroupCoordError, RuntimeError):
    """An earlier failure (dead peer, timeout) left the communicator unusable."""


class NcclError(GroupCoordError, RuntimeError):
    """An NCCL call returned a result other than ``ncclSuccess``.

    Attributes:
        call: The NCCL function that failed (``"ncclAllReduce"``...).
        code: Its ``ncclResult_t`` value.
        detail: NCCL's own description of ``code`` (``ncclGetErrorString``).
    """

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        super().__init__(f"{call} failed with NCCL error {code}: {detail or 'no description'}")
        self.call, self.code, self.detail = call, code, detail

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the custom __init__ picklable across processes
        return (type(self), (self.call, self.code, self.detail))


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11 on); on 3.10 the note goes
    into the same ``__notes__`` list, which that version's tracebacks do not print."""
    adder = getattr(error, "add_note", None)
    if adder is not None:
        adder(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]  # 3.10


def translate_backend_error(e: BaseException, where: str) -> BaseException:
    """Turn a torch.distributed backend failure into this family's error.

    Args:
        e: The exception a backend raised (usually ``RuntimeError`` from gloo).
        where: Description of the call: group name, rank and operation.

    Returns:
        A :class:`CollectiveTimeout` for timeouts, a :class:`PeerDiedError` for
        closed connections, or ``e`` itself when it is neither.
    """
    if isinstance(e, GroupCoordError) or not isinstance(e, RuntimeError):
        return e
    msg = str(e)
    first = msg.splitlines()[0] if msg else type(e).__name__
    low = msg.lower()
    if "timed out" in low or "timeout" in low:
        return CommTimeout(
            f"{where}: a peer did not answer in time ({first}). Check that every rank of "
            f"the group calls the same collectives in the same order, and that no rank died."
        )
    closed = ("connection closed", "connection reset", "broken pipe", "eof", "connection refused")
    if any(marker in low for marker in closed):
        return PeerDiedError(
            f"{where}: a peer closed its connection, most likely it exited or crashed "
            f"({first}). Check the other ranks' logs."
        )
    return e


class KernelCompileError(GroupCoordError, RuntimeError):
    """NVRTC could not compile a kernel source; the message holds NVRTC's log.

    Attributes:
        log: The compiler log (empty when NVRTC gave none).
    """

    log: str = ""


def with_own_arguments(error: CollectiveMismatch, args: tuple[object, ...]) -> CollectiveMismatch:
    """``error`` with what this rank passed to the call appended to its message
    (tensors as dtype and shape), so a digest of sizes in the message can be
    read against the arguments; done once per error."""
    if isinstance(error, PeerRejectedError) or getattr(error, "own_arguments", None):
        return error
    own = ", ".join(_describe(arg) for arg in args)
    error.own_arguments = own  # type: ignore[attr-defined]  # an extra, read back above
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} (this rank passed: {own})", *error.args[1:])
    return error


def _describe(arg: object) -> str:
    if isinstance(arg, torch.Tensor):
        return f"{str(arg.dtype).removeprefix('torch.')} tensor of shape {tuple(arg.shape)}"
    if isinstance(arg, enum.Enum):
        return arg.name
    return f"{arg!r:.80}"
