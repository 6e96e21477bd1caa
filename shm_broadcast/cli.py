"""CLI pieces of shm_broadcast: ``groupcoord cleanup`` and ``groupcoord bench mq``.

The ``groupcoord`` console script (``coordinator.cli``) wires these in::

    p = sub.add_parser("cleanup", help=...); add_cleanup_args(p); p.set_defaults(func=run_cleanup)
    p = bench_sub.add_parser("mq", help=...); add_bench_args(p); p.set_defaults(func=run_bench)

They also run stand-alone: ``python -m shm_broadcast.cli cleanup [--yes]`` and
``python -m shm_broadcast.cli bench [options]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shm_broadcast.cli_args import number, output_path

if TYPE_CHECKING:
    from shm_broadcast.lifecycle.channel_dirs import ChannelDirInfo
    from shm_broadcast.lifecycle.segment import SegmentInfo

__all__ = ["add_cleanup_args", "run_cleanup", "add_bench_args", "run_bench", "main"]


def add_cleanup_args(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``groupcoord cleanup`` to ``parser``."""
    parser.description = (
        "List what groupcoord left behind whose owner process is provably gone: shared-memory "
        "segments in /dev/shm (gc_*), owner records without their segment (gc_*.owner), and "
        "queue channel directories (gc* under $XDG_RUNTIME_DIR, the temp directory, /tmp); "
        "with --yes, remove them. Anything whose owner cannot be judged (another pid "
        "namespace, no owner record) is listed with the reason and kept; only this user's "
        "files of exactly our form are ever touched.")
    parser.add_argument("--yes", "-y", action="store_true",
                        help="remove what is orphaned (default: only list it)")
    parser.add_argument("--all", action="store_true",
                        help="also list what is in use by a live owner (never removed)")


def run_cleanup(args: argparse.Namespace) -> int:
    """Run ``groupcoord cleanup``.

    Returns:
        0 when nothing was left undone, 1 when a removal failed, 2 when ``--yes``
        kept something whose owner could not be judged (listed with the reason).
    """
    from shm_broadcast.lifecycle.channel_dirs import list_channel_dirs
    from shm_broadcast.lifecycle.segment import SHM_DIR, list_orphan_records, list_segments

    segs, dirs, records = list_segments(), list_channel_dirs(), list_orphan_records()
    if getattr(args, "all", False):
        for s in segs:
            if s.status == "alive":
                print(f"in use   {s.name}  ({s.kind}, {_size(s.size)}, owner pid {s.pid}: "
                      f"{s.reason})")
        for d in dirs:
            if d.status == "alive":
                print(f"in use   {d.path}  (channel directory, owner pid {d.pid}: {d.reason})")
    unknown = [s.name for s in segs if s.status == "unknown"]
    unknown += [d.path for d in dirs if d.status == "unknown"]
    for s in segs:
        if s.status == "unknown":
            print(f"kept     {s.name}  ({s.kind}, {_size(s.size)}, owner pid {s.pid}: cannot tell "
                  f"whether it is alive: {s.reason})")
    for d in dirs:
        if d.status == "unknown":
            print(f"kept     {d.path}  (channel directory{_pid_text(d.pid)}: cannot tell whether "
                  f"it is alive or remove it safely: {d.reason})")
    orphans = [s for s in segs if s.status == "gone"]
    dead_dirs = [d for d in dirs if d.status == "gone"]
    if not orphans and not dead_dirs and not records:
        print(f"nothing orphaned: no groupcoord segment, owner record or channel directory of a "
              f"dead process in {SHM_DIR} or {', '.join(_bases())}")
        return _unknown_status(unknown, args.yes)
    if not args.yes:
        _list_orphans(orphans, dead_dirs, records)
        return _unknown_status(unknown, args.yes)
    failed = _remove_orphans(orphans, dead_dirs, records)
    return 1 if failed else _unknown_status(unknown, args.yes)


def _list_orphans(orphans: list[SegmentInfo], dead_dirs: list[ChannelDirInfo],
                  records: list[str]) -> None:
    for s in orphans:
        print(f"orphan   {s.name}  ({s.kind}, {_size(s.size)}, owner pid {s.pid}: {s.reason})")
    for r in records:
        print(f"orphan   {r}  (owner record whose segment is gone)")
    for d in dead_dirs:
        print(f"orphan   {d.path}  (channel directory, owner pid {d.pid}: {d.reason})")
    total = sum(s.size for s in orphans)
    print(f"{len(orphans)} orphaned segment(s) ({_size(total)}), {len(records)} owner record(s), "
          f"{len(dead_dirs)} channel directory(ies); run `groupcoord cleanup --yes` to remove them")


