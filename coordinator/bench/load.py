"""Background compute load for ``groupcoord bench engine``: busy cores, as in an engine.

Two kinds, both running float32 matrix products back to back until stopped:

* :class:`LoadThread` -- a thread inside a rank (the rank's torch intra-op
  threads run its products, as a model's would; the GIL is released inside
  each product);
* :func:`start_load_processes` -- separate busy processes (other work on the
  machine), stopped and reaped by :func:`stop_load_processes`.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

__all__ = ["LoadThread", "start_load_processes", "stop_load_processes", "busy_matmuls"]


def busy_matmuls(size: int, stop: Any) -> int:
    """Multiply ``size x size`` float32 matrices until ``stop.is_set()``.

    Returns:
        How many products were computed.
    """
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    c = torch.empty(size, size)
    n = 0
    while not stop.is_set():
        torch.mm(a, b, out=c)
        n += 1
    return n


class LoadThread:
    """Matmuls in a daemon thread of this process until :meth:`close`.

    Args:
        size: Matrix dimension (256: ~1 ms per product on one core).
    """

    def __init__(self, size: int) -> None:
        self._stop = threading.Event()
        self.products = 0
        self._thread = threading.Thread(target=self._run, args=(size,), name="bench-load",
                                        daemon=True)
        self._thread.start()

    def _run(self, size: int) -> None:
        self.products = busy_matmuls(size, self._stop)

    def close(self) -> None:
        """Stop and join the thread. Idempotent."""
        self._stop.set()
        self._thread.join(30)


def _load_main(size: int, threads: int, stop: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    busy_matmuls(size, stop)


def start_load_processes(n: int, size: int, threads: int) -> tuple[list[Any], Any]:
    """Start ``n`` busy processes (spawn), each with ``threads`` torch threads.

    Returns:
        The processes and the event that stops them (pass both to
        :func:`stop_load_processes`).
    """
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs: list[Any] = []
    try:
        for i in range(n):
            p = ctx.Process(target=_load_main, args=(size, threads, stop),
                            name=f"bench-load{i}", daemon=True)
            p.start()
            procs.append(p)
    except BaseException:
        stop_load_processes(procs, stop)
        raise
    return procs, stop


def stop_load_processes(procs: list[Any], stop: Any) -> None:
    """Stop the load processes and reap them (killed if they do not exit)."""
    from shm_broadcast.ranks.launcher import stop_ranks

    stop.set()
    stop_ranks(procs, wait_first=10.0)
