"""``groupcoord bench engine``: options, running the ranks, printing the report.

Example::

    groupcoord bench engine --tp 2 --step-ms 10 --layers 8 --allreduce-bytes 64K \\
        --policies predictive plain spin --rounds 3 --load thread --json engine.json \\
        --plot engine.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from shm_broadcast import cli_args
from shm_broadcast.cli_args import number, output_path, size_bytes

__all__ = ["add_args", "run", "parse_size", "parse_threads"]


def parse_size(text: str) -> int:
    """``4096``, ``64K``, ``1M`` (binary units) -> bytes > 0."""
    return size_bytes(text)


#: ``--threads``: ``default`` or an int from 1 to 1024 (:func:`shm_broadcast.cli_args.threads`).
parse_threads = cli_args.threads


def _positive(kind: type) -> Any:
    """A finite ``kind`` > 0 (nan and inf refused)."""
    return number(kind, above=0)


_non_negative_int = number(int, minimum=0)


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``p``."""
    from coordinator.bench.loop import POLICY_NAMES

    p.description = ("The demo's step loop without the model: the driver broadcasts metadata "
                     "through the TP broadcaster on a fixed clock, every rank runs one TP "
                     "all_reduce per simulated layer; optional background compute load. Reports "
                     "latency distributions and CPU per rank.")
    p.add_argument("--tp", type=_positive(int), default=2, help="TP size = ranks (default 2)")
    p.add_argument("--step-ms", type=_positive(float), default=10.0,
                   help="time between step starts (default 10)")
    p.add_argument("--steps", type=_positive(int), default=300,
                   help="recorded steps per block (default 300)")
    p.add_argument("--warmup-steps", type=_non_negative_int, default=30,
                   help="unrecorded steps at the start of each block (default 30)")
    p.add_argument("--layers", type=_non_negative_int, default=8,
                   help="all_reduce calls per step (default 8)")
    p.add_argument("--allreduce-bytes", type=parse_size, default=64 << 10,
                   help="bytes per all_reduce, float32 (default 64K)")
    p.add_argument("--meta-bytes", type=parse_size, default=3000,
                   help="metadata per step, about this many bytes (default 3000)")
    p.add_argument("--threads", type=parse_threads, default=1,
                   help="torch threads per rank: N or 'default' (torch's own; default 1)")
    p.add_argument("--load", choices=("none", "thread", "process"), default="none",
                   help="background compute: matmuls in a thread of every rank, or one busy "
                        "process per rank (default none)")
    p.add_argument("--load-size", type=_positive(int), default=256,
                   help="matrix dimension of the load (default 256)")
    p.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=["predictive"],
                   help="readers' wait policies to compare in interleaved blocks: predictive "
                        "(the broadcaster default), plain (spin -> yield 2 ms -> park), spin "
                        "(yield-poll for 1 s, like vLLM's reader); default predictive")
    p.add_argument("--rounds", type=_positive(int), default=1,
                   help="blocks per policy, interleaved (default 1)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", type=output_path,
                   help="write the report as JSON")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH", type=output_path,
                   help="write a PNG plot (needs matplotlib: pip install 'groupcoord[plot]')")
    p.add_argument("--timeout", type=_positive(float), default=900.0,
                   help="seconds before the ranks are killed (default 900)")


def _check(args: argparse.Namespace) -> str | None:
    if args.tp < 2:
        return f"--tp must be >= 2 (a broadcaster needs readers), got {args.tp}"
    if args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'groupcoord[plot]'"
    return None


def _config(args: argparse.Namespace) -> Any:
    import torch

    from coordinator.bench.loop import EngineBenchConfig

    threads = torch.get_num_threads() if args.threads == "default" else args.threads
    return EngineBenchConfig(
        tp=args.tp, step_ms=args.step_ms, steps=args.steps, warmup_steps=args.warmup_steps,
        layers=args.layers, allreduce_bytes=args.allreduce_bytes, meta_bytes=args.meta_bytes,
        threads=threads, load=args.load, load_size=args.load_size,
        policies=tuple(dict.fromkeys(args.policies)), rounds=args.rounds)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 1 when a rank failed, 2 on bad options."""
    from coordinator.errors import DistributedTimeout, RankFailedError

    problem = _check(args)
    if problem:
        print(f"groupcoord bench engine: error: {problem}", file=sys.stderr)
        return 2
    cfg = _config(args)
    try:
        per_rank = _run_ranks(cfg, args.timeout)
    except (RankFailedError, DistributedTimeout) as e:
        print(f"groupcoord bench engine: failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    _report(args, cfg, per_rank)
    return 0


def _run_ranks(cfg: Any, timeout: float) -> list[dict[str, Any]]:
    from coordinator.bench.load import start_load_processes, stop_load_processes
    from coordinator.bench.loop import bench_rank
    from coordinator.testing import run_distributed
    from device_comms.bench.report import human_bytes

    blocks = cfg.rounds * len(cfg.policies)
    print(f"groupcoord bench engine: TP={cfg.tp}, step {cfg.step_ms:g} ms, {cfg.layers} x "
          f"all_reduce {human_bytes(cfg.allreduce_bytes)} float32 per step, metadata "
          f"~{cfg.meta_bytes} B, torch threads {cfg.threads}, load {cfg.load}; {blocks} block(s) "
          f"of {cfg.warmup_steps} + {cfg.steps} steps ({', '.join(cfg.policies)})", flush=True)
    procs, stop = start_load_processes(cfg.tp, cfg.load_size, cfg.threads) \
        if cfg.load == "process" else ([], None)
    try:
        return run_distributed(bench_rank, cfg.tp, cfg, timeout=timeout)
    finally:
        if stop is not None:
            stop_load_processes(procs, stop)


def _report(args: argparse.Namespace, cfg: Any, per_rank: list[dict[str, Any]]) -> None:
    import dataclasses

    from coordinator.bench.report import format_table, summarize, write_json, write_plot

    rows = summarize(per_rank)
    print(format_table(rows))
    meta = {"config": dataclasses.asdict(cfg), "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "argv": sys.argv}
    if args.json_path:
        write_json(args.json_path, rows, meta)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        write_plot(args.plot_path, per_rank)
        print(f"wrote {args.plot_path}")
