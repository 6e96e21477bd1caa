"""Fixtures of the shm_broadcast tests: spawned child processes, always reaped
(``cleanup_serial``, one test at a time around ``groupcoord cleanup --yes``, is
in ``tests/conftest.py``: the coordinator's ``doctor`` tests share it)."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable
from typing import Any

import pytest

from shm_broadcast.ranks.launcher import start_process


class Procs:
    """Child processes of one test, reaped whatever happens."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.started: list[Any] = []

    def start(self, target: Callable[..., None], *args: Any) -> Any:
        """Start ``target(*args, out_queue)`` in a fresh process (as the launcher
        starts ranks: see :func:`~shm_broadcast.ranks.launcher.start_process`)."""
        p = start_process(target, (*args, self.out), name=f"gc-test-{target.__name__}")
        self.started.append(p)
        return p

    def get(self, timeout: float = 90.0) -> tuple:
        """Next report of any child; a child's ``("error", ...)`` fails the test."""
        try:
            msg = self.out.get(timeout=timeout)
        except queue.Empty:
            alive = [(p.pid, p.exitcode) for p in self.started]
            raise AssertionError(f"no report from children within {timeout} s: {alive}") from None
        if msg[0] == "error":
            raise AssertionError(f"child rank {msg[1]} failed:\n{msg[-1]}")
        return msg

    @property
    def pids(self) -> set[int]:
        """Pids of every child started."""
        return {p.pid for p in self.started if p.pid is not None}

    def reap(self) -> None:
        """Kill what is still alive and join everything. Idempotent."""
        if self.out is None:
            return
        for p in self.started:
            if p.is_alive():
                p.join(2)
            if p.is_alive():
                p.kill()
            p.join(10)
        self.out.close()
        self.out.join_thread()
        self.out = None


@pytest.fixture
def procs() -> Any:
    """A :class:`Procs` whose children are killed and reaped after the test."""
    p = Procs()
    try:
        yield p
    finally:
        p.reap()


# Leak checks (segments and child processes) come from the autouse fixture in
# tests/conftest.py, which also knows the shared rank pools of other test dirs.
