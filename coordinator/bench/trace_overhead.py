"""``groupcoord bench trace``: what the flight recorder costs per call.

Every rank builds two copies of the same group over all ranks: one writing to
the process's flight recorder, one with the recorder off (built while a
disabled recorder is current: :func:`coordinator.trace.recorder.reset_recorder`).
Each copy has its own communicator and message queues, so the two differ only
in the recording. Their samples are taken **in the same processes, interleaved
in blocks** (machine noise hits both alike), for:

* ``all_reduce`` of ``--sizes`` bytes (default 1 KiB and 64 KiB, float32);
* the queue round trip (``--queue-bytes``, default 4 KB): rank 0 broadcasts
  the message with ``broadcast_object`` through the group's queue (writer rank
  0; a recorded call on every rank), and rank 1 answers through a second queue
  of the group whose writer it is, used directly (not a group call, so not
  recorded): the engine's step-metadata pattern. The other ranks only read.

A sample is one call (a round trip for the queue), timed on rank 0; the ranks
start each block together after a barrier. Reported per case and recorder
setting: the median of each round's median, the p99 over all samples, and the
difference on - off of the medians (the recorder's cost per call; a round trip
is one recorded call on each rank). ``--rounds`` rounds of ``--blocks``
alternating blocks of ``--block`` calls.

Torch threads per rank (``--threads``): ``default`` (torch's own default) and
``1`` run as separate rank sets, one after the other.

``--control`` builds both copies with the recorder off, so that the
difference column shows what the harness itself reads between two identical
groups (each copy has its own shared-memory workspace).

Run: ``groupcoord bench trace --world-size 2 --rounds 5 --json trace.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from time import perf_counter_ns
from typing import Any

from coordinator.bench.cli import parse_threads
from device_comms.bench.report import load_average
from shm_broadcast.cli_args import MAX_THREADS, number, output_path, size_bytes

__all__ = ["add_args", "run", "bench_rank"]


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``p``."""
    p.add_argument("--world-size", type=number(int, minimum=2), default=2,
                   help="ranks (default 2)")
    p.add_argument("--sizes", type=size_bytes, nargs="+", default=[1024, 65536],
                   help="all_reduce sizes in bytes (default 1K 64K)")
    p.add_argument("--queue-bytes", type=size_bytes, default=4096,
                   help="queue round-trip message payload (default 4K)")
    p.add_argument("--rounds", type=number(int, minimum=1), default=5,
                   help="rounds (default 5; the report is the median of the rounds' medians)")
    p.add_argument("--blocks", type=number(int, minimum=1), default=4,
                   help="on/off block pairs per round and case (default 4)")
    p.add_argument("--block", type=number(int, minimum=1), default=200,
                   help="calls per block (default 200)")
    p.add_argument("--threads", nargs="+", type=parse_threads, default=["default", 1],
                   help=f"torch threads per rank: 'default' and/or numbers from 1 to "
                        f"{MAX_THREADS} (default: default 1)")
    p.add_argument("--timeout", type=number(float, above=0), default=600.0,
                   help="seconds before the ranks are killed (default 600)")
    p.add_argument("--control", action="store_true",
                   help="build both copies with the recorder off: the 'on - off' column is "
                        "then the harness's own bias between two identical groups")
    p.add_argument("--json", dest="json_path", default=None, type=output_path,
                   help="write the records here")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status."""
    from coordinator.testing import run_distributed

    records: list[dict[str, Any]] = []
    for threads in args.threads:
        cfg = {"sizes": list(args.sizes), "queue_bytes": args.queue_bytes,
               "rounds": args.rounds, "blocks": args.blocks, "block": args.block,
               "threads": threads, "control": bool(args.control)}
        print(f"# world size {args.world_size}, torch threads per rank: {threads}"
              + (" (control: both copies unrecorded)" if args.control else ""), flush=True)
        results = run_distributed(bench_rank, args.world_size, cfg, timeout=args.timeout)
        rows = results[0]
        records.extend(rows)
        print(format_table(rows), flush=True)
    if args.json_path:
        meta = {"command": shlex.join(sys.argv),
                "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "loadavg": load_average()}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        print(f"wrote {args.json_path}")
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """The records as a text table, one line per case."""
    lines = [f"{'case':<22}{'threads':>8}{'off med us':>12}{'on med us':>12}"
             f"{'on-off us':>11}{'off p99':>10}{'on p99':>10}{'rounds':>8}"]
    for r in rows:
        lines.append(f"{r['case']:<22}{r['threads']:>8}{r['off_median_us']:>12.2f}"
                     f"{r['on_median_us']:>12.2f}{r['delta_us']:>11.2f}"
                     f"{r['off_p99_us']:>10.1f}{r['on_p99_us']:>10.1f}{r['rounds']:>8}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- per rank
def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run on every rank; rank 0 returns the records, the others []."""
    import torch
    import torch.distributed as dist

    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.trace.recorder import FlightRecorder, recorder, reset_recorder

    if cfg["threads"] != "default":
        torch.set_num_threads(int(cfg["threads"]))
    threads = torch.get_num_threads()
    ranks = [list(range(world_size))]
    if not recorder().enabled:
        raise RuntimeError("the flight recorder is off in this process "
                           "(GROUPCOORD_TRACE_BUFFER=0): nothing to compare")

    def build(name: str) -> tuple[Any, Any]:
        g = GroupCoordinator(ranks, 0, "gloo", True, True, group_name=name)
        back = g.create_mq_broadcaster(writer_rank=1)
        return g, back

    def unrecorded(name: str) -> tuple[Any, Any]:
        """A copy built while a disabled recorder is current (it records nothing)."""
        previous = reset_recorder(FlightRecorder(0))
        try:
            return build(name)
        finally:
            reset_recorder(previous)

    # with --control the "on" copy records nothing either
    on = unrecorded("trace_on") if cfg.get("control") else build("trace_on")
    off = unrecorded("trace_off")
    try:
        rows = _measure(rank, on, off, cfg, threads)
        # whether the "on" copy wrote to the recorder (not with --control)
        recorded = any(t.desc == "trace_on" for t in recorder().groups())
        for row in rows:
            row["on_recorded"] = recorded
    finally:
        for g, back in (on, off):
            back.close()
            g.destroy()
    dist.barrier()
    return rows if rank == 0 else []


