"""The wake-up floor: what waking a sleeping process costs on this machine.

``groupcoord bench mq`` reports how long a reader parked on its doorbell takes
to return a message from ``dequeue()`` (one-way, writer busy in between). That
number is bounded below by the platform, not by the queue: the kernel must
wake the sleeper (on a VM, an idle vCPU must be resumed by the host), and a
Python process that has slept runs its first few hundred bytecodes with cold
caches.

This module measures that floor in the same run with the least Python there
can be: a process sleeping in ``poll(2)`` on a Unix datagram socket, woken by
one ``sendto`` carrying the sender's timestamp, which it subtracts right
after ``poll`` returns -- no queue, no decoding, no flags. The queue's
wake-up latency divided by this floor is the queue's own overhead factor.

Both measurements use the same gaps (randomised, so that nothing phase-locks
with the readers' periodic liveness wake-ups) and the same busy writer.
"""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import time
from typing import Any

from shm_broadcast.lifecycle.channel_dirs import new_channel_dir, remove_channel_dir

__all__ = ["wake_gaps", "busy_wait", "bare_wake_latencies"]

_STAMP = struct.Struct("d")
_READY_S = 60.0


def wake_gaps(n: int, mean_s: float = 0.25, seed: int = 0) -> list[float]:
    """``n`` idle gaps uniform in ``[0.8, 1.2] * mean_s`` (reproducible)."""
    rng = random.Random(seed)
    return [mean_s * rng.uniform(0.8, 1.2) for _ in range(n)]


def busy_wait(seconds: float) -> None:
    """Keep this core busy for ``seconds`` (the writer of an engine computing)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _address(directory: str) -> str:
    """The sleeper's socket: a file in a private (``0700``) channel directory,
    which no other user can send to."""
    return os.path.join(directory, "r0")


def _sleeper(address: str, n: int, results: Any) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        results.put("ready")
        out: list[float] = []
        clock = time.perf_counter
        while len(out) < n:
            if poller.poll(1000):
                now = clock()
                data = sock.recv(64)
                if len(data) != _STAMP.size:  # not the bench's timestamp: ignored
                    continue
                (sent,) = _STAMP.unpack(data)
                out.append(now - sent)
        results.put(out)
    finally:
        sock.close()


def bare_wake_latencies(ctx: Any, gaps: list[float], busy: bool = True) -> list[float]:
    """One-way wake-up latencies of a bare sleeping process (the floor), sorted.

    Args:
        ctx: A ``multiprocessing`` context (spawn) for the sleeper process.
        gaps: Seconds between messages; the sleeper is asleep during each.
        busy: Spin between messages (like an engine's driver) instead of
            sleeping too.

    Returns:
        Seconds from the sender's timestamp to the sleeper's ``poll`` return.
    """
    directory = new_channel_dir()
    address = _address(directory)
    results = ctx.Queue()
    proc = ctx.Process(target=_sleeper, args=(address, len(gaps), results), daemon=True)
    proc.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        if results.get(timeout=_READY_S) != "ready":
            raise RuntimeError("wake-up floor: the sleeper process did not start")
        for gap in gaps:
            if busy:
                busy_wait(gap)
            else:
                time.sleep(gap)
            sock.sendto(_STAMP.pack(time.perf_counter()), address)
        out = results.get(timeout=_READY_S)
        return sorted(out)
    finally:
        sock.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        results.close()
        results.join_thread()
        remove_channel_dir(directory)
