"""Ending every wait of a gloo group at once.

gloo cannot cancel one pending operation, but a receive whose wait expires
makes gloo close every connection ("pair") of its group, and with them every
operation of the group still pending, on every thread. A group being
destroyed uses that to end the calls other threads are blocked in (each then
raises ``ClosedError``) instead of leaving them to their timeouts. The
receive is posted on a tag no rank ever sends on, so nothing can satisfy it.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch

__all__ = ["BREAK_TAG", "break_connections"]

#: Never sent: the expired wait on it closes the group's connections.
BREAK_TAG = 0x6770


def break_connections(group: Any, peer: int) -> None:
    """Close every gloo connection of ``group`` (a receive from group rank ``peer``,
    another rank, on :data:`BREAK_TAG` whose 1 ms wait expires)."""
    buf = torch.empty(1, dtype=torch.uint8, device="cpu")
    with contextlib.suppress(RuntimeError):
        group.recv([buf], peer, BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