def _measure(rank: int, on: tuple[Any, Any], off: tuple[Any, Any], cfg: dict[str, Any],
             threads: int) -> list[dict[str, Any]]:
    import torch

    cases: list[tuple[str, Any]] = []
    for nbytes in cfg["sizes"]:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        cases.append((f"all_reduce {_label(nbytes)}", _all_reduce_call(x)))
    payload = b"x" * cfg["queue_bytes"]
    cases.append((f"queue round trip {_label(cfg['queue_bytes'])}",
                  _round_trip_call(rank, payload)))
    rows = []
    for case, make in cases:
        samples: dict[str, list[float]] = {"off": [], "on": []}
        medians: dict[str, list[float]] = {"off": [], "on": []}
        call_on, call_off = make(*on), make(*off)
        for _ in range(20):  # warm both copies
            call_on()
            call_off()
        for _ in range(cfg["rounds"]):
            got: dict[str, list[float]] = {"off": [], "on": []}
            for b in range(cfg["blocks"]):
                order = (("off", call_off), ("on", call_on)) if b % 2 == 0 else \
                    (("on", call_on), ("off", call_off))
                for setting, call in order:
                    on[0].barrier()
                    got[setting].extend(_time_block(call, cfg["block"]))
            for setting in ("off", "on"):
                medians[setting].append(statistics.median(got[setting]))
                samples[setting].extend(got[setting])
        off_med = statistics.median(medians["off"])
        on_med = statistics.median(medians["on"])
        rows.append({
            "case": case, "threads": threads,
            "off_median_us": off_med, "on_median_us": on_med, "delta_us": on_med - off_med,
            "off_p99_us": _pct(samples["off"], 0.99), "on_p99_us": _pct(samples["on"], 0.99),
            "off_round_medians_us": medians["off"], "on_round_medians_us": medians["on"],
            "rounds": cfg["rounds"], "samples_per_setting": len(samples["on"]),
        })
    return rows


def _all_reduce_call(x: Any) -> Any:
    def make(group: Any, back: Any) -> Any:
        return lambda: group.all_reduce(x)
    return make


def _round_trip_call(rank: int, payload: bytes) -> Any:
    def make(group: Any, back: Any) -> Any:
        def call() -> None:
            group.broadcast_object(payload if rank == 0 else None, src=0)
            # the reply travels through the group's second queue (writer rank 1)
            if rank == 1:
                back.enqueue(b"ok")
            else:
                back.dequeue()
        return call
    return make


def _time_block(call: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = perf_counter_ns()
        call()
        out.append((perf_counter_ns() - t0) / 1e3)
    return out


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _label(nbytes: int) -> str:
    if nbytes % 1024 == 0:
        return f"{nbytes // 1024} KiB"
    return f"{nbytes} B"
