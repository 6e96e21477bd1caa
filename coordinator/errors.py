"""Errors of :mod:`coordinator`: the project's one family, plus its own kinds.

The family is defined once in :mod:`shm_broadcast.errors` and re-exported
here, so ``from coordinator import CommTimeout`` is the same class that a queue
or a shared-memory collective raises. Errors are mixed with the builtin they
resemble: ``except TimeoutError`` catches :class:`CommTimeout` and
``except RuntimeError`` catches :class:`NotInitializedError`.
"""

from __future__ import annotations

from device_comms.errors import (
    BrokenCommunicator,
    CommunicatorUnavailable,
    ConcurrentCallError,
    KernelCompileError,
    NcclError,
)
from shm_broadcast.errors import (
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    DecodeError,
    EncodeError,
    GroupCoordError,
    PeerDiedError,
    PeerRejectedError,
    QueueRoleError,
    SegmentError,
    ShmSpaceError,
)

__all__ = [
    "GroupCoordError",
    "CommTimeout",
    "PeerDiedError",
    "ClosedError",
    "CollectiveMismatch",
    "PeerRejectedError",
    "DecodeError",
    "EncodeError",
    "QueueRoleError",
    "SegmentError",
    "ShmSpaceError",
    "CommunicatorUnavailable",
    "BrokenCommunicator",
    "ConcurrentCallError",
    "NcclError",
    "KernelCompileError",
    "NotInitializedError",
    "RankFailedError",
    "RankDiedError",
    "DistributedTimeout",
    "StoreConnectionError",
    "AuthenticationError",
]


class NotInitializedError(GroupCoordError, RuntimeError, AssertionError):
    """A getter was called before the state it returns was initialised.

    Also an ``AssertionError``, which vLLM's getters raise there: code that
    probes for an optional group with ``except AssertionError`` (vLLM's
    ``try: get_dcp_group() ... except AssertionError: size = 1``) works the same.
    """


class RankFailedError(GroupCoordError, RuntimeError):
    """A rank of :func:`coordinator.testing.run_distributed` failed.

    Attributes:
        rank: The rank that failed first.
        remote_traceback: The traceback text printed in that rank ('' if it died).
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message, peers=(rank,))
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.rank, self.remote_traceback))


class RankDiedError(RankFailedError):
    """A rank process exited (crash, signal, ``os._exit``) without returning a result."""


class DistributedTimeout(CommTimeout):
    """:func:`coordinator.testing.run_distributed` ran past its timeout.

    Attributes:
        pending_ranks: Ranks that had not returned when time ran out.
    """

    def __init__(self, message: str, pending_ranks: list[int]) -> None:
        super().__init__(message, peers=pending_ranks)
        self.pending_ranks = pending_ranks

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.pending_ranks))


class StoreConnectionError(GroupCoordError, ConnectionError):
    """A stateless group lost its connection to the store host (rank 0)."""


class AuthenticationError(GroupCoordError, PermissionError):
    """A value read from a shared channel failed authentication and was not decoded.

    Raised by :class:`~coordinator.stateless.stateless_group.StatelessProcessGroup` when
    no authentic value arrived under one of its keys in time (a value there failed
    authentication under the group's secret and session: written by a process that
    does not hold the secret, altered, moved from another key, or sealed in another
    session), when the group's secret cannot be established, and when the ranks
    cannot agree on a session: a session record was refused, or some rank verified a
    record of rank 0 replayed from (or left by) an earlier incarnation of the group.

    Attributes:
        rejected: How many values were rejected before this error was raised.
    """

    def __init__(self, message: str, *, rejected: int = 0, queue: str | None = None,
                 peers: list[int] | tuple[int, ...] | None = None) -> None:
        super().__init__(message, queue=queue, peers=peers)
        self.rejected = rejected

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_auth_error, (str(self), self.rejected, self.queue, self.peers))


def _rebuild_auth_error(message: str, rejected: int, queue: str | None,
                        peers: tuple[object, ...]) -> AuthenticationError:
    return AuthenticationError(message, rejected=rejected, queue=queue, peers=list(peers))  # type: ignore[arg-type]
