"""Start the rank processes of a test at one moment, after each has imported.

A rank process that starts ``init_distributed_environment`` with a short
timeout must reach rank 0's store in time; importing torch and the library
takes seconds on a loaded two-core machine, and one rank's import can lag the
other's by more than that timeout. So a rank script prints ``ready`` once it
has imported and waits for a line on stdin; :func:`start_together` waits for
every ``ready`` and then lets all of them go.
"""

from __future__ import annotations

import queue
import select
import subprocess
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["READY", "start_together", "release_and_collect"]

#: The rank script's lines: say it has imported, then wait to be let go.
READY = 'print("ready", flush=True)\nsys.stdin.readline()\n'


def start_together(procs: Mapping[int, subprocess.Popen[str]], within: float) -> None:
    """Wait until every process printed ``ready`` (within ``within`` seconds in all),
    then write a line to each one's stdin. The processes need ``stdin`` and
    ``stdout`` pipes in text mode."""
    deadline = time.monotonic() + within
    for r, p in procs.items():
        assert p.stdout is not None and p.stdin is not None
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline() if ready else ""
        assert line.strip() == "ready", f"rank {r} did not start: {line!r}"
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def release_and_collect(out: Any, go: threading.Event | Any, starting: int,
                        ranks: Collection[int]) -> dict[int, Any]:
    """For forked ranks: wait for ``starting`` ready messages on the queue ``out``
    (within 60 s in all), set the event ``go``, then collect each of ``ranks``'
    ``(tag, rank, result)`` message (within 90 s in all). Returns rank -> result."""
    deadline = time.monotonic() + 60
    for _ in range(starting):
        try:
            out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("the ranks did not start") from None
    go.set()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 90
    while len(got) < len(ranks):
        try:
            _, r, o = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no result from {sorted(set(ranks) - set(got))}") from None
        got[r] = o
    return got
