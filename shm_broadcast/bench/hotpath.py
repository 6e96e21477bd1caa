"""``groupcoord bench mq-hotpath``: the queue's own CPU cost per message, in one process.

A writer and a local reader live in the same process and take turns: the
writer fills the ring (``max_chunks`` messages), the reader drains it. No
process ever waits for another, so the time per message is the code path
itself (encode, copy, flags, decode) and hardly depends on what else the
machine runs. That makes it the measure for "did a change slow the hot
path?", where the multi-process round trip of ``bench mq`` is dominated by
scheduling on a busy machine. Report: the median and p99 over rounds of
microseconds per message (enqueue + dequeue); the best of ``--repeats``
medians is the headline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from shm_broadcast.cli_args import number, output_path

__all__ = ["add_args", "run", "measure"]

_PAYLOADS: dict[str, Any] = {
    "step-dict": {"req_ids": list(range(20)), "tokens": list(range(20)), "pos": [1, 2, 3]},
    "tensor-4KB": {"x": np.ones(1024, dtype=np.float32)},
    "bytes-64KB": b"x" * 65536,
}


def measure(payload: Any, rounds: int = 400, chunks: int = 8) -> tuple[float, float]:
    """``(median, p99)`` microseconds per message over ``rounds`` fill-and-drain rounds."""
    from shm_broadcast.queue.message_queue import MessageQueue

    writer = MessageQueue(1, 1, [1], 1 << 20, chunks, name="hotpath")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 1)
    try:
        writer.wait_until_ready(10)
        reader.wait_until_ready(10)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(chunks):
                writer.enqueue(payload)
            for _ in range(chunks):
                reader.dequeue()
            samples.append((time.perf_counter_ns() - t0) / chunks / 1000)
    finally:
        reader.close()
        writer.close()
    kept = samples[rounds // 8:]  # the first rounds warm caches and allocators
    return statistics.median(kept), float(np.percentile(kept, 99))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=number(int, minimum=16), default=400,
                        help="fill-and-drain rounds, at least 16 (default: %(default)s)")
    parser.add_argument("--repeats", type=number(int, minimum=1), default=3,
                        help="independent measurements, at least 1 (default: %(default)s)")
    parser.add_argument("--json", dest="json_path", type=output_path,
                        help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    out: dict[str, dict[str, float]] = {}
    print(f"{'payload':<12} {'best p50 us/msg':>16} {'p99 us/msg':>11}")
    for name, payload in _PAYLOADS.items():
        runs = [measure(payload, args.rounds) for _ in range(args.repeats)]
        p50, p99 = min(runs)
        out[name] = {"p50_us": round(p50, 3), "p99_us": round(p99, 3)}
        print(f"{name:<12} {p50:>16.2f} {p99:>11.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0
