"""The exception family of :mod:`device_comms`."""

from __future__ import annotations

__all__ = [
    "DeviceCommError",
    "CommunicatorUnavailable",
    "CollectiveTimeout",
    "PeerDiedError",
    "CollectiveMismatch",
    "BrokenCommunicator",
    "CommunicatorClosed",
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


class BrokenCommunicator(DeviceCommError, RuntimeError):
    """An earlier failure (dead peer, timeout) left the shared-memory engine unusable."""


class CommunicatorClosed(DeviceCommError, RuntimeError):
    """A collective was called on a communicator after ``destroy()``/``close()``."""


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