def _remove_orphans(orphans: list[SegmentInfo], dead_dirs: list[ChannelDirInfo],
                    records: list[str]) -> int:
    """Remove (re-judging first); returns how many removals failed."""
    from shm_broadcast.lifecycle.channel_dirs import remove_dead_channel_dirs
    from shm_broadcast.lifecycle.segment import (
        SHM_DIR,
        list_segments,
        remove_orphan_records,
        remove_orphans,
    )

    failed = 0
    removed = remove_orphans(dry_run=False)
    still = {s.name for s in list_segments() if s.status == "gone"}
    for s in removed:
        if s.name in still:
            failed += 1
            print(f"FAILED   {s.name}  (could not remove)", file=sys.stderr)
        else:
            print(f"removed  {s.name}  ({s.kind}, {_size(s.size)}, owner pid {s.pid}: {s.reason})")
    for r in remove_orphan_records(dry_run=False):
        if os.path.lexists(os.path.join(SHM_DIR, r)):
            failed += 1
            print(f"FAILED   {r}  (could not remove)", file=sys.stderr)
        else:
            print(f"removed  {r}  (owner record whose segment is gone)")
    n_dirs = 0
    for d, why in remove_dead_channel_dirs(dry_run=False):
        if why is None:
            n_dirs += 1
            print(f"removed  {d.path}  (channel directory, owner pid {d.pid}: {d.reason})")
        else:
            failed += 1
            print(f"FAILED   {d.path}  (could not remove: {why})", file=sys.stderr)
    n_segs = len(removed) - sum(1 for s in removed if s.name in still)
    print(f"removed {n_segs} orphaned segment(s) and {n_dirs} channel directory(ies)")
    return failed


def _pid_text(pid: int) -> str:
    return f", owner pid {pid}" if pid else ""


def _bases() -> list[str]:
    from shm_broadcast.lifecycle.leftovers import channel_dir_bases

    return channel_dir_bases()


def _unknown_status(unknown: list[str], yes: bool) -> int:
    """Exit status for items kept undecided: 2 with ``--yes`` (the caller asked to clean)."""
    if not unknown:
        return 0
    print(f"{len(unknown)} item(s) kept: their owner cannot be proven gone from here (see "
          "above); run cleanup where the owner ran (same pid namespace), or remove them by "
          "hand if you know the owner is gone", file=sys.stderr)
    return 2 if yes else 0


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``groupcoord bench mq`` to ``parser``."""
    from shm_broadcast.bench.payloads import payload_names

    parser.description = (
        "Benchmark the shared-memory MessageQueue (1 writer, N local reader processes) "
        "against gloo broadcast_object_list and pickle over zmq ipc PUB/SUB, in one run.")
    parser.add_argument("--readers", type=number(int, minimum=1), nargs="+", default=[1, 3],
                        metavar="N",
                        help="reader process counts (default: 1 3)")
    parser.add_argument("--payloads", nargs="+", default=payload_names(),
                        choices=payload_names(), help="payloads (default: all)")
    parser.add_argument("--seconds", type=number(float, minimum=0), default=1.0,
                        help="target seconds per measurement (default 1.0)")
    parser.add_argument("--max-iters", type=number(int, minimum=5), default=5000,
                        help="cap on iterations per measurement (default 5000)")
    parser.add_argument("--idle", type=number(float, minimum=0), default=5.0, metavar="SECONDS",
                        help="idle period of the idle-CPU/wake-up test, 0 to skip (default 5)")
    parser.add_argument("--wake-samples", type=number(int, minimum=1), default=20, metavar="N",
                        help="wake-up latency samples after the idle period (default 20)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="measure only the MessageQueue")
    parser.add_argument("--chunk-bytes", type=number(int, minimum=128, maximum=1 << 30),
                        default=None, metavar="BYTES",
                        help="ring chunk size of the measured queue (default: MessageQueue's)")
    parser.add_argument("--chunks", type=number(int, minimum=1, maximum=1 << 16), default=None,
                        metavar="N",
                        help="ring chunks of the measured queue (default: MessageQueue's)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="also write the report as JSON")


def run_bench(args: argparse.Namespace) -> int:
    """Run ``groupcoord bench mq``; prints the table, returns the exit status."""
    from shm_broadcast.bench.mq import BenchConfig, format_table
    from shm_broadcast.bench.mq import run_bench as _run

    ring = {}  # (the options' types checked their ranges)
    if getattr(args, "chunk_bytes", None) is not None:
        ring["chunk_bytes"] = args.chunk_bytes
    if getattr(args, "chunks", None) is not None:
        ring["chunks"] = args.chunks
    cfg = BenchConfig(readers=list(args.readers), payloads=list(args.payloads),
                      seconds=args.seconds, max_iters=args.max_iters,
                      baselines=not args.no_baselines, idle_s=args.idle,
                      wake_samples=args.wake_samples, **ring)
    report = _run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    report["command"] = shlex.join(sys.argv)
    print(format_table(report))
    print(f"load average at start {report['host']['loadavg_at_start']}, at end "
          f"{report['host']['loadavg_at_end']} ({report['host']['cpus']} CPUs)")
    print("rt = writer sends to all readers, each decodes and acks, writer has all acks; "
          "stream = N back-to-back messages, one ack at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shm_broadcast.cli {cleanup,bench} ...``."""
    parser = argparse.ArgumentParser(prog="python -m shm_broadcast.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cleanup", help="list/remove orphaned segments and channel directories")
    add_cleanup_args(p)
    p.set_defaults(func=run_cleanup)
    p = sub.add_parser("bench", help="benchmark the message queue (groupcoord bench mq)")
    add_bench_args(p)
    p.set_defaults(func=run_bench)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
