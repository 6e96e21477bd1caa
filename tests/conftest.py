"""Shared fixtures: per-world-size rank pools and a leak check around every test."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterator

import psutil
import pytest

from coordinator.testing import DistributedPool, live_pool_pids
from shm_broadcast.segment import _unlink_quietly, list_segments

_IGNORED_CHILDREN = ("resource_tracker", "forkserver")


def _is_ignored(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
        return p.status() == psutil.STATUS_ZOMBIE or any(k in cmd for k in _IGNORED_CHILDREN)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def _pool_family() -> set[int]:
    """Pids of pool workers and their descendants (allowed to outlive a test)."""
    pids = set(live_pool_pids())
    for pid in list(pids):
        try:
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[..., DistributedPool]]:
    """``dist_pool(world_size)`` returns a live, reusable :class:`DistributedPool`."""
    pools: dict[int, DistributedPool] = {}

    def get(world_size: int) -> DistributedPool:
        if world_size not in pools:
            pools[world_size] = DistributedPool(world_size)
        return pools[world_size]

    yield get
    for p in pools.values():
        p.close()


class _TreeWatch:
    """Every pid seen in this process's tree while a test runs (sampled on a thread).

    A segment may be blamed on a test only if its owner belonged to the test's
    process tree: other processes on the machine (another suite, a crashed
    server) leave their own segments, which are not this test's fault.
    """

    def __init__(self, me: psutil.Process, interval: float = 0.05) -> None:
        self.me, self.interval = me, interval
        self.seen: set[int] = {me.pid}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="no-leaks-watch", daemon=True)
        self._thread.start()

    def sample(self) -> set[int]:
        try:
            now = {c.pid for c in self.me.children(recursive=True)}
        except psutil.Error:
            now = set()
        self.seen |= now
        return now | {self.me.pid}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a child process or a ``gc_*`` /dev/shm segment behind.

    Only the test's own processes (alive or dead) and the segments they
    created count.
    """
    me = psutil.Process(os.getpid())
    seg_before = {s.name for s in list_segments()}
    kids_before = {c.pid for c in me.children(recursive=True)}
    watch = _TreeWatch(me)
    try:
        yield
    finally:
        watch.stop()
    deadline = time.monotonic() + 5.0
    while True:
        allowed = _pool_family()
        kids = [
            c for c in me.children(recursive=True)
            if c.pid not in kids_before and c.pid not in allowed and not _is_ignored(c)
        ]
        mine = watch.sample()
        segs = [  # new segments owned by this test's processes (alive or dead)
            s for s in list_segments()
            if s.name not in seg_before and s.pid not in allowed
            and (s.pid in mine or s.pid in watch.seen)
        ]
        if (not kids and not segs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if kids:
        problems.append(f"leaked processes {[(k.pid, k.name()) for k in kids]}")
        for k in kids:
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
    if segs:
        problems.append(f"leaked /dev/shm segments {[s.name for s in segs]}")
        for s in segs:
            _unlink_quietly(s.name)
    if problems:
        pytest.fail("test leaked resources: " + "; ".join(problems))
