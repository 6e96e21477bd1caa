"""Workers send their results back to the driver through single-reader message queues.

What it shows:
    The return path of an engine. The driver (global rank 0) hands out work
    through one broadcast queue (``create_mq_broadcaster``: one writer, every
    other rank reads). Each worker answers through its *own* queue whose only
    reader is the driver (``create_single_reader_mq_broadcasters``): no
    worker waits for another, and the driver reads the answers in whatever
    order it likes.

    Both calls are collective over the world group. With ``blocking=False``
    each side calls ``wait_until_ready()`` on its queues before the first
    message, which guarantees nothing is lost. Results mix plain values and
    tensors; tensors travel as raw bytes next to the msgspec-encoded message.
    ``dequeue(timeout=...)`` raises ``QueueTimeout`` naming the queue if a
    worker does not answer in time, and ``PeerDiedError`` (within about a
    second) if the worker process died.

    Each worker computes its slice of a dot product and a list of "tokens";
    the driver combines the slices, checks everything against its own
    computation and reports the round-trip time (task out, all results back).

Run:
    python examples/results_to_driver.py [--ranks 3] [--steps 50]

Expected output (numbers vary):
    results_to_driver: driver + 2 workers, 50 tasks
    results_to_driver: round trip (task out, every result back) p50 = 403.1 us
    results_to_driver: 100 results checked, dot products match: PASS

Exits with status 1 if a result is wrong.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

N = 4096


def task(step: int) -> dict[str, Any]:
    """What the driver broadcasts at ``step``."""
    g = torch.Generator().manual_seed(step)
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return {"kind": "work", "step": step, "a": a, "b": b}


def answer(msg: dict[str, Any], worker: int, n_workers: int) -> dict[str, Any]:
    """Worker ``worker``'s result for a task: its slice of ``a . b`` and some tokens."""
    lo, hi = worker * N // n_workers, (worker + 1) * N // n_workers
    partial = torch.dot(msg["a"][lo:hi], msg["b"][lo:hi])
    top = torch.topk(msg["a"][lo:hi], 3).indices + lo
    return {"step": msg["step"], "worker": worker, "partial": partial, "top_ids": top.tolist()}


def rank_main(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Runs on every rank of the world group; rank 0 is the driver."""
    from coordinator import parallel_state as ps

    world = ps.get_world_group()
    tasks = world.create_mq_broadcaster(writer_rank=0)                # driver -> all
    my_writer, readers = world.create_single_reader_mq_broadcasters(
        reader_rank_in_group=0, blocking=False                       # each worker -> driver
    )
    try:
        for q in [my_writer, *readers]:
            if q is not None:
                q.wait_until_ready()
        if rank != 0:  # worker: answer until told to stop
            n = 0
            while (msg := tasks.dequeue())["kind"] != "stop":
                my_writer.enqueue(answer(msg, rank - 1, world_size - 1))
                n += 1
            return {"answered": n}
        round_trip_ns, bad = [], 0
        for step in range(steps):
            msg = task(step)
            t0 = time.perf_counter_ns()
            tasks.enqueue(msg)
            results = [readers[w].dequeue(timeout=60) for w in range(1, world_size)]
            round_trip_ns.append(time.perf_counter_ns() - t0)
            total = sum(r["partial"] for r in results)
            want = [answer(msg, w - 1, world_size - 1) for w in range(1, world_size)]
            bad += not torch.allclose(total, torch.dot(msg["a"], msg["b"]), atol=1e-3)
            bad += sum(
                r["step"] != step or r["worker"] != w["worker"] or r["top_ids"] != w["top_ids"]
                or not torch.allclose(r["partial"], w["partial"], atol=1e-4)
                for r, w in zip(results, want, strict=True)
            )
        tasks.enqueue({"kind": "stop"})
        return {"round_trip_ns": round_trip_ns, "bad": bad, "checked": steps * (world_size - 1)}
    finally:
        for q in [tasks, my_writer, *readers]:
            if q is not None:
                q.close()


def main() -> int:
    from coordinator.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=3, help="driver + workers (>= 2)")
    ap.add_argument("--steps", type=int, default=50, help="tasks to send")
    args = ap.parse_args()
    if args.ranks < 2 or args.steps < 1:
        ap.error(f"need --ranks >= 2 and --steps >= 1, got {args.ranks} and {args.steps}")

    results = run_distributed(rank_main, args.ranks, args.steps, timeout=120)
    drv = results[0]
    p50 = statistics.median(drv["round_trip_ns"]) / 1e3
    print(f"results_to_driver: driver + {args.ranks - 1} workers, {args.steps} tasks")
    print(f"results_to_driver: round trip (task out, every result back) p50 = {p50:.1f} us")
    answered = [r["answered"] for r in results[1:]]
    bad = drv["bad"]
    ok = bad == 0 and answered == [args.steps] * (args.ranks - 1)
    verdict = "PASS" if ok else f"FAIL ({bad} wrong; tasks answered per worker: {answered})"
    print(f"results_to_driver: {drv['checked']} results checked, dot products match: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
