"""Step-periodic metadata, one writer and one reader: our queue against vLLM's.

Issue 14, item 2 (a): a writer sends ~3 KB of metadata every ``--step-ms``
(10 ms) to one reader. Measured per message: **arrival latency** (the writer
reads the clock just before ``enqueue``, the reader right after ``dequeue``
returns; ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for
both processes) and, per block of steps, the **reader's CPU** (its process
CPU time over the block's wall time, zmq I/O threads included).

Contenders, each a writer process with its reader child, started once and
then run in interleaved blocks (so load changes on a shared machine hit all
of them alike):

* ``ours`` -- groupcoord's ``MessageQueue`` with the predictive policy that
  group broadcasters use (``WaitPolicy.predictive()``);
* ``ours-stay`` -- the same with ``leave_shared_cpu=False``: the reader does
  not move off a CPU its polls found shared (not run unless named in
  ``--contenders``);
* ``ours-plain`` -- the same queue with the plain spin -> yield -> park policy;
* ``vllm`` -- ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``
  in its own virtual environment (its reader spins with ``sched_yield`` for
  1 s after each message, i.e. all the time at 10 ms steps).

Blocks are ``--settle`` seconds apart (1.5 s): vLLM's reader keeps spinning
for a second after its block's last message, and without the gap that
spinning took a CPU from the first second of the next contender's block
(ours measured 94 us p50 with it, 80 us without vLLM in the run at all).

This script is not part of the package or the test suite and imports neither
at module level: each side imports its own queue in its own interpreter (ours
from this checkout, vLLM's from ``--vllm-python``'s environment, with
``VLLM_TARGET_DEVICE=cpu``).

Run (from the repository root)::

    python docs/bench/vllm_step_arrival.py \\
        --vllm-python ~/.cache/groupcoord-anchors/vllm/bin/python \\
        --rounds 6 --steps 200 --json step_arrival.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_RESULT = "RESULT "
_CHUNK_BYTES = 2 << 20
_CHUNKS = 4


def metadata(step: int) -> dict[str, Any]:
    """~3 KB of scheduler-like metadata (msgpack 3.0 KB, pickle 3.5 KB)."""
    reqs = 64
    return {
        "step": step, "t": 0.0,
        "req_ids": [f"req-{step % 7}-{i:04d}" for i in range(reqs)],
        "num_tokens": [1 + (i * 7 + step) % 5 for i in range(reqs)],
        "positions": [(step * 3 + i * 11) % 4096 for i in range(reqs)],
        "new_token_ids": [(step * 131 + i * 17) % 32000 for i in range(reqs)],
        "block_tables": [[(i * 16 + j) % 8192 for j in range(10)] for i in range(reqs)],
        "finished": [], "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": step},
    }


# ------------------------------------------------------------------ one side
def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[cpu % len(cpus)]})


def _reader_main(kind: str, handle: Any, policy: str, out: Any, cpu: int | None) -> None:
    """The reader child: dequeue; per block report latencies and CPU."""
    _pin(cpu)
    mq = _open_reader(kind, handle, policy)
    lat: list[float] = []
    cpu0 = wall0 = 0.0
    while True:
        msg = mq.dequeue()
        now = time.perf_counter()
        cmd = msg.get("cmd") if isinstance(msg, dict) else None
        if cmd == "begin":
            lat = []
            cpu0, wall0 = time.process_time(), time.monotonic()
        elif cmd == "end":
            cpu = (time.process_time() - cpu0) / max(1e-9, time.monotonic() - wall0)
            extra = mq.park_stats() if kind != "vllm" else {}
            out.put({"lat_us": lat, "cpu_pct": 100.0 * cpu, "stats": extra})
        elif cmd == "quit":
            break
        else:
            lat.append((now - msg["t"]) * 1e6)
    if kind != "vllm":
        mq.close()


def _open_reader(kind: str, handle: Any, policy: str) -> Any:
    if kind == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        mq = VQ.create_from_handle(handle, 1)
        mq.wait_until_ready()
        return mq
    from shm_broadcast import MessageQueue, WaitPolicy

    if policy == "predictive":
        pol = WaitPolicy.predictive()
    elif policy == "predictive-stay":
        pol = WaitPolicy.predictive(leave_shared_cpu=False)
    else:
        pol = WaitPolicy()
    mq = MessageQueue.create_from_handle(handle, 1, wait_policy=pol)
    mq.wait_until_ready(120)
    return mq


def _side(kind: str, policy: str, step_s: float, pin: bool) -> int:
    """A writer process: start the reader, then obey ``run N`` / ``quit`` on stdin."""
    _pin(0 if pin else None)
    ctx = mp.get_context("spawn")
    if kind == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        mq = VQ(1, 1, [1], max_chunk_bytes=_CHUNK_BYTES, max_chunks=_CHUNKS)
        handle = mq.export_handle()
    else:
        from shm_broadcast import MessageQueue

        mq = MessageQueue(1, 1, [1], max_chunk_bytes=_CHUNK_BYTES, max_chunks=_CHUNKS,
                          name="step-arrival")
        handle = mq.export_handle()
    out = ctx.Queue()
    proc = ctx.Process(target=_reader_main, args=(kind, handle, policy, out, 1 if pin else None),
                       daemon=True)
    proc.start()
    if kind == "vllm":
        mq.wait_until_ready()
    else:
        mq.wait_until_ready(120)
    print("READY", flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            enq = _run_block(mq, int(words[1]), step_s)
            res = out.get(timeout=600)
            res["enqueue_us"] = enq
            print(_RESULT + json.dumps(res), flush=True)
        mq.enqueue({"cmd": "quit"})
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if kind != "vllm":
            mq.close()
    return 0


def _run_block(mq: Any, n: int, step_s: float) -> list[float]:
    """``n`` messages on a clock (absolute deadlines), between begin/end markers."""
    msgs = [metadata(k) for k in range(n)]
    mq.enqueue({"cmd": "begin"})
    enq: list[float] = []
    clock = time.perf_counter
    nxt = clock() + step_s
    for msg in msgs:
        delay = nxt - clock()
        if delay > 0:
            time.sleep(delay)
        t0 = clock()
        msg["t"] = t0
        mq.enqueue(msg)
        enq.append((clock() - t0) * 1e6)
        nxt += step_s
    time.sleep(step_s)
    mq.enqueue({"cmd": "end"})
    return enq


# ---------------------------------------------------------------- orchestrator
def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * (len(s) - 1) + 0.5))] if s else float("nan")


def _start(kind: str, policy: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ)
    if kind == "vllm":
        py = os.path.expanduser(args.vllm_python)
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.pop("PYTHONPATH", None)
    else:
        py = sys.executable
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [py, os.path.abspath(__file__), "--side", kind, "--policy", policy,
           "--step-ms", str(args.step_ms)] + (["--pin"] if args.pin else [])
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                         cwd=_ROOT)
    for line in p.stdout:  # type: ignore[union-attr]
        if line.startswith("READY"):
            return p
    raise RuntimeError(f"side {kind} ({policy}) did not start: exit code {p.wait()}")


def _block(p: subprocess.Popen, n: int) -> dict[str, Any]:
    p.stdin.write(f"run {n}\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]
    for line in p.stdout:  # type: ignore[union-attr]
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    raise RuntimeError("a side exited in the middle of a block")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="predictive", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default="~/.cache/groupcoord-anchors/vllm/bin/python",
                    help="python of the venv with vLLM (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="writer period (default 10)")
    ap.add_argument("--steps", type=int, default=200, help="messages per block (default 200)")
    ap.add_argument("--rounds", type=int, default=4, help="blocks per contender (default 4)")
    ap.add_argument("--skip", type=int, default=20,
                    help="first messages of each block not counted (learning; default 20)")
    ap.add_argument("--settle", type=float, default=1.5,
                    help="idle seconds between blocks (default 1.5): vLLM's reader goes on "
                         "spinning for 1 s after its last message, which would otherwise "
                         "take a CPU from the next contender's block")
    ap.add_argument("--contenders", nargs="+", default=["ours", "ours-plain", "vllm"],
                    choices=("ours", "ours-stay", "ours-plain", "vllm"))
    ap.add_argument("--pin", action="store_true",
                    help="bind every writer to the first allowed CPU and every reader to the "
                         "second (dedicated cores; without it the scheduler places them)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.side:
        return _side(args.side, args.policy, args.step_ms / 1e3, args.pin)
    if args.steps <= args.skip:
        ap.error("--steps must be larger than --skip")
    specs = {"ours": ("ours", "predictive"), "ours-stay": ("ours", "predictive-stay"),
             "ours-plain": ("ours", "plain"),
             "vllm": ("vllm", "spin")}
    procs = {name: _start(*specs[name], args) for name in args.contenders}
    pooled: dict[str, dict[str, list[float]]] = {
        n: {"lat": [], "cpu": [], "enq": [], "after": []} for n in procs}
    stats: dict[str, list[Any]] = {n: [] for n in procs}
    load0 = os.getloadavg()
    try:
        for r in range(args.rounds):
            for name, p in procs.items():
                time.sleep(args.settle)
                res = _block(p, args.steps)
                pooled[name]["lat"] += res["lat_us"][args.skip:]
                pooled[name]["cpu"].append(res["cpu_pct"])
                pooled[name]["enq"] += res["enqueue_us"][args.skip:]
                # Message by message: how long the reader took after enqueue returned.
                pooled[name]["after"] += [lat - enq for lat, enq in zip(
                    res["lat_us"][args.skip:], res["enqueue_us"][args.skip:], strict=True)]
                stats[name].append(res.get("stats"))
                print(f"round {r} {name:<10} p50 {_pct(res['lat_us'][args.skip:], 50):8.1f} us  "
                      f"cpu {res['cpu_pct']:5.1f}%", flush=True)
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    report = _report(args, pooled, stats, load0)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _report(args: argparse.Namespace, pooled: dict[str, dict[str, list[float]]],
            stats: dict[str, list[Any]], load0: tuple[float, ...]) -> dict[str, Any]:
    rows = {}
    print(f"\n{args.rounds} rounds x {args.steps - args.skip} counted messages, step "
          f"{args.step_ms} ms; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'contender':<11} {'p50 us':>8} {'p90 us':>8} {'p99 us':>9} {'reader CPU %':>12} "
          f"{'enqueue p50 us':>14} {'after enqueue p50 us':>20} {'CPU moves':>9}")
    for name, d in pooled.items():
        rows[name] = {"p50_us": _pct(d["lat"], 50), "p90_us": _pct(d["lat"], 90),
                      "p99_us": _pct(d["lat"], 99), "n": len(d["lat"]),
                      "reader_cpu_pct": sum(d["cpu"]) / len(d["cpu"]),
                      "reader_cpu_pct_blocks": d["cpu"],
                      "enqueue_p50_us": _pct(d["enq"], 50),
                      "after_enqueue_p50_us": _pct(d["after"], 50), "queue_stats": stats[name]}
        r = rows[name]
        last = (stats[name] or [None])[-1] or {}
        moves = last.get("cpu_moves", "-")  # the reader's counters are totals since it started
        print(f"{name:<11} {r['p50_us']:8.1f} {r['p90_us']:8.1f} {r['p99_us']:9.1f} "
              f"{r['reader_cpu_pct']:12.1f} {r['enqueue_p50_us']:14.1f} "
              f"{r['after_enqueue_p50_us']:20.1f} {moves:>9}")
    if "ours" in rows and "vllm" in rows:
        ratio = rows["ours"]["p50_us"] / rows["vllm"]["p50_us"]
        print(f"ours / vllm arrival p50: {ratio:.2f}x (target <= 0.8x); ours reader CPU "
              f"{rows['ours']['reader_cpu_pct']:.1f}% (target <= 5%, issue 40)")
    return {"config": {k: v for k, v in vars(args).items() if k not in ("side", "policy")},
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "results": rows}


if __name__ == "__main__":
    sys.exit(main())
