"""A group's barrier: gloo's monitored barrier, with the missing ranks named.

Group rank 0 collects every rank and then releases them; when a rank does not
arrive within the wait, gloo's error lists the missing ranks, which become a
:class:`~coordinator.errors.CommTimeout` naming the group, the op and those
ranks.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from coordinator.errors import CommTimeout

__all__ = ["monitored_barrier"]

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def monitored_barrier(cpu_group: Any, name: str, wait_s: float,
                      await_exit: Callable[[Sequence[int]], None]) -> None:
    """Wait for every rank of ``cpu_group`` (the CPU group of group ``name``), at most
    ``wait_s`` seconds.

    ``await_exit(ranks)`` is called, before raising, with missing ranks whose
    connection broke before the timeout (they are probably exiting; see
    :meth:`~coordinator.calls.call_errors.CallErrors.await_exit`).

    Raises:
        CommTimeout: Ranks did not arrive in time (named).
    """
    start = time.monotonic()
    try:
        dist.monitored_barrier(group=cpu_group,
                               timeout=datetime.timedelta(seconds=wait_s),
                               wait_all_ranks=True)
    except RuntimeError as e:
        found = _MISSING.search(str(e))
        if found is None:
            raise
        missing = [int(r) for r in found.group(1).replace(",", " ").split()]
        if time.monotonic() - start < 0.9 * wait_s:
            # Failed before the timeout: their connection broke, so they are
            # probably exiting; let the explanation see them gone.
            await_exit(missing)
        raise CommTimeout(
            f"group {name!r}, op barrier: rank(s) {missing} did not arrive "
            f"within {wait_s:g}s ({str(e).splitlines()[0]})",
            queue=name, peers=missing) from e
