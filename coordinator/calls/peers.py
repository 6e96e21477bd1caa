"""The peer of a point-to-point call: the check of its rank, its rank for error
messages, and the note on an error the peer could not be told of."""

from __future__ import annotations

from typing import Any

from device_comms import validation
from device_comms.errors import add_note
from shm_broadcast import checks

__all__ = ["check_peer", "peer_rank", "note_untold"]


def check_peer(r: Any, arg: str, world_size: int, me: int) -> int:
    """Return ``r`` as an int if it can be the peer of a point-to-point call of
    group rank ``me``.

    Raises:
        TypeError: ``r`` is not an int.
        ValueError: ``r`` is outside ``[0, world_size)`` or is ``me`` (point to
            point needs another rank).
    """
    peer = validation.check_rank(r, world_size, arg)
    if peer == me:
        raise ValueError(f"{arg}={peer} is this rank; point-to-point needs another rank")
    return peer


def peer_rank(rank: Any) -> int | None:
    """A point-to-point call's peer rank, when it is one (for error messages)."""
    return checks.as_int(rank)


def note_untold(e: BaseException, peer: int, group: str, why: BaseException) -> None:
    """Note on ``e`` (this rank's own error) that telling group rank ``peer`` of it
    failed with ``why`` (:func:`device_comms.errors.add_note`, which Python 3.10 has too)."""
    add_note(e, f"telling rank {peer} of group {group!r} failed: {why}")

