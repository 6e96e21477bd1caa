"""Arrival at every worker of the world group's queue, with no model running.

Issue 14, item 2 (b) asks that, in ``groupcoord demo`` at TP=2 x PP=2, each
worker's metadata arrive within 1.3x of the driver's own ``enqueue`` time
(p50). This script takes the model out: four ranks (``initialize_model_parallel(2,
2)``), rank 0 enqueues a demo-sized step message (six requests) on the world
group's broadcaster every ``--step-ms`` and otherwise sleeps, ranks 1-3 only
dequeue. What it reports -- the driver's ``enqueue`` p50/p99 and every reader's
arrival (driver's clock before ``enqueue`` -> the reader's ``dequeue``
returned) -- is the floor of the demo's numbers on this machine, for the
group's predictive readers (``--policy predictive``, the default) and for
readers that poll with ``sched_yield`` the whole time (``--policy spin``:
a CPU each, vLLM's way).

Not part of the package or the test suite. Run from the repository root::

    python docs/bench/world_queue_arrival.py --policy predictive
    python docs/bench/world_queue_arrival.py --policy spin
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_STEP = {"req_ids": [1, 2, 3, 4, 5, 6], "token_ids": [[11], [12], [13], [14], [15], [16]],
         "num_computed": [20, 21, 22, 23, 24, 25], "finished_req_ids": []}


def _rank(rank: int, world_size: int, policy: str, steps: int, step_s: float) -> dict[str, Any]:
    from coordinator import parallel_state as ps
    from shm_broadcast.waiting.policy import WaitPolicy

    ps.initialize_model_parallel(2, 2)
    world = ps.get_world_group()
    options = {"wait_policy": WaitPolicy(spin_s=0.0, yield_s=3600.0)} if policy == "spin" else {}
    q = world.create_mq_broadcaster(writer_rank=0, **options)
    world.barrier()
    try:
        if rank == 0:
            took = []
            for _ in range(steps):
                time.sleep(step_s)
                t0 = time.perf_counter_ns()
                q.enqueue({"kind": "step", "step": _STEP, "t_ns": t0})
                took.append(time.perf_counter_ns() - t0)
            q.enqueue({"kind": "stop", "step": None, "t_ns": 0})
            return {"enqueue_ns": took}
        seen = []
        while True:
            msg = q.dequeue()
            now = time.perf_counter_ns()
            if msg["kind"] == "stop":
                return {"arrival_ns": seen}
            seen.append(now - msg["t_ns"])
    finally:
        q.close()


def _p(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def main() -> None:
    from coordinator.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=["predictive", "spin"], default="predictive")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30, help="steps left out of the statistics")
    ap.add_argument("--step-ms", type=float, default=10.0)
    a = ap.parse_args()
    got = run_distributed(_rank, 4, a.policy, a.steps, a.step_ms / 1e3, timeout=a.steps * 0.1 + 120)
    enq = got[0]["enqueue_ns"][a.warmup:]
    e50 = statistics.median(enq) / 1e3
    print(f"policy {a.policy}, {len(enq)} steps every {a.step_ms} ms, "
          f"load average {os.getloadavg()}")

    print(f"driver enqueue   p50 {e50:7.1f} us  p99 {_p(enq, 0.99):7.1f} us")
    for r in (1, 2, 3):
        arr = got[r]["arrival_ns"][a.warmup:]
        a50 = statistics.median(arr) / 1e3
        print(f"rank {r} arrival   p50 {a50:7.1f} us  p99 {_p(arr, 0.99):7.1f} us  "
              f"({a50 / e50:.2f}x the driver's enqueue p50)")


if __name__ == "__main__":
    main()
