"""The ``groupcoord`` command line.

Subcommands (each module is imported only when its command runs)::

    groupcoord demo [...]               sharded model demo, checked against a reference
    groupcoord bench mq [...]           shared-memory queue vs gloo and pickle+zmq
    groupcoord bench mq-hotpath [...]   the queue's CPU cost per message (one process)
    groupcoord bench mq-remote [...]    the queue's TCP path (CURVE) vs plain zmq
    groupcoord bench collectives [...]  CPU shared-memory collectives vs gloo
    groupcoord bench p2p [...]          tensor dicts between stages: links vs the CPU group
    groupcoord bench trace [...]        the flight recorder's cost per call, on vs off
    groupcoord bench engine [...]       the demo's step loop without the model: metadata
                                        arrival, all_reduce latency and CPU per rank
    groupcoord cleanup [--yes]          list / remove segments and channel dirs of dead processes
    groupcoord doctor [--json]          environment report for bug reports
    groupcoord trace DIR [--json]       read flight-recorder dumps: who is behind, where
                                        the ranks first disagreed, and the culprits
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "build_parser"]

# command -> (module, function adding arguments, function running the command)
_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("coordinator.engine.demo.cli", "add_args", "run", "run the sharded model demo"),
    "cleanup": ("shm_broadcast.cli", "add_cleanup_args", "run_cleanup",
                "list (and with --yes remove) segments, owner records and channel "
                "directories whose owner died"),
    "doctor": ("coordinator.doctor", "add_args", "run", "print an environment report"),
    "trace": ("coordinator.trace.cli", "add_args", "run",
              "read a directory of flight-recorder dumps: who is behind, where the ranks "
              "first disagreed and which ranks differ (exit 1 if so, 2 if unreadable)"),
}
_BENCHES: dict[str, tuple[str, str, str, str]] = {
    "mq": ("shm_broadcast.cli", "add_bench_args", "run_bench",
           "message queue latency/throughput vs gloo and pickle+zmq"),
    "mq-hotpath": ("shm_broadcast.bench.hotpath", "add_args", "run",
                   "the queue's CPU cost per message, writer and reader in one process"),
    "mq-remote": ("shm_broadcast.bench.remote", "add_args", "run",
                  "round trips over the queue's TCP path (CURVE) vs plain zmq, pickle and raw"),
    "collectives": ("coordinator.bench.torch_collectives", "add_args", "run",
                    "CPU shared-memory collectives vs gloo"),
    "engine": ("coordinator.bench.cli", "add_args", "run",
               "the demo's step loop without the model: periodic metadata through the TP "
               "broadcaster plus a TP all_reduce per layer; latency and CPU per rank"),
    "trace": ("coordinator.bench.trace_overhead", "add_args", "run",
              "the flight recorder's cost per call: all_reduce and the queue round trip "
              "with the recorder on and off, interleaved"),
    "p2p": ("coordinator.bench.p2p", "add_args", "run",
            "tensor dicts between two pipeline stages: shared-memory links vs the CPU group"),
}


def _load(module: str, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser],
         table: dict[str, tuple[str, str, str, str]], argv: Sequence[str]) -> None:
    for cmd, (module, add_fn, run_fn, help_text) in table.items():
        p = sub.add_parser(cmd, help=help_text, description=help_text)
        # Only import the module of the command actually used (keeps --help fast).
        if cmd in argv:
            _load(module, add_fn)(p)
        p.set_defaults(_run=(module, run_fn))


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Build the argument parser (subcommand options load for the chosen command)."""
    parser = argparse.ArgumentParser(
        prog="groupcoord",
        description="groupcoord: process-group coordination for LLM serving engines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add(sub, _COMMANDS, argv)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(_BENCHES))
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    _add(bsub, _BENCHES, argv)
    # the parser whose usage a command line that names no runnable command gets
    parser.set_defaults(_usage=parser)
    bench.set_defaults(_usage=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``groupcoord`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    target = getattr(args, "_run", None)
    if target is None:
        usage: argparse.ArgumentParser = getattr(args, "_usage", parser)
        usage.print_usage(sys.stderr)
        what = "BENCH" if usage is not parser else "COMMAND"
        print(f"{usage.prog}: error: name a {what} (see {usage.prog} --help)", file=sys.stderr)
        return 2
    module, fn = target
    from shm_broadcast.errors import GroupCoordError

    try:
        return int(_load(module, fn)(args) or 0)
    except GroupCoordError as e:  # a failure this project names: its message, no traceback
        print(f"groupcoord: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the command's own cleanup has run on the way out
        print("groupcoord: interrupted", file=sys.stderr)
        return 130  # as a shell reports a command ended by SIGINT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
