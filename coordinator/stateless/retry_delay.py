"""Exponential back-off between a reader's checks for a changed store value, cut at a deadline.

A stateless group's reader that refused a value (or a session record) does not
fetch it again at once: it waits :data:`FIRST_S`, then twice as long before each
later check, up to :data:`MOST_S`, and never past the call's deadline. So however
often a value is replaced, a reader looks at the key at most 7 times in the
first second (after 5, 15, 35, 75, 155, 315 and 635 ms) and twice a second
after that; what a look costs is up to the caller (a reader checks a small
counter or an empty marker, and fetches the value only when it changed).
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

    def sleep(self) -> bool:
        """Sleep the next delay (shortened to end at the deadline).

        Returns:
            False, without sleeping, once the deadline has passed; else True.
        """
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self._next, left))
        self._next = min(2 * self._next, self._most)
        return True
