"""Keys seen once: what the engine's caches build something for only when it comes back.

Building a cached view or entry costs more than one call saves, so the caches
of :mod:`device_comms.cpu_shm` build one for a key (an address, a layout) only
at its second sighting; :class:`SeenOnce` remembers the first.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["SeenOnce"]


class SeenOnce:
    """A bounded set of keys seen once (dropped whole when full, then filled again).

    Args:
        limit: Most keys remembered.
    """

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[Hashable] = set()

    def again(self, key: Hashable) -> bool:
        """Whether ``key`` was seen before (then it is forgotten); else remember it."""
        seen = self._seen
        if key in seen:
            seen.discard(key)
            return True
        if len(seen) >= self._limit:
            seen.clear()
        seen.add(key)
        return False

    def clear(self) -> None:
        """Forget every key."""
        self._seen.clear()
