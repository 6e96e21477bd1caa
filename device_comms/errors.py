"""The exception family of :mod:`device_comms`."""

from __future__ import annotations

__all__ = [
    "DeviceCommError",
    "CommunicatorUnavailable",
    "CollectiveTimeout",
    "PeerDiedError",
    "CollectiveMismatch",
    "PeerRejectedError",
    "BrokenCommunicator",
    "CommunicatorClosed",
    "NcclError",
    "KernelCompileError",
]


class DeviceCommError(Exception):
    """Base class of every error raised on purpose by ``device_comms``."""


class CommunicatorUnavailable(DeviceCommError, LookupError):
    """No registered communicator is available for the requested name/device."""


class CollectiveTimeout(DeviceCommError, TimeoutError):
    """A collective did not complete in time; the message names group, op and peer."""


class PeerDiedError(DeviceCommError, RuntimeError):
    """A peer process of the group exited while this rank waited on it."""


class CollectiveMismatch(DeviceCommError, ValueError):
    """Ranks called the same collective with incompatible arguments (shape, dtype, op)."""


class PeerRejectedError(CollectiveMismatch):
    """A peer rejected its own arguments of the collective this rank was in.

    Raised on the ranks whose call was valid, promptly, instead of leaving them
    waiting for a rank that raised ``ValueError``/``TypeError`` locally.
    Nothing was exchanged and the communicator stays usable.

    Attributes:
        rank: Group rank that rejected the call.
        op: The operation this rank was running.
        reason: The rejecting rank's error message (may be empty).
    """

    def __init__(self, group: str, op: str, rank: int, reason: str) -> None:
        self.rank, self.op, self.reason = rank, op, reason
        super().__init__(
            f"group {group!r}, op {op}: rank {rank} rejected its arguments of this collective "
            f"({reason or 'no reason given'}); this call was abandoned on every rank, nothing "
            f"was exchanged and the group stays usable. Fix the call on rank {rank}."
        )

    def __reduce__(self) -> tuple:  # keeps the custom __init__ picklable across processes
        return (_rebuild_rejected, (str(self), self.rank, self.op, self.reason))


def _rebuild_rejected(msg: str, rank: int, op: str, reason: str) -> "PeerRejectedError":
    e = PeerRejectedError.__new__(PeerRejectedError)
    Exception.__init__(e, msg)
    e.rank, e.op, e.reason = rank, op, reason
    return e


class BrokenCommunicator(DeviceCommError, RuntimeError):
    """An earlier failure (dead peer, timeout) left the shared-memory engine unusable."""


class CommunicatorClosed(DeviceCommError, RuntimeError):
    """A collective was called on a communicator after ``destroy()``/``close()``."""


class NcclError(DeviceCommError, RuntimeError):
    """An NCCL call returned a result other than ``ncclSuccess``.

    Attributes:
        call: The NCCL function that failed (``"ncclAllReduce"``...).
        code: Its ``ncclResult_t`` value.
        detail: NCCL's own description of ``code`` (``ncclGetErrorString``).
    """

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call, self.code, self.detail = call, code, detail
        super().__init__(
            f"{call} failed with NCCL error {code}: {detail or 'no description'}"
        )

    def __reduce__(self) -> tuple:  # keeps the custom __init__ picklable across processes
        return (type(self), (self.call, self.code, self.detail))


def translate_backend_error(e: BaseException, where: str) -> BaseException:
    """Turn a torch.distributed backend failure into this family's error.

    Args:
        e: The exception a backend raised (usually ``RuntimeError`` from gloo).
        where: Description of the call: group name, rank and operation.

    Returns:
        A :class:`CollectiveTimeout` for timeouts, a :class:`PeerDiedError` for
        closed connections, or ``e`` itself when it is neither.
    """
    if isinstance(e, DeviceCommError) or not isinstance(e, RuntimeError):
        return e
    msg = str(e)
    first = msg.splitlines()[0] if msg else type(e).__name__
    low = msg.lower()
    if "timed out" in low or "timeout" in low:
        return CollectiveTimeout(
            f"{where}: a peer did not answer in time ({first}). Check that every rank of "
            f"the group calls the same collectives in the same order, and that no rank died."
        )
    if any(
        k in low
        for k in ("connection closed", "connection reset", "broken pipe", "eof", "connection refused")
    ):
        return PeerDiedError(
            f"{where}: a peer closed its connection, most likely it exited or crashed "
            f"({first}). Check the other ranks' logs."
        )
    return e


class KernelCompileError(DeviceCommError, RuntimeError):
    """NVRTC could not compile a kernel source; the message holds NVRTC's log.

    Attributes:
        log: The compiler log (empty when NVRTC gave none).
    """

    log: str = ""
