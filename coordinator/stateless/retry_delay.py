"""Exponential back-off between a reader's checks for a changed store value, cut at a deadline.

A stateless group's reader that refused a value (or a session record) does not
fetch it again at once: it waits :data:`FIRST_S`, then twice as long before each
later check, up to :data:`MOST_S`, and never past the call's deadline. So however
often a value is replaced, a reader looks at the key at most 7 times in the
first second after its first fetch (after 5, 15, 35, 75, 155, 315 and 635 ms),
twice a second after that, and once more at the deadline (the last delay ends
there); what a look costs is up to the caller (a reader makes at most one fetch
and one ``compare_set`` per look, or checks a small counter, and fetches a value
only when it changed).

:meth:`RetryDelay.next` gives the same delays without sleeping, for a caller
that spends them in a blocking store ``wait`` (which returns as soon as the
keys exist) instead.
"""

from __future__ import annotations

import time

__all__ = ["FIRST_S", "MOST_S", "RetryDelay"]

#: The first delay (seconds).
FIRST_S = 0.005
#: The longest delay (seconds).
MOST_S = 0.5


class RetryDelay:
    """Delays of ``first``, ``2 * first``, ... up to ``most`` seconds, none past ``deadline``.

    Args:
        deadline: ``time.monotonic()`` value the delays never pass.
        first: The first delay in seconds (> 0).
        most: The longest delay in seconds (>= first).
    """

    def __init__(self, deadline: float, first: float = FIRST_S, most: float = MOST_S) -> None:
        self.deadline = deadline
        self._next = first
        self._most = most

    def next(self) -> float | None:
        """The next delay (shortened to end at the deadline), counted as spent.

        Returns:
            None once the deadline has passed; else the delay in seconds (> 0).
        """
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        step = min(self._next, left)
        self._next = min(2 * self._next, self._most)
        return step

    def sleep(self) -> bool:
        """Sleep the next delay (shortened to end at the deadline).

        Returns:
            False, without sleeping, once the deadline has passed; else True.
        """
        step = self.next()
        if step is None:
            return False
        time.sleep(step)
        return True
