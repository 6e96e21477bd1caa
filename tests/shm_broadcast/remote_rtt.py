"""Round trip of a message between two processes over the queue's TCP path.

Measures what ``groupcoord bench mq`` cannot: the remote-reader path. Process
A writes on queue ``ping`` whose only reader, B, is remote (TCP on
127.0.0.1); B answers each message on queue ``pong`` whose only reader, A, is
remote too. One round trip = A's enqueue until A's dequeue of the echo.

Run as a script::

    python -m tests.shm_broadcast.remote_rtt --payload 4096 --iters 3000

It prints the median and the 99th percentile in microseconds (JSON with
``--json``). :func:`measure` is also used by the tests, with few iterations.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from shm_broadcast import MessageQueue

__all__ = ["measure"]

_READY_S = 60.0


def _no_curve() -> None:
    """Diagnostics only (``GC_RTT_NO_CURVE=1``): the same code with CURVE switched off,
    to tell the cost of the cipher from the rest of the changes."""
    import shm_broadcast.queue_writer as qw
    import shm_broadcast.remote_reader as rr

    qw.make_curve_server = lambda sock, secret: None
    rr.make_curve_client = lambda sock, *keys: None
    qw._user_id = lambda frame: "reader"


def _echo(ping_handle: Any, conn: Any, iters: int, warmup: int) -> None:
    """Process B: read every ping (rank 1, remote), answer on its own queue."""
    if os.environ.get("GC_RTT_NO_CURVE") == "1":
        _no_curve()
    ping = MessageQueue.create_from_handle(ping_handle, rank=1)
    pong = MessageQueue(1, 0, connect_ip="127.0.0.1", name="pong")
    try:
        conn.send(pong.export_handle())
        ping.wait_until_ready(_READY_S)
        pong.wait_until_ready(_READY_S)
        for _ in range(warmup + iters):
            pong.enqueue(ping.dequeue(timeout=_READY_S), timeout=_READY_S)
        conn.recv()  # A read the last echo: the sockets may close now
    finally:
        ping.close()
        pong.close()


def measure(payload: int = 4096, iters: int = 2000, warmup: int = 200) -> dict[str, float]:
    """Time ``iters`` round trips of a ``payload``-byte array over TCP loopback.

    Returns:
        ``{"median_us", "p99_us", "mean_us", "iters", "payload"}``.
    """
    if os.environ.get("GC_RTT_NO_CURVE") == "1":
        _no_curve()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ping = MessageQueue(1, 0, connect_ip="127.0.0.1", name="ping")
    proc = ctx.Process(target=_echo, args=(ping.export_handle(), child, iters, warmup),
                       daemon=True)
    proc.start()
    pong = None
    try:
        if not parent.poll(_READY_S):
            raise TimeoutError("the echo process did not start")
        pong = MessageQueue.create_from_handle(parent.recv(), rank=0)
        ping.wait_until_ready(_READY_S)
        pong.wait_until_ready(_READY_S)
        msg = np.zeros(payload, dtype=np.uint8)
        samples = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            ping.enqueue(msg, timeout=_READY_S)
            pong.dequeue(timeout=_READY_S)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        parent.send("done")
    finally:
        ping.close()
        if pong is not None:
            pong.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    us = sorted(s * 1e6 for s in samples)
    return {"median_us": statistics.median(us), "p99_us": us[int(0.99 * (len(us) - 1))],
            "mean_us": statistics.fmean(us), "iters": iters, "payload": payload}


def main() -> None:
    """Command line: print (or write as JSON) the round-trip statistics."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--payload", type=int, default=4096)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    runs = [measure(a.payload, a.iters) for _ in range(a.runs)]
    for r in runs:
        print(f"payload {r['payload']} B: median {r['median_us']:.1f} us, "
              f"p99 {r['p99_us']:.1f} us, mean {r['mean_us']:.1f} us ({r['iters']} iters)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
