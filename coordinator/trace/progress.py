"""Each rank's progress through a watched group's collectives, where its peers read it.

When a rank's device call does not complete, its watchdog
(:mod:`coordinator.trace.watchdog`) names the ranks of the group that have
not reached that call. For that, every rank publishes, per watched group, the
last collective it *issued* and the last one it knows *completed* (the
group's collective sequence numbers, the same on every rank of a correct
program), and the watchdog that fires reads its peers' values.

**Where: torch.distributed's default store.** Every process of a
``torch.distributed`` job already reaches it (it served the rendezvous), on
one host or many, and it answers reads while the group's own connections
are stuck, which is when it is read. Shared memory would reach only the
ranks of one host; the group's own transports are what is stuck. The board
uses a *clone* of the store (its own connection: its waits never queue
behind the job's store calls, and its short timeout, :data:`STORE_TIMEOUT_S`,
is its own); with a torch that cannot clone stores it opens its own client
of the same TCPStore server, and any other store is used as it is.

**Keys and values.** ``groupcoord/progress/<group>/<rank>`` with ``<group>``
torch's name of the group's CPU process group (every process creates every
group in the same order, so the name is the same on every rank and new for
each group made) and ``<rank>`` the group rank; the value is
``b"<issued> <completed>"`` (decimal). A key missing, or a value that does not
parse, reads as "not known".

**Cost.** Only the watchdog's thread writes, never a call's thread, and only
when a value changed and at most every :data:`PUBLISH_INTERVAL_S` per group:
one small ``set`` (which the store does not answer, so a slow store does not
hold the thread). Values are read only when a call is stuck. A value may lag
the rank by up to that interval plus one watchdog tick, much less than any
group timeout, after which it is read.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from time import monotonic_ns
from typing import Any

import torch.distributed as dist

__all__ = ["PUBLISH_INTERVAL_S", "STORE_TIMEOUT_S", "ProgressBoard", "group_name", "progress_key"]

#: At most one write per group this often (seconds).
PUBLISH_INTERVAL_S = 0.5
#: Seconds a read of the board waits for the store.
STORE_TIMEOUT_S = 2.0
_PREFIX = "groupcoord/progress"


def group_name(pg: Any) -> str:
    """torch's name of process group ``pg`` (the same on every rank, new per group)."""
    name = getattr(pg, "group_name", None)
    if not name:  # older torch: no property
        name = dist.distributed_c10d._get_process_group_name(pg)  # noqa: SLF001 - idem
    return str(name)


def progress_key(group: str, rank: int) -> str:
    """The store key of group rank ``rank``'s progress in the group torch calls ``group``."""
    return f"{_PREFIX}/{group}/{rank}"


class ProgressBoard:
    """Publishes this process's progress and reads its peers' (see the module docstring).

    Used from one thread (the watchdog's).

    Args:
        store: The store to use (the board's own clone or connection).
        interval_s: Least time between two writes of one key.
    """

    def __init__(self, store: Any, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self.store = store
        self.interval_ns = int(interval_s * 1e9)
        self._written: dict[str, tuple[int, int, int]] = {}  # key -> issued, completed, when

    @classmethod
    def of_default_store(cls, timeout_s: float = STORE_TIMEOUT_S) -> ProgressBoard | None:
        """A board on torch.distributed's default store (None where there is none)."""
        store = _own_store(timeout_s)
        return None if store is None else cls(store)

    def publish(self, key: str, issued: int, completed: int, now_ns: int | None = None) -> bool:
        """Write ``issued``/``completed`` under ``key`` if they changed and the last
        write is old enough; returns whether it wrote. A failed write is dropped
        (the next change writes again)."""
        now = monotonic_ns() if now_ns is None else now_ns
        last = self._written.get(key)
        if last is not None and (last[0], last[1]) == (issued, completed):
            return False
        if last is not None and now - last[2] < self.interval_ns:
            return False
        self._written[key] = (issued, completed, now)
        try:
            self.store.set(key, f"{issued} {completed}".encode())
        except (RuntimeError, OSError):  # a store that went away: nothing to tell
            return False
        return True

    def read(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """Each key's ``(issued, completed)``, None where not known."""
        store, keys = self.store, list(keys)
        raws: list[Any] = [None] * len(keys)
        # check() first: get() would wait for a key that is not there. A store that
        # does not answer the first check (its timeout) leaves everything unknown.
        with contextlib.suppress(RuntimeError, OSError):
            if store.check(keys) and hasattr(store, "multi_get"):
                raws = list(store.multi_get(keys))
            else:
                raws = [store.get(k) if store.check([k]) else None for k in keys]
        return [_parse(raw) for raw in raws]

    def forget(self, key: str) -> None:
        """Remove ``key`` from the store and from the board (its group is gone)."""
        self._written.pop(key, None)
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self.store.delete_key(key)


#: The longest value a rank publishes ("<issued> <completed>"); anything longer,
#: or not two integers, reads as nothing published.
_MAX_VALUE_BYTES = 48


def _parse(raw: bytes | None) -> tuple[int, int] | None:
    if raw is None or len(raw) > _MAX_VALUE_BYTES:
        return None
    try:
        issued, completed = (int(v) for v in bytes(raw).decode("ascii").split())
    except ValueError:
        return None
    return issued, completed


def _own_store(timeout_s: float) -> Any:
    """A connection of this board's own to the default store, with ``timeout_s``
    (see the module docstring); None where torch.distributed has no default store."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        # torch exposes the default store only privately; every rank of the job has it.
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
    except (RuntimeError, ValueError):
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    clone = getattr(store, "clone", None)
    if clone is not None:
        with contextlib.suppress(RuntimeError):
            own = clone()
            own.set_timeout(timeout)
            return own
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        with contextlib.suppress(RuntimeError, OSError):
            client = dist.TCPStore(base.host, base.port, is_master=False, timeout=timeout,
                                   wait_for_workers=False)
            return dist.PrefixStore("groupcoord", client)
    return store
