"""Agreeing on a collective set-up call's arguments before any rank builds anything.

A set-up call that every rank of a group makes (creating a queue over the
group, say) exchanges handles and keys in several steps. If one rank's own
arguments are bad and it raises before the first step, its peers wait in that
step until the backend's timeout and then get the backend's error, which names
no culprit. :func:`agree` is the first step instead: every rank contributes
its verdict on its own arguments (and the values that must be equal on every
rank) to one all-gather, and then

* the rank whose arguments failed raises its own ``TypeError``/``ValueError``;
* every other rank raises :class:`~shm_broadcast.errors.PeerRejectedError`
  naming the lowest such rank and quoting its error;
* where the shared values differ, every rank raises
  :class:`~shm_broadcast.errors.CollectiveMismatch` naming the ranks that
  differ from the lowest rank's values;

so either every rank goes on or every rank raises, after one round trip.
"""

from __future__ import annotations

from typing import Any

from shm_broadcast.describe import describe
from shm_broadcast.errors import CollectiveMismatch, GroupCoordError, PeerRejectedError
from shm_broadcast.ranks.group_adapter import exchange_failed

__all__ = ["agree"]

_MAX_REASON = 2000


def agree(og: Any, problem: BaseException | None, op: str, name: str,
          same: Any = None) -> None:
    """One all-gather of every rank's verdict and ``same``; raise where any differs.

    Args:
        og: The group's :class:`~shm_broadcast.ranks.group_adapter.ObjectGroup`.
        problem: This rank's error with its own arguments, or None.
        op: The set-up call, for errors.
        name: The group or queue name, for errors.
        same: Values every rank must pass alike (plain data the group adapter
            carries: ints, strs, lists, None).

    Raises:
        TypeError, ValueError: ``problem`` itself, on the rank that had it.
        PeerRejectedError: Another rank's arguments failed.
        CollectiveMismatch: ``same`` differs between ranks.
    """
    reason = None if problem is None else f"{type(problem).__name__}: {problem}"[:_MAX_REASON]
    try:
        verdicts = og.all_gather([reason, same], op=op, name=name)
    except RuntimeError as e:  # the backend's failure (gloo): ours, naming group and op
        if isinstance(e, GroupCoordError):
            raise
        ours = exchange_failed(name, op, og.rank, og.world_size, e)
        if ours is e:
            raise
        raise ours from e
    if problem is not None:
        raise problem
    for rank, (their_reason, _) in enumerate(verdicts):
        if their_reason is not None:
            raise PeerRejectedError(name, op, rank, str(their_reason))
    first = verdicts[0][1]
    differ = [rank for rank, (_, theirs) in enumerate(verdicts) if theirs != first]
    if differ:
        raise CollectiveMismatch(
            f"group {name!r}, op {op}: rank(s) {differ} passed "
            f"{describe(verdicts[differ[0]][1], 200)} "
            f"where rank 0 passed {describe(first, 200)}; every rank must pass the same values",
            queue=name, peers=differ)
