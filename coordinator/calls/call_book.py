"""The bookkeeping of a group's calls: their numbers, the group's closed state, and
the explanation of a call whose wait failed.

Every public call of a group gets a number, 1, 2, ... per group and rank. The
book counts the two kinds of calls apart: collective calls (``collectives``;
the same count on every rank of a correct program, so it stamps the
message-queue broadcasts, :mod:`coordinator.group.broadcast_stamps`, and
numbers the communicator's calls) and point-to-point calls (``p2p_calls``;
which ranks make them differs). A call's number is their sum when it begins
(``calls``). A call whose wait fails is explained by
the book's :class:`~coordinator.calls.call_errors.CallErrors` (group, op, call
number, the ranks that did not arrive). Once the group is closed, a call that
begins raises :class:`~coordinator.errors.NotInitializedError` and one still
running fails with :class:`~coordinator.errors.ClosedError`.

The busiest calls (``all_reduce`` and friends) number themselves inline with
the statements :meth:`CallBook.run` runs, so that they pay no function layer
for it::

    book.collectives = n = book.collectives + 1     # a point-to-point call: p2p_calls
    seq = n + book.p2p_calls                        # ... + book.collectives
    started = monotonic()
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import Any, TypeVar

from coordinator.calls.call_errors import WAIT_ERRORS, CallErrors
from coordinator.errors import NotInitializedError, PeerDiedError

__all__ = ["CallBook", "destroyed_msg"]

_R = TypeVar("_R")  # what a numbered call returns


def destroyed_msg(name: str, op: str) -> str:
    """The error message for using a destroyed group."""
    return f"GroupCoordinator {name!r} was destroyed; {op} needs a live group (create a new one)"


class CallBook:
    """The numbers, closed state and failed-wait explanation of one group's calls.

    Args:
        name: The group's unique name.
        rank: This process's group rank.
        world_size: The group's size.
        timeout: The group's timeout in seconds.

    Attributes:
        collectives: Collective calls made so far on this rank.
        p2p_calls: Point-to-point calls made so far on this rank.
        errors: Explains failed waits; learns the peers' processes at
            :meth:`learn_peers`.
    """

    def __init__(self, name: str, rank: int, world_size: int, timeout: float) -> None:
        self.name = name
        self.collectives = 0
        self.p2p_calls = 0
        self.errors = CallErrors(name, rank, world_size, timeout)

    @property
    def calls(self) -> int:
        """Calls made so far on this rank; the next is number ``calls + 1``."""
        return self.collectives + self.p2p_calls

    @property
    def closed(self) -> bool:
        """Whether the group was closed (:meth:`close`)."""
        return self.errors.destroyed

    def learn_peers(self, cpu_group: Any) -> None:
        """Gather every rank's process identity for the explanations (collective)."""
        self.errors.learn_peers(cpu_group)

    def check_live(self, op: str) -> None:
        """Refuse to begin ``op`` on a closed group.

        Raises:
            NotInitializedError: The group was closed.
        """
        if self.errors.destroyed:
            raise NotInitializedError(destroyed_msg(self.name, op))

    def run(self, op: str, fn: Callable[..., _R], *args: Any, partner: int | None = None,
            p2p: bool = False) -> _R:
        """Run ``fn(*args)`` as call ``op``: numbered (a collective call unless
        ``p2p``), and a failed wait explained (``partner``: the peer of a
        point-to-point call)."""
        if p2p:
            self.p2p_calls = n = self.p2p_calls + 1
            seq = n + self.collectives
        else:
            self.collectives = n = self.collectives + 1
            seq = n + self.p2p_calls
        started = monotonic()
        try:
            return fn(*args)
        except WAIT_ERRORS as e:
            self.errors.explain(op, seq, e, partner=partner, started=started)
            raise

    def number_p2p(self) -> int:
        """Number a point-to-point call made outside :meth:`run`; returns its number."""
        self.p2p_calls = n = self.p2p_calls + 1
        return n + self.collectives

    def explain(self, op: str, seq: int, e: BaseException, partner: int | None = None,
                writer: int | None = None, started: float | None = None) -> None:
        """Raise the error call ``seq`` (``op``) should raise for ``e``, or return to
        let the caller re-raise ``e`` (see :meth:`CallErrors.explain
        <coordinator.calls.call_errors.CallErrors.explain>`)."""
        self.errors.explain(op, seq, e, partner=partner, writer=writer, started=started)

    def dead_partner(self, op: str, partner: int) -> PeerDiedError | None:
        """The error of the current call ``op`` when ``partner``'s process is provably
        gone, else None."""
        return self.errors.dead_partner(op, self.calls, partner)

    def close(self) -> None:
        """Mark the group closed: calls that begin from now on raise
        ``NotInitializedError``, calls still running that fail raise ``ClosedError``."""
        self.errors.destroyed = True
