"""A/B cost of call signatures: the 1 KiB all-reduce of two source trees, interleaved.

Each round runs the same timing job once per tree (the order alternates from
round to round, so drift in machine load hits both alike); a job starts fresh
ranks with that tree first on ``PYTHONPATH``, builds the communicator of one
path, warms up, and times ``--iters`` all-reduces of a 1 KiB float32 tensor.
A job's number is the slowest rank's mean time per call; the report gives,
per path and tree, every round's number and their median, and the new tree's
median relative to the old one's.

Paths: ``gloo`` (:class:`TorchDistributedCommunicator`, 2 ranks), ``shm``
(:class:`CpuCommunicator` on one node, 2 ranks) and ``hierarchical``
(:class:`CpuCommunicator`, 4 ranks on two simulated nodes: the smallest
hierarchical group with shared memory on both nodes).

Run (the old tree from git, e.g. the branch point)::

    git archive <commit> | tar -x -C /tmp/old-tree
    python -m device_comms.bench.signature_cost --old /tmp/old-tree --new . \\
        --paths gloo shm hierarchical --iters 5000 --rounds 6

``--inprocess`` instead times, in the same two processes and alternating
blocks of ``--iters`` calls, the signed gloo all-reduce and the unsigned one
(the path GPU tensors keep): the signatures' own cost, without the drift
between separately started jobs.

This file runs its jobs as a script (``python <this file> --job ...``), so a
job imports nothing of the tree it measures except ``device_comms``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]

_WORLD = {"gloo": 2, "shm": 2, "hierarchical": 4}
_ELEMS = 256  # float32: 1 KiB


def _job_rank(rank: int, world: int, port: int, path: str, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from device_comms import CpuCommunicator, TorchDistributedCommunicator

    cpu, group = torch.device("cpu"), dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialised")
    if path == "gloo":
        comm: Any = TorchDistributedCommunicator(group, cpu, unique_name="bench")
    elif path == "shm":
        comm = CpuCommunicator(group, cpu, unique_name="bench")
    else:
        comm = CpuCommunicator(group, cpu, unique_name="bench", node_id=f"n{rank * 2 // world}")
    want = {"gloo": "gloo", "shm": "shm", "hierarchical": "hierarchical"}[path]
    mode = getattr(comm, "mode", "gloo")
    x = torch.ones(_ELEMS)
    for _ in range(max(200, iters // 10)):
        y = comm.all_reduce(x)
    ok = mode == want and bool(torch.equal(y, torch.full((_ELEMS,), float(world))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x)
    per_call = torch.tensor([(time.perf_counter() - t0) / iters * 1e6], dtype=torch.float64)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    comm.destroy()
    dist.destroy_process_group()
    if rank == 0:
        out.put({"us": per_call.item(), "ok": ok, "mode": mode})


def _inprocess_rank(rank: int, world: int, port: int, iters: int, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from device_comms import TorchDistributedCommunicator

    class Unsigned(TorchDistributedCommunicator):
        _checks_calls = False  # the unsigned path (what GPU tensors keep)

    cpu, group = torch.device("cpu"), dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialised")
    comms = {"signed": TorchDistributedCommunicator(group, cpu, unique_name="signed"),
             "unsigned": Unsigned(group, cpu, unique_name="unsigned")}
    x = torch.ones(_ELEMS)
    for c in comms.values():
        for _ in range(200):
            c.all_reduce(x)
    times: dict[str, list[float]] = {k: [] for k in comms}
    t = torch.zeros(1, dtype=torch.float64)
    for rnd in range(rounds):
        for name in (("unsigned", "signed") if rnd % 2 == 0 else ("signed", "unsigned")):
            c = comms[name]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                c.all_reduce(x)
            t[0] = (time.perf_counter() - t0) / iters * 1e6
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    for c in comms.values():
        c.destroy()
    dist.destroy_process_group()
    if rank == 0:
        out.put(times)


def _inprocess(iters: int, rounds: int) -> dict[str, list[float]]:
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_inprocess_rank, args=(r, 2, port, iters, rounds, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        stats: dict[str, list[float]] = out.get(timeout=1800)
        return stats
    finally:
        for p in procs:
            p.join(60)


def _job(path: str, iters: int) -> None:
    """Time one path with the ``device_comms`` on ``sys.path``; print one JSON line."""
    import multiprocessing as mp

    world = _WORLD[path]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_job_rank, args=(r, world, port, path, iters, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    print(json.dumps(res), flush=True)


def _run(tree: str, path: str, iters: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--job", path,
           "--iters", str(iters)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.abspath(tree))
    if done.returncode != 0:
        raise RuntimeError(f"job {path} on {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="source tree of the baseline")
    ap.add_argument("--new", default=".", help="source tree measured against it")
    ap.add_argument("--paths", nargs="+", default=["gloo", "shm", "hierarchical"],
                    choices=sorted(_WORLD))
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--inprocess", action="store_true",
                    help="signed vs unsigned gloo all-reduce in the same processes")
    ap.add_argument("--job", choices=sorted(_WORLD), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        _job(args.job, args.iters)
        return 0
    if args.inprocess:
        times = _inprocess(args.iters, args.rounds)
        ms, mu = statistics.median(times["signed"]), statistics.median(times["unsigned"])
        print(f"gloo in-process: unsigned median {mu:8.1f} us  signed median {ms:8.1f} us  "
              f"signed/unsigned {ms / mu:6.3f}   (unsigned "
              f"{[round(v, 1) for v in times['unsigned']]}, signed "
              f"{[round(v, 1) for v in times['signed']]})")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(times, indent=1))
        return 0
    if not args.old:
        ap.error("--old is required")
    trees = {"old": args.old, "new": args.new}
    results: dict[str, dict[str, list[float]]] = {p: {"old": [], "new": []} for p in args.paths}
    for rnd in range(args.rounds):
        for path in args.paths:
            order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
            for which in order:
                r = _run(trees[which], path, args.iters)
                if not r["ok"]:
                    raise RuntimeError(f"{which} tree, path {path}: wrong mode or result: {r}")
                results[path][which].append(r["us"])
                print(f"round {rnd} {path:12s} {which}: {r['us']:8.1f} us", flush=True)
    print()
    for path, by in results.items():
        mo, mn = statistics.median(by["old"]), statistics.median(by["new"])
        print(f"{path:12s} old median {mo:8.1f} us  new median {mn:8.1f} us  "
              f"new/old {mn / mo:6.3f}   (old {[round(v, 1) for v in by['old']]}, "
              f"new {[round(v, 1) for v in by['new']]})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
