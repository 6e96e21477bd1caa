"""Stamps on the TP broadcaster's messages: a reader never takes another call's message.

The group's message queue (the TP broadcaster) is one-way: its writer puts a
broadcast in the ring and returns without waiting for the readers. So a reader
that skipped a ``broadcast_object`` / ``broadcast_tensor_dict`` (or made one
collective call too many) finds, at its next broadcast, a message of another
call still in its ring: taken as it is, that call would return the data of an
earlier step, silently.

Every rank of a group makes the same collective calls in the same order
(point-to-point calls excluded: which ranks make them differs), so the number
of a collective call, counted per group and rank
(``GroupCoordinator.collectives``), is the same on every rank. The writer
sends each message as ``[number, op, payload]``; a reader compares the number
with its own and raises :class:`~coordinator.errors.CollectiveMismatch`,
naming the writer and both calls, instead of returning the payload; and
the same when the numbers agree but the writer's op differs (its
``broadcast_tensor_dict`` read by a ``broadcast_object`` would hand over the
dict's internal metadata).

What it cannot see: a reader that skips a broadcast and whose very next
collective call is the next broadcast counts that one as the skipped call's
number; it then takes the skipped call's message, exactly as if it had
called in time (the two calls are indistinguishable from where it stands),
and raises at its following broadcast if any collective call came between.
"""

from __future__ import annotations

from typing import Any

from coordinator.errors import CollectiveMismatch, DecodeError

__all__ = ["stamp", "unstamp", "number_of"]


def stamp(payload: Any, number: int, op: str) -> list[Any]:
    """The message the writer sends for its collective call ``number`` (``op``)."""
    return [number, op, payload]


def number_of(message: Any) -> int | None:
    """The collective number a stamped message carries (None: not a stamped one)."""
    if type(message) is list and len(message) == 3 and type(message[0]) is int:
        return message[0]
    return None


def unstamp(message: Any, number: int, op: str, group: str, writer: int, seq: int) -> Any:
    """The payload of ``message`` if it belongs to this rank's collective call ``number``
    and was sent by the same op.

    Args:
        message: What the queue delivered.
        number: This rank's collective call number (``GroupCoordinator.collectives``).
        op: This rank's op (``broadcast_object``, ``broadcast_tensor_dict``).
        group: The group's unique name.
        writer: The writer's group rank.
        seq: This rank's call number (``GroupCoordinator.calls``), for the message.

    Raises:
        CollectiveMismatch: The message belongs to another collective call of
            the writer, or the writer made another broadcasting call at this
            number (``peers``: the writer).
        DecodeError: The message is not a stamped one.
    """
    if (type(message) is not list or len(message) != 3 or type(message[0]) is not int
            or type(message[1]) is not str):
        raise DecodeError(f"group {group!r}, op {op}: the broadcaster's writer (rank {writer}) "
                          f"sent a message without a call stamp", queue=group, peers=(writer,))
    theirs, their_op, payload = message
    if theirs == number and their_op != op:
        raise CollectiveMismatch(
            f"group {group!r}, op {op}, call #{seq}: rank {writer} (the broadcaster's writer) "
            f"called {their_op:.40} where this rank called {op}, at the same collective call "
            f"{number}; make the same collective calls on every rank. The message was not used.",
            queue=group, peers=(writer,))
    if theirs != number:
        raise CollectiveMismatch(
            f"group {group!r}, op {op}, call #{seq}: the message read from the group's "
            f"broadcaster was sent by rank {writer}'s {their_op} at its collective call "
            f"{theirs}, but this rank is at its collective call {number}: this rank or rank "
            f"{writer} skipped or added a collective call (every rank must make the same "
            f"collective calls in the same order). The message was not used.",
            queue=group, peers=(writer,))
    return payload
